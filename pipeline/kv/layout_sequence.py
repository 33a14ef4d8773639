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

import dataclasses
import math
from dataclasses import dataclass

from pipeline.kv.layouts import (
    DTYPE_BYTES,
    AttentionKernel,
    KVLayout,
    LayerStore,
    Pool,
    SeqState,
    StepBuffer,
    gather_values,
    sequence_segments,
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

    def with_backend(self, planned: bool) -> "SequenceLayout":
        # on CPU backends the flat layers attend in place (their rows are positions: a flat column never wraps)
        if planned or "flat" not in self.kinds:
            return super().with_backend(planned)
        return dataclasses.replace(self, attention="in_place")

    def in_place(self, layer: LayerStore) -> bool:
        return self.attention == "in_place" and layer.kind == "flat"

    def key_kinds(self) -> list[str]:
        return [kind for kind in self.kinds if not (self.attention == "in_place" and kind == "flat")]

    def dim_bound(self, dim: str) -> int:
        if dim.startswith("col") and dim.endswith("_tokens"):
            return self.step_width or max(self.max_step_tokens, self.max_seqs)
        return super().dim_bound(dim)

    def store_shape(self, layer: LayerStore) -> tuple[int, int, int]:
        # in place, one store per column with a scratch row past its rows (where a column the step does not
        # feed writes its placeholder token)
        return (layer.rows + 1, self.n_kv_heads, self.head_dim) if self.in_place(layer) else super().store_shape(layer)

    def stores(self, layer: LayerStore, layer_id: int) -> list[str]:
        if not self.in_place(layer):
            return super().stores(layer, layer_id)
        return [f"{kv}_{layer_id}_c{c}" for kv in "kv" for c in range(self.columns)]

    def kv_bytes_per_layer(self) -> list[int]:
        item = DTYPE_BYTES[self.dtype]
        return [len(self.stores(layer, 0)) * math.prod(self.store_shape(layer)) * item for layer in self.layers]

    def step_buffers(self) -> list[StepBuffer]:
        if self.attention == "in_place":
            columns = [b for c in range(self.columns) for b in (
                StepBuffer(f"col{c}_q", (f"col{c}_tokens",)), StepBuffer(f"col{c}_rows", (f"col{c}_tokens",)))]
            gathered = self.gather_buffers() if self.key_kinds() else []
            seq_cols = [StepBuffer("seq_cols", ("n_tokens",))] if self.columns > 1 and gathered else []
            return [*seq_cols, *columns, StepBuffer("col_starts", (self.columns,)), StepBuffer("col_out", ("n_tokens",)),
                    *gathered]
        buffers = [StepBuffer("seq_cols", ("n_tokens",))] if self.columns > 1 else []
        if not self.planned:
            return buffers + self.gather_buffers()
        return buffers + [StepBuffer(f"seq_info_{kind}", (self.max_segments, 4)) for kind in self.kinds]

    def constants(self) -> dict[str, int]:
        constants = {"get_offgraph_kv_max_seqs": self.max_seqs, "get_offgraph_kv_seq_capacity": self.capacity}
        if "ring" in self.kinds:
            constants["get_offgraph_kv_ring_rows"] = self.rows_of("ring")
        return constants

    def attention_scratch_bytes(self) -> int:
        # the gathered layers' keys of both groups at their bounds (the program is planned for them): a
        # column per token attending alone, and one column for the block; in-place layers copy no key
        gathered = [layer for layer in self.layers if not self.in_place(layer)]
        if not gathered:
            return 0
        column = max(2 * layer.rows * self.n_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype] for layer in gathered)
        return (max(self.max_step_tokens, self.max_seqs) + 1) * column

    def write_slots(self, call, pos, layer: LayerStore, step: dict):
        import torch

        aten = torch.ops.aten
        slots = call(aten.mul.Scalar, (call(aten.remainder.Scalar, (pos, layer.rows)), self.columns))
        return call(aten.add.Tensor, (slots, step["seq_cols"])) if "seq_cols" in step else slots

    def attend(self, call, q, k_store, v_store, pos, layer: LayerStore, step: dict, scale: float, kernel: AttentionKernel,
               plans: dict, q_meta, v_meta):
        import torch

        aten = torch.ops.aten
        if not kernel.planned:  # the slots the session listed: each query's own sequence's rows
            return self.gather_call(call, kernel, q, k_store, v_store, pos, step, layer.kind, scale, layer.window)
        cols = step["seq_cols"] if "seq_cols" in step else call(aten.zeros_like.default, (pos,))
        seq_info = step[f"seq_info_{layer.kind}"]
        if layer.kind not in plans:  # every layer of a kind has the same bounds and shapes: one plan
            plans[layer.kind] = call(kernel.plan, (
                pos, cols, seq_info, self.columns, self.causal, layer.window, q_meta.shape[1],
                self.n_kv_heads, self.head_dim, v_meta.shape[-1], q_meta.element_size()))
        return call(kernel.attend, (
            q, k_store, v_store, pos, plans[layer.kind], self.columns, scale, self.causal, layer.window))

    def step_buffer_values(self, order: list[tuple[SeqState, int]], chosen: list[int], pool: Pool) -> dict:
        import torch

        buffers = {"seq_cols": torch.tensor([seq.slot for seq, n in order for _ in range(n)], dtype=torch.int64)}
        if self.attention == "in_place":
            buffers |= self._column_values(order)
        if not self.planned:
            return buffers | (gather_values(order, self._keys_of) if self.key_kinds() else {})
        for kind in self.kinds:
            rows = self.rows_of(kind)
            segments = [run for seq, n in order for run in sequence_segments(seq.length + n, rows, seq.slot)]
            info = torch.zeros(self.max_segments, 4, dtype=torch.int64)
            if segments:
                info[: len(segments)] = torch.tensor(segments, dtype=torch.int64)
            buffers[f"seq_info_{kind}"] = info
        return buffers

    def _column_values(self, order: list[tuple[SeqState, int]]) -> dict:
        """The in-place layers' step buffers: per column its tokens in the step and the rows they write (a
        column the step does not feed: token 0, written to the scratch row, read from position 0), the
        column's first new position, and each token's row of the columns' outputs laid end to end."""
        import torch

        rows = self.rows_of("flat")
        fed = {}
        start = 0
        for seq, n in order:
            fed[seq.slot] = (seq, list(range(start, start + n)))
            start += n
        values, col_out, offset = {}, torch.empty(start, dtype=torch.int64), 0
        starts = torch.zeros(self.columns, dtype=torch.int64)
        for c in range(self.columns):
            if c in fed:
                seq, tokens = fed[c]
                values[f"col{c}_q"] = torch.tensor(tokens, dtype=torch.int64)
                values[f"col{c}_rows"] = torch.arange(seq.length, seq.length + len(tokens), dtype=torch.int64)
                starts[c] = seq.length
                col_out[tokens] = torch.arange(offset, offset + len(tokens))
                offset += len(tokens)
            else:
                values[f"col{c}_q"] = torch.zeros(1, dtype=torch.int64)
                values[f"col{c}_rows"] = torch.full((1,), rows, dtype=torch.int64)
                offset += 1
        return values | {"col_starts": starts, "col_out": col_out}

    def attend_in_place(self, call, get_store, q, k, v, pos, layer: LayerStore, layer_id: int, step: dict, scale: float,
                        nodes: dict):
        """Graph nodes: write each column's tokens into its own stores, then ExecuTorch's ``llama::custom_sdpa``
        over each column where it lies (rows 0 to its last new position: a flat column's rows are positions),
        causal from the column's first new position; the columns' outputs in token order. q, k, v: [T, H, D]."""
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers llama::custom_sdpa)
        import torch

        aten = torch.ops.aten
        outs = []
        for c in range(self.columns):
            mine = step[f"col{c}_q"]
            if ("start", c) not in nodes:  # the column's first new position, once per step (custom_sdpa's
                # own checks bound it by the store's rows when the method is exported again)
                start = call(aten.select.int, (step["col_starts"], 0, c))
                nodes["start", c] = call(aten._local_scalar_dense.default, (start,))
            k_store = call(aten.index_copy_.default, (
                get_store(f"k_{layer_id}_c{c}"), 0, step[f"col{c}_rows"], call(aten.index_select.default, (k, 0, mine))))
            v_store = call(aten.index_copy_.default, (
                get_store(f"v_{layer_id}_c{c}"), 0, step[f"col{c}_rows"], call(aten.index_select.default, (v, 0, mine))))
            q_c = call(aten.unsqueeze.default, (call(aten.index_select.default, (q, 0, mine)), 0))  # [1, Tc, Hq, D]
            # the stores as [1, rows + 1, Hkv, D] by view: ExecuTorch makes a static view an alias of the buffer
            # (an unsqueeze would be a copy of the whole column per layer and step)
            batch_of_one = [1, layer.rows + 1, self.n_kv_heads, self.head_dim]
            out = call(torch.ops.llama.custom_sdpa.default, (
                q_c, call(aten.view.default, (k_store, batch_of_one)), call(aten.view.default, (v_store, batch_of_one)),
                nodes["start", c], None, 0.0, self.causal, scale))
            outs.append(call(aten.squeeze.dim, (out, 0)))
        return call(aten.index_select.default, (call(aten.cat.default, (outs,)), 0, step["col_out"]))

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


LAYOUT = SequenceLayout
