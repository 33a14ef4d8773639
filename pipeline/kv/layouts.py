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

from dataclasses import dataclass

from pipeline.errors import ConfigError

CELL_OWNER_BITS = 63  # owners are an int64 bitset; the sign bit stays clear
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the KV store dtypes


class KVConfigError(ConfigError):
    """A KV setting that cannot be built; the message names setting, value and range."""


@dataclass(frozen=True)
class LayerStore:
    kind: str  # "flat" | "ring"
    rows: int  # rows per column (cells of the pool for the cell layout)
    window: int  # 0 for flat layers


@dataclass(frozen=True)
class StepBuffer:
    name: str
    shape: tuple  # ints, or "n_tokens" for the step's token axis
    dtype: str = "int64"


@dataclass(frozen=True)
class KVLayout:
    layout: str  # "sequence" | "batched-sequence" | "cell"
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

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


    @property
    def columns(self) -> int:
        return self.max_seqs if self.layout == "batched-sequence" else 1

    @property
    def max_segments(self) -> int:
        return 2 * self.max_seqs

    @property
    def kinds(self) -> list[str]:
        """Layer kinds present, in a fixed order: one seq_info buffer each."""
        return [k for k in ("flat", "ring") if any(layer.kind == k for layer in self.layers)]

    def rows_of(self, kind: str) -> int:
        return next(layer.rows for layer in self.layers if layer.kind == kind)

    def store_shape(self, layer: LayerStore) -> tuple[int, int, int]:
        return (layer.rows * self.columns, self.n_kv_heads, self.head_dim)

    def step_buffers(self) -> list[StepBuffer]:
        if self.layout == "cell":
            return [
                StepBuffer("cell_ids", ("n_tokens",)),
                StepBuffer("q_seq_bits", ("n_tokens",)),
                StepBuffer("cell_pos", (self.capacity,)),
                StepBuffer("cell_owners", (self.capacity,)),
            ]
        buffers = [StepBuffer("seq_cols", ("n_tokens",))] if self.layout == "batched-sequence" else []
        return buffers + [StepBuffer(f"seq_info_{kind}", (self.max_segments, 4)) for kind in self.kinds]

    def kv_bytes_per_layer(self) -> list[int]:
        """K and V store bytes of each layer: 2 * rows * columns * Hkv * D * itemsize."""
        item = DTYPE_BYTES[self.dtype]
        return [2 * layer.rows * self.columns * self.n_kv_heads * self.head_dim * item for layer in self.layers]


def build_layout(kv_cfg, model_args) -> KVLayout:
    """Validate the ``kv`` config against the model and derive the layout."""
    name, max_seqs, capacity, step = kv_cfg.layout, kv_cfg.max_seqs, kv_cfg.capacity, kv_cfg.max_step_tokens
    if name not in ("sequence", "cell"):
        raise KVConfigError(f"kv.layout={name} is not a layout; choose sequence or cell")
    if max_seqs < 1:
        raise KVConfigError(f"kv.max_seqs={max_seqs} must be at least 1")
    if capacity < 1:
        raise KVConfigError(f"kv.capacity={capacity} must be a positive number of tokens")
    if not 1 <= step <= capacity:
        raise KVConfigError(f"kv.max_step_tokens={step} must lie in [1, kv.capacity={capacity}]")
    if name == "cell" and max_seqs > CELL_OWNER_BITS:
        raise KVConfigError(
            f"kv.max_seqs={max_seqs} exceeds the cell layout's limit of {CELL_OWNER_BITS} "
            "(owners are an int64 bitset); use kv=sequence for more sequences"
        )
    if name == "cell" and max_seqs * step > capacity:
        raise KVConfigError(
            f"kv.max_seqs={max_seqs} is more than the cell pool allows: {max_seqs} sequences of one "
            f"{step}-token step need {max_seqs * step} cells, kv.capacity={capacity}; "
            f"raise kv.capacity or lower kv.max_seqs to at most {capacity // step}"
        )
    if kv_cfg.dtype not in DTYPE_BYTES:
        raise KVConfigError(f"kv.dtype={kv_cfg.dtype} is not a KV store dtype; choose one of {', '.join(DTYPE_BYTES)}")
    window = model_args.sliding_window
    if window > capacity:
        raise KVConfigError(
            f"model.sliding_window={window} is larger than kv.capacity={capacity}; "
            f"the window must fit in the context (at most {capacity})"
        )
    layer_kv = model_args.layer_kv()
    max_seq_len = capacity if name == "cell" or any(layer.window == 0 for layer in layer_kv) else None
    layers = []
    for layer in layer_kv:
        if name == "cell":
            layers.append(LayerStore("ring" if layer.window else "flat", capacity, layer.window))
        elif layer.window:
            # a step of max_step_tokens writes that many rows while its first query still reads the
            # window behind it; a sequence that never passes capacity tokens never wraps capacity rows
            ring_rows = layer.window + step - 1
            if max_seq_len is not None:
                ring_rows = min(ring_rows, max_seq_len)
            layers.append(LayerStore("ring", ring_rows, layer.window))
        else:
            layers.append(LayerStore("flat", capacity, 0))
    layout = "cell" if name == "cell" else ("sequence" if max_seqs == 1 else "batched-sequence")
    return KVLayout(
        layout=layout, max_seqs=max_seqs, capacity=capacity, max_step_tokens=step, causal=kv_cfg.causal,
        n_kv_heads=model_args.n_kv_heads, head_dim=model_args.head_dim,
        dtype=kv_cfg.dtype, layers=tuple(layers), max_seq_len=max_seq_len,
    )


def sequence_segments(length: int, rows: int, column: int) -> list[tuple[int, int, int, int]]:
    """Runs of rows holding the last min(length, rows) positions of a sequence.

    Position p lives in row p % rows, so the readable history [length - n, length)
    is one run, or two when it wraps past the last row.
    """
    n = min(length, rows)
    if n == 0:
        return []
    first_pos = length - n
    first_row = first_pos % rows
    head = min(n, rows - first_row)
    runs = [(column, first_row, head, first_pos)]
    if n > head:
        runs.append((column, 0, n - head, first_pos + head))
    return runs
