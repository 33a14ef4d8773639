"""What every role shares: the names of the roles and of the artifact's methods, a method's bounds
(``MethodSpec``), a KV rule (``KVRule``), the ``Role`` base class and the manifest's KV section."""

from dataclasses import dataclass
from typing import ClassVar

TARGET, DRAFT, VISION = "target", "draft", "vision"
ABSENT = "none"  # a config group's option for "this artifact has no such model"

# the artifact's method names (Muse Glimmer's), by the role that runs them
EMBED = "embed_text"
TARGET_STEP = "target_forward_from_embeddings"
DRAFT_STEP = "draft_forward"
VISION_ENCODER = "vision_encoder"

EXPORT_WIDTH = 64  # the export's token axes' upper bound (any width > 1 traces the same graph)
STORE_MODULE = "kv_store"  # the target's stores are buffers kv_store.k_<layer>, kv_store.v_<layer>


def impose_settings(cfg, section: str, settings: dict, given: set[str], source: str) -> None:
    """Merge ``settings`` (what ``source`` implies) into ``cfg[section]``; a command-line override (``given``)
    that contradicts one is an error naming both values."""
    from pipeline.errors import ConfigError

    for key, value in settings.items():
        if f"{section}.{key}" in given and cfg[section][key] != value:
            raise ConfigError(f"{section}.{key}={cfg[section][key]} contradicts {source}, which has {key}={value}; "
                              "drop the override")
    cfg[section].merge_with(settings)


@dataclass(frozen=True)
class MethodSpec:
    """One method of a role: its name and bounds (``width``: most tokens of a step, ``rows``: most
    logit rows); ``example_inputs`` makes its torch inputs from these."""

    name: str
    width: int = 0
    rows: int = 0


@dataclass(frozen=True)
class KVRule:
    """What a role's KV layout needs beyond the ``kv`` config: its attention's causality, the widest
    step its layout bounds (``max_step_tokens``) and its step method's token axis (``step_width``)."""

    causal: bool
    max_step_tokens: int
    step_width: int


class Role:
    """One row of the role table; subclasses fill in what differs."""

    name: ClassVar[str]
    section: ClassVar[str]  # its config section (and Hydra group)
    stage: ClassVar[str]  # the stage that builds and exports it
    required: ClassVar[bool] = False  # every artifact has it (the target)
    store: ClassVar[str | None] = None  # prefix of its KV store buffers; None: it keeps no KV
    constant_prefix: ClassVar[str] = "get_"  # its KV constant methods' prefix

    def __repr__(self) -> str:
        return f"<role {self.name}>"

    # --- from the config (torch-free) ---

    def present(self, cfg) -> bool:
        """The one place a config's ``none`` option means "no such model"."""
        return self.required or cfg[self.section].name != ABSENT

    def preset(self, cfg) -> str:
        return cfg[self.section].name

    def impose(self, cfg, given: set[str]) -> None:
        """Write into ``cfg`` (a copy) the settings this role's family or checkpoint imply; an override
        (``given``: the command line's keys) that contradicts one is an error naming both values."""

    def args(self, cfg, parts: dict):
        raise NotImplementedError

    def check(self, cfg, part, parts: dict, stages: set[str]) -> None:
        """Refusals of this role's settings (after its args are derived, before any layout)."""

    def check_with_layouts(self, cfg, part, parts: dict, stages: set[str]) -> None:
        """Refusals that need the layouts (an image's tokens against a sequence's context)."""

    def kv_rule(self, cfg, part, parts: dict) -> KVRule | None:
        return None

    def methods(self, cfg, part, parts: dict, width: dict, max_seqs: int) -> list[MethodSpec]:
        """Its methods with their bounds, ``width[role]`` being each attending role's step width."""
        raise NotImplementedError

    def manifest_section(self, cfg, part, parts: dict) -> dict:
        raise NotImplementedError

    def constants(self, section: dict, sections: dict) -> dict:
        """Its constant methods of the program, from the manifest's sections."""
        return {}

    def episode_spill(self, part) -> int:
        """Tokens a validation sequence may carry beyond its prompt and decodes because of this role."""
        return 0

    # --- at build time (torch) ---

    def build(self, cfg, part, built: dict, workdir) -> tuple:
        """The eager module (random from its seed or loaded) and what the stage gives beside it."""
        raise NotImplementedError

    def views(self, part, built: dict) -> dict:
        """{method: nn.Module} that ``torch.export`` traces."""
        raise NotImplementedError

    def example_inputs(self, spec: MethodSpec, part, parts: dict, dtype, view):
        """``MethodInputs`` of ``spec`` (``pipeline/passes/lower_offgraph_kv.py``); ``view``: the module traced."""
        raise NotImplementedError


def _dim(name: str, upper: int):
    # A dimension that can only be 1 is exported static: torch.export rejects min == max.
    from torch.export import Dim

    return Dim(name, min=1, max=upper) if upper > 1 else Dim.STATIC


def kv_section(layout, vocab_size: int) -> dict:
    """The manifest's KV facts of one attending role."""
    return {
        "layout": layout.layout,
        "vocab_size": vocab_size,  # token ids a step takes: [0, vocab_size)
        "max_seqs": layout.max_seqs,
        "max_seq_len": layout.max_seq_len,
        "max_segments": layout.max_segments,
        "causal": layout.causal,
        "columns": layout.columns,
        "capacity": layout.capacity,
        "max_step_tokens": layout.max_step_tokens,
        "step_width": layout.step_width,
        "dtype": layout.dtype,
        "n_kv_heads": layout.n_kv_heads,
        "head_dim": layout.head_dim,
        "layers": [
            {"kind": layer.kind, "rows": layer.rows, "window": layer.window, "store_shape": list(layout.store_shape(layer))}
            for layer in layout.layers
        ],
        "attention": "planned" if layout.planned else "gather",  # which step buffers the session fills
        "step_buffers": [{"name": b.name, "shape": list(b.shape), "dtype": b.dtype} for b in layout.step_buffers()],
        "kv_bytes_per_layer": layout.kv_bytes_per_layer(),
        "kv_bytes_total": sum(layout.kv_bytes_per_layer()),
    } | ({"cpu_kernel": "native"} if layout.native else {})  # the session loads pipeline/kernels/native.py first
