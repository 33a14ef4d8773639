"""The sequence layouts: one column of rows per sequence (``sequence`` when max_seqs is 1,
``batched-sequence`` with one column per sequence otherwise).

Token i of a step writes row ``(position % rows) * columns + seq_cols[i]`` of its layer's store;
flat layers have ``rows = capacity``, ring (sliding-window) layers ``rows = window +
max_step_tokens - 1`` (fewer, ``capacity``, when flat layers bound every sequence to ``capacity``
tokens). The GPU's planned attention reads each query's column through ``seq_info`` runs
(``sequence_segments``). On CPU backends the session lists, per layer kind, the slots a sequence holds
in position order (``gather_values``): a decode reads its own column's rows, a prefill chunk reads
its column once for all its tokens, and no step reads another sequence's rows or the capacity.
"""

from dataclasses import dataclass

from pipeline.kv.gather import gather_buffers, gather_call, gather_values
from pipeline.kv.layouts import (
    AttentionKernel,
    KVLayout,
    LayerStore,
    Pool,
    SeqState,
    StepBuffer,
)


@dataclass(frozen=True)
class SequenceLayout(KVLayout):
    manifest_names = ("sequence", "batched-sequence")

    @classmethod
    def build(cls, spec, model_args) -> "SequenceLayout":
        capacity, step = spec.capacity, spec.max_step_tokens
        layer_kv = model_args.layer_kv()
        max_seq_len = capacity if any(layer.window == 0 for layer in layer_kv) else None
        layers = []
        for layer in layer_kv:
            if layer.window:
                # a step of max_step_tokens writes that many rows while its first query still reads the
                # window behind it; a sequence that never passes capacity tokens never wraps capacity rows
                ring_rows = layer.window + step - 1
                if max_seq_len is not None:
                    ring_rows = min(ring_rows, max_seq_len)
                layers.append(LayerStore("ring", ring_rows, layer.window))
            else:
                layers.append(LayerStore("flat", capacity, 0))
        return cls(
            layout="sequence" if spec.max_seqs == 1 else "batched-sequence", max_seqs=spec.max_seqs,
            capacity=capacity, max_step_tokens=step, causal=spec.causal, n_kv_heads=model_args.n_kv_heads,
            head_dim=model_args.head_dim, dtype=spec.dtype, layers=tuple(layers), max_seq_len=max_seq_len)

    @property
    def columns(self) -> int:
        return self.max_seqs if self.layout == "batched-sequence" else 1

    def step_buffers(self) -> list[StepBuffer]:
        buffers = [StepBuffer("seq_cols", ("n_tokens",))] if self.columns > 1 else []
        if not self.planned:
            return buffers + gather_buffers(self)
        return buffers + [StepBuffer(f"seq_info_{kind}", (self.max_segments, 4)) for kind in self.kinds]

    def constants(self) -> dict[str, int]:
        constants = {"get_offgraph_kv_max_seqs": self.max_seqs, "get_offgraph_kv_seq_capacity": self.capacity}
        if "ring" in self.kinds:
            constants["get_offgraph_kv_ring_rows"] = self.rows_of("ring")
        return constants

    def attention_scratch_bytes(self) -> int:
        # the ATen attention gathers the keys of its two groups at their bounds (the program is planned
        # for them): a column per token attending alone, and one column for the block
        column = max(2 * layer.rows * self.n_kv_heads * self.head_dim * self.gathered_item_bytes for layer in self.layers)
        return (max(self.max_step_tokens, self.max_seqs) + 1) * column

    def write_slots(self, call, pos, layer: LayerStore, step: dict):
        import torch

        aten = torch.ops.aten
        slots = call(aten.mul.Scalar, (call(aten.remainder.Scalar, (pos, layer.rows)), self.columns))
        return call(aten.add.Tensor, (slots, step["seq_cols"])) if "seq_cols" in step else slots

    def attend(self, call, q, k_store, v_store, pos, layer: LayerStore, step: dict, scale: float, kernel: AttentionKernel,
               plans: dict, q_meta, v_meta, scales: tuple | None = None):
        import torch

        aten = torch.ops.aten
        if not kernel.planned:  # the slots the session listed: each query's own sequence's rows
            return gather_call(self, call, kernel, q, k_store, v_store, pos, step, layer.kind, scale, layer.window, scales)
        cols = step["seq_cols"] if "seq_cols" in step else call(aten.zeros_like.default, (pos,))
        seq_info = step[f"seq_info_{layer.kind}"]
        if layer.kind not in plans:  # every layer of a kind has the same bounds and shapes: one plan
            plans[layer.kind] = call(kernel.plan, (
                pos, cols, seq_info, self.columns, self.causal, layer.window, q_meta.shape[1],
                self.n_kv_heads, self.head_dim, v_meta.shape[-1], q_meta.element_size()))
        return call(kernel.attend, (
            q, k_store, v_store, pos, plans[layer.kind], self.columns, scale, self.causal, layer.window))

    def pool(self) -> "ColumnPool":
        return ColumnPool(self.max_seqs)

    def holds_prefix(self, length: int, seq: SeqState) -> bool:
        # every layer of the column: a flat layer always, a ring layer by what later positions overwrote
        return length <= seq.length and all(prefix_rows_held(length, seq.written, layer.rows, layer.window)
                                            for layer in self.layers)

    def step_buffer_values(self, order: list[tuple[SeqState, int]], chosen: list[int], pool: Pool) -> dict:
        import torch

        buffers = {"seq_cols": torch.tensor([seq.slot for seq, n in order for _ in range(n)], dtype=torch.int64)}
        if not self.planned:
            return buffers | gather_values(order, self._keys_of)
        for kind in self.kinds:
            rows = self.rows_of(kind)
            segments = [run for seq, n in order for run in sequence_segments(seq.length + n, rows, seq.slot)]
            info = torch.zeros(self.max_segments, 4, dtype=torch.int64)
            if segments:
                info[: len(segments)] = torch.tensor(segments, dtype=torch.int64)
            buffers[f"seq_info_{kind}"] = info
        return buffers

    def _keys_of(self, seq: SeqState, n: int) -> dict:
        """Per layer kind, the slots the sequence holds once the step wrote its n tokens, in position
        order (the last min(length, rows) positions), and their positions."""
        import torch

        length = seq.length + n
        keys = {}
        for kind in self.kinds:
            rows = self.rows_of(kind)
            positions = torch.arange(max(0, length - rows), length, dtype=torch.int64)
            keys[kind] = ((positions % rows) * self.columns + seq.slot, positions)
        return keys


class ColumnPool(Pool):
    """The columns' generations: a column's count goes up each time a sequence takes it, so the rows a
    released sequence left in its column are held while the count is the one it left (``retain``'s
    receipt); nothing else needs keeping (a column's rows stay as written until a new sequence writes)."""

    def __init__(self, columns: int):
        self.generation = [0] * columns

    def take(self, slot: int) -> None:
        self.generation[slot] += 1

    def retain(self, seq: SeqState) -> int:
        return self.generation[seq.slot]

    def holds(self, seq: SeqState, receipt) -> bool:
        return receipt is not None and self.generation[seq.slot] == receipt

    def adopt(self, old: SeqState, receipt, new: SeqState, length: int) -> None:
        if new.slot != old.slot:
            raise ValueError(f"a sequence adopts column {old.slot}'s rows in that column, not in column {new.slot}")


LAYOUT = SequenceLayout


def prefix_rows_held(length: int, written: int, rows: int, window: int) -> bool:
    """Whether a column of ``rows`` rows (position q at row q % rows), written in position order up to
    position ``written - 1``, holds what a sequence resuming at ``length`` tokens reads.

    Row r holds the last position written to it: position q is still there iff no later one,
    q + rows, was written, i.e. q >= written - rows. The resumed sequence's first query, at position
    ``length``, reads keys from ``length - window + 1`` (a ring layer's window; a flat layer, window 0,
    reads from 0) and later queries read later keys, or rows they wrote themselves; rows of older
    positions are listed but masked by the window. So a prefix of ``length`` is held iff
    ``max(0, length - window + 1) >= written - rows`` (or ``length == 0``). For a ring of
    ``window + max_step_tokens - 1`` rows that has wrapped (``written > rows``), that is
    ``length >= written - max_step_tokens``: only the last steps' worth of a wrapped ring's prefixes.
    A flat layer (rows = capacity >= written) always holds every prefix."""
    if length == 0:
        return True
    first_read = 0 if window == 0 else max(0, length - window + 1)
    return first_read >= written - rows


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
