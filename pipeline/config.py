"""Config schemas, registered in Hydra's ConfigStore. Values live in conf/*.yaml."""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from pipeline.models.transformer import ModelArgs


@dataclass
class ModelConfig(ModelArgs):
    name: str = MISSING
    seed: int = 0  # weights are random-initialised from this seed: no downloads
    dtype: str = "float32"  # compute dtype of the exported program: float32 | bfloat16 | float16


@dataclass
class DraftConfig:
    name: str = "none"


@dataclass
class VisionConfig:
    name: str = "none"


@dataclass
class KVConfig:
    layout: str = "sequence"  # sequence | cell
    max_seqs: int = 1  # sequences one artifact serves; 1 = solo
    capacity: int = 128  # sequence: context per sequence; cell: cells in the shared pool
    max_step_tokens: int = 16  # widest step (prefill chunk) a method accepts
    causal: bool = True
    dtype: str = "float32"


@dataclass
class BackendConfig:
    name: str = "xnnpack"  # xnnpack | portable | cuda


@dataclass
class ValidateConfig:
    metric: str = "range"  # range: max|got - oracle| / oracle logit range; norm: ||got - oracle|| / ||oracle||
    tolerance: float = 1e-4  # bound on the metric, over every step of every sequence
    prompt_lengths: list[int] = field(default_factory=lambda: [37, 9, 23, 50, 5])
    decode_steps: int = 40
    seed: int = 0
    # backend=cuda: how the GPU runs the lowered graphs (pipeline/runtime/aoti.py). inductor: torch.compile
    # with Inductor's C++ wrapper; aoti: AOTInductor packages, as the CudaBackend builds them (their loader
    # segfaults on the lent H200, torch 2.11 / CUDA 13)
    runtime: str = "inductor"


@dataclass
class BuildConfig:
    experiment_name: str = "default"
    stages: list[str] = field(default_factory=lambda: ["export", "lower_kv", "compile", "validate"])
    output_root: str = "outputs"
    force: bool = False  # build a new version even when an identical one exists
    model: ModelConfig = MISSING
    draft: DraftConfig = MISSING
    vision: VisionConfig = MISSING
    kv: KVConfig = MISSING
    backend: BackendConfig = MISSING
    validate: ValidateConfig = field(default_factory=ValidateConfig)


def register() -> None:
    ConfigStore.instance().store(name="build_schema", node=BuildConfig)
