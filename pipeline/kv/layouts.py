"""KV layouts: store shapes, step buffers and the index math shared by the
lowering pass, the runtime session and the manifest.

| layout           | store per layer       | write slot of token i                 |
| sequence (solo)  | [rows, Hkv, D]        | position % rows                      |
| batched-sequence | [rows * S, Hkv, D]    | (position % rows) * S + seq_cols[i]   |
| cell             | [n_cells, Hkv, D]     | cell_ids[i] (chosen by the runtime)   |

Flat layers have ``rows = capacity``; ring (sliding-window) layers
``rows = window + max_step_tokens - 1``, so a step never overwrites a key that
an earlier query of the same step still sees (fewer, ``capacity``, when flat
layers bound every sequence to ``capacity`` tokens: the ring never wraps). A
sequence's readable history is then at most two runs of rows (the wrap):
``max_segments = 2 * max_seqs``.

Free of torch: the config checks derive the layout before anything heavy loads.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from pipeline.errors import ConfigError

CELL_OWNER_BITS = 63  # owners are an int64 bitset; the sign bit stays clear
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}  # the KV store dtypes
SCALE_BYTES = {"int8": 4}  # a quantized store's float32 scale per token and KV head (pipeline/kv/quantize.py)


class KVConfigError(ConfigError):
    """A KV setting that cannot be built; the message names setting, value and range."""


@dataclass(frozen=True)
class AttentionKernel:
    """The attention ops a backend gives the store lowering (``Backend.attention_kernel``): the ATen
    attention over the store slots the host lists for each query (``gather``: ``kvcache::sdpa_gather``),
    or a plan computed once per step and layer kind (``plan``: ``kvcache::sdpa_varlen_plan``) and the
    attention it drives (``attend``: ``kvcache::sdpa_varlen_attend``)."""

    gather: object = None
    plan: object = None
    attend: object = None
    gather_q8: object = None  # ``gather`` over 8-bit stores and their scales (kv.dtype=int8): ``kvcache::sdpa_gather_q8``

    @property
    def planned(self) -> bool:
        return self.plan is not None


@dataclass(frozen=True)
class LayerStore:
    kind: str  # "flat" | "ring"
    rows: int  # rows per column (cells of the pool for the cell layout)
    window: int  # 0 for flat layers


@dataclass(frozen=True)
class StepBuffer:
    name: str
    # per axis an int, or a name: "n_tokens" (the step's token axis) or a length the session sets each
    # step, from 1 to ``KVLayout.dim_bound(name)`` (the buffer carries a size the graph reads)
    shape: tuple
    dtype: str = "int64"


@dataclass
class SeqState:
    """What a session knows of one live sequence; a layout's ``Pool`` may add to it (its cells)."""

    slot: int  # column (sequence layouts) or owner bit (cell layout)
    length: int = 0
    cells: list[int] = field(default_factory=list)
    # one past the highest position its rows were ever written at (the kept tokens, and the rows a
    # rejected speculative block or a failed step wrote past them; an adopted sequence inherits the
    # released one's): a ring row holds position q only while q >= written - rows (``prefix_rows_held``)
    written: int = 0


class Pool:
    """A layout's per-session state beyond the sequences' columns and lengths (the cell pool), with
    the transactional steps the session takes: ``choose`` what a step will write (nothing taken),
    ``writing`` just before the program runs, ``commit`` once it ran, ``release`` a sequence (the
    step's buffers are the layout's ``step_buffer_values``).

    The prefix cache's side: ``retain`` releases a sequence but keeps its rows, returning a receipt;
    ``holds`` says whether those rows are still untouched; ``adopt`` hands the rows of its first
    positions to a new sequence; ``evict`` gives them up. A pool that keeps nothing (this base) holds
    nothing: ``holds`` is False, so nothing is ever adopted from it."""

    def take(self, slot: int) -> None:
        """A new sequence takes ``slot`` (its column, in a sequence layout)."""

    def choose(self, n_tokens: int) -> list[int]:
        return []

    def writing(self, chosen: list[int]) -> None:
        """The program is about to write ``chosen`` (whether it then succeeds or fails)."""

    def commit(self, order: list[tuple[SeqState, int]], chosen: list[int]) -> None:
        pass

    def release(self, seq: SeqState) -> None:
        pass

    def retain(self, seq: SeqState) -> object:
        self.release(seq)
        return None

    def holds(self, seq: SeqState, receipt) -> bool:
        return False

    def adopt(self, old: SeqState, receipt, new: SeqState, length: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no released rows to adopt")

    def evict(self, seq: SeqState, receipt) -> None:
        pass

    def snapshot(self) -> tuple:
        return ()


@dataclass(frozen=True)
class KVLayout:
    """What every layout has; a layout module (``layout_<name>.py``) subclasses it with its store
    index math (``write_slots``), its attention (``attend``), its step buffers and the state a
    session keeps for it (``pool``, ``step_buffer_values``). The pass, the session, the manifest
    and the config checks ask the object; none of them branches on the layout's name."""

    layout: str  # "sequence" | "batched-sequence" | "cell": the manifest's name of it
    max_seqs: int
    capacity: int  # per-sequence context (sequence layouts) or pool cells (cell)
    max_step_tokens: int
    causal: bool
    n_kv_heads: int
    head_dim: int
    dtype: str  # a DTYPE_BYTES key
    layers: tuple[LayerStore, ...]
    # tokens one sequence may hold: the flat layers' context (the pool, for the cell layout);
    # None when every layer is a ring, which keeps a window however long the sequence grows
    max_seq_len: int | None
    # tokens one step of the model's step method takes (its token axis): a prefill chunk, a decode of
    # every sequence, a verification of every sequence's draft block; a draft's context and blocks
    step_width: int = 0
    # the backend's attention: planned on the GPU from seq_info (``kvcache::sdpa_varlen_plan``), else
    # gathered from the store slots the host lists per query (``kvcache::sdpa_gather``, GATHER_BUFFERS)
    planned: bool = False
    # CPU backends: the gathered attention as the native kernel (kv.cpu_kernel=native), kept whole in the program
    native: bool = False

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def columns(self) -> int:
        return 1

    @property
    def max_segments(self) -> int:
        return 2 * self.max_seqs

    @property
    def kinds(self) -> list[str]:
        """Layer kinds present, in a fixed order: one seq_info buffer each."""
        return [k for k in ("flat", "ring") if any(layer.kind == k for layer in self.layers)]

    def rows_of(self, kind: str) -> int:
        return next(layer.rows for layer in self.layers if layer.kind == kind)

    def key_kinds(self) -> list[str]:
        """The key sets a gathered step lists: one per layer kind (each its own rows)."""
        return self.kinds

    def key_rows(self, kind: str) -> int:
        """The most keys one query of a key set may read."""
        return self.rows_of(kind)

    def dim_bound(self, dim: str) -> int:
        """The largest value of a step buffer's named dimension other than ``n_tokens``."""
        if dim == "block_tokens":
            return self.step_width or max(self.max_step_tokens, self.max_seqs)
        for prefix in ("one_tokens_", "one_keys_", "block_keys_"):
            kind = dim.removeprefix(prefix)
            if dim.startswith(prefix) and kind in self.key_kinds():
                return self.dim_bound("block_tokens") if prefix == "one_tokens_" else self.key_rows(kind)
        raise ValueError(f"step buffer dimension {dim!r} is not one of this layout's: n_tokens, block_tokens, or "
                         f"one_tokens_<kind>, one_keys_<kind>, block_keys_<kind> for {self.key_kinds()}")

    def store_shape(self, layer: LayerStore) -> tuple[int, int, int]:
        return (layer.rows * self.columns, self.n_kv_heads, self.head_dim)

    @property
    def quantized(self) -> bool:
        """The stores hold integers and a scale per token and KV head (``kv.dtype=int8``)."""
        return self.dtype in SCALE_BYTES

    @property
    def gathered_item_bytes(self) -> int:
        """Bytes the CPU attention's gathered copy takes per stored element: the store's, or for a quantized
        store its float32 conversion (the 8-bit copies before it are a quarter of that)."""
        return 4 if self.quantized else DTYPE_BYTES[self.dtype]

    def scale_shape(self, layer: LayerStore) -> tuple[int, int]:
        """A quantized store's scales: one per slot and KV head."""
        return (layer.rows * self.columns, self.n_kv_heads)

    def bytes_per_token(self) -> int:
        """K and V bytes one token takes in one layer: 2 * Hkv * (D * itemsize + the scale's bytes)."""
        return 2 * self.n_kv_heads * (self.head_dim * DTYPE_BYTES[self.dtype] + SCALE_BYTES.get(self.dtype, 0))

    def kv_bytes_per_layer(self) -> list[int]:
        """K and V store bytes of each layer (their scales' too): rows * columns * ``bytes_per_token``."""
        return [layer.rows * self.columns * self.bytes_per_token() for layer in self.layers]

    # --- what each layout defines ---

    manifest_names: ClassVar[tuple[str, ...]] = ()  # the ``layout`` values of its manifests

    @classmethod
    def build(cls, spec: "KVSpec", model_args) -> "KVLayout":
        """The layout for checked settings (``build_layout`` checked what all layouts share)."""
        raise NotImplementedError

    @property
    def session_length_limit(self) -> int | None:
        """Tokens a session lets one sequence reach (None: the layout's pool bounds it, or nothing)."""
        return self.max_seq_len

    def step_buffers(self) -> list[StepBuffer]:
        raise NotImplementedError

    def constants(self) -> dict[str, int]:
        """The layout's constant methods of the program (beyond the ones every layout has)."""
        raise NotImplementedError

    def attention_scratch_bytes(self) -> int:
        """Bytes the CPU attention materialises for the widest step (the build's memory estimate)."""
        return 0

    def check_episode(self, totals: list[int], validate_setting: str) -> None:
        """Refuse a validation episode (sequence lengths ``totals``, longest first) that cannot fit."""

    def write_slots(self, call, pos, layer: LayerStore, step: dict):
        """Graph nodes: the store row each of the step's tokens writes (pass: ``call`` =
        graph.call_function, ``step`` = the step-buffer placeholders by name)."""
        raise NotImplementedError

    def attend(self, call, q, k_store, v_store, pos, layer: LayerStore, step: dict, scale: float, kernel: AttentionKernel,
               plans: dict, q_meta, v_meta, scales: tuple | None = None):
        """Graph nodes: the layer's attention over its store, [T, Hq, Dv] (``scales``: an 8-bit store's)."""
        raise NotImplementedError

    def pool(self) -> Pool:
        return Pool()

    # a sequence's rows are its slot's column: taking the slot for another sequence takes its rows
    # (sequence layouts); False: a slot is an owner bit and rows are the pool's (cell layout)
    rows_in_column: ClassVar[bool] = True

    def holds_prefix(self, length: int, seq: SeqState) -> bool:
        """Whether a sequence resuming at ``length`` tokens from the (untouched) rows of the released
        ``seq`` (``length <= seq.length``) reads only rows that still hold its positions."""
        raise NotImplementedError

    def step_buffer_values(self, order: list[tuple[SeqState, int]], chosen: list[int], pool: Pool) -> dict:
        """The step buffers' tensors for a step of ``order`` (sequence, tokens) writing ``chosen``."""
        raise NotImplementedError


def layout_names() -> list[str]:
    """The ``kv.layout`` values: the ``layout_<name>`` modules of this package (no import)."""
    import pkgutil

    import pipeline.kv as package

    return sorted(m.name.removeprefix("layout_") for m in pkgutil.iter_modules(package.__path__) if m.name.startswith("layout_"))


def _layout_class(name: str) -> type:
    import importlib

    return importlib.import_module(f"pipeline.kv.layout_{name}").LAYOUT


@dataclass(frozen=True)
class KVSpec:
    """One model's KV settings: the ``kv`` config's, with the model's causality and step width."""

    layout: str
    max_seqs: int
    capacity: int
    max_step_tokens: int
    causal: bool
    dtype: str


def build_layout(kv_cfg, model_args, causal: bool = True, max_step_tokens: int | None = None,
                 step_width: int | None = None) -> KVLayout:
    """Validate the ``kv`` config against a model and derive its layout: causal or not, steps of
    ``max_step_tokens`` (default ``kv.max_step_tokens``), a step method of ``step_width`` tokens (default:
    the widest step or a decode of every sequence). The build plan calls it once per attending role."""
    name, max_seqs, capacity, step = kv_cfg.layout, kv_cfg.max_seqs, kv_cfg.capacity, kv_cfg.max_step_tokens
    if name not in layout_names():
        raise KVConfigError(f"kv.layout={name} is not a layout; choose {' or '.join(layout_names())}")
    if max_seqs < 1:
        raise KVConfigError(f"kv.max_seqs={max_seqs} must be at least 1")
    if capacity < 1:
        raise KVConfigError(f"kv.capacity={capacity} must be a positive number of tokens")
    if not 1 <= step <= capacity:
        raise KVConfigError(f"kv.max_step_tokens={step} must lie in [1, kv.capacity={capacity}]")
    if kv_cfg.dtype not in DTYPE_BYTES:
        raise KVConfigError(f"kv.dtype={kv_cfg.dtype} is not a KV store dtype; choose one of {', '.join(DTYPE_BYTES)}")
    window = model_args.sliding_window
    if window > capacity:
        raise KVConfigError(
            f"model.sliding_window={window} is larger than kv.capacity={capacity}; "
            f"the window must fit in the context (at most {capacity})"
        )
    spec = KVSpec(name, max_seqs, capacity, max_step_tokens or step, causal, kv_cfg.dtype)
    layout = _layout_class(name).build(spec, model_args)
    return dataclasses.replace(layout, step_width=step_width or max(layout.max_step_tokens, max_seqs))


def layout_from_manifest(kv: dict) -> KVLayout:
    """The layout object of a built artifact, from one model's section of its manifest."""
    classes = [_layout_class(name) for name in layout_names()]
    cls = next((c for c in classes if kv["layout"] in c.manifest_names), None)
    if cls is None:
        raise ValueError(f"manifest layout {kv['layout']!r} is none of {[n for c in classes for n in c.manifest_names]}")
    return cls(
        layout=kv["layout"], max_seqs=kv["max_seqs"], capacity=kv["capacity"], max_step_tokens=kv["max_step_tokens"],
        causal=kv["causal"], n_kv_heads=kv["n_kv_heads"], head_dim=kv["head_dim"], dtype=kv["dtype"],
        layers=tuple(LayerStore(layer["kind"], layer["rows"], layer["window"]) for layer in kv["layers"]),
        max_seq_len=kv["max_seq_len"], step_width=kv["step_width"], planned=kv["attention"] == "planned")
