"""The sequence layouts: one column of rows per sequence (``sequence`` when max_seqs is 1,
``batched-sequence`` with one column per sequence otherwise).

Token i of a step writes row ``(position % rows) * columns + seq_cols[i]`` of its layer's store;
flat layers have ``rows = capacity``, ring (sliding-window) layers ``rows = window +
max_step_tokens - 1`` (fewer, ``capacity``, when flat layers bound every sequence to ``capacity``
tokens). The attention reads each query's column through ``seq_info`` runs (``sequence_segments``).

Rows fill from 0 (a flat layer never wraps; a ring wraps once it is full), so the rows a step's
sequences hold are a prefix of each column: ``read_rows_<kind>`` (one per layer kind) has one entry
per row up to the last row any of them holds, and on CPU backends the attention reads the store's
first ``len(read_rows) * columns`` slots only. A decode then costs what its sequences hold, not the
capacity.
"""

from dataclasses import dataclass

from pipeline.kv.layouts import DTYPE_BYTES, AttentionKernel, KVLayout, LayerStore, Pool, SeqState, StepBuffer, sequence_segments


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
        buffers += [StepBuffer(f"seq_info_{kind}", (self.max_segments, 4)) for kind in self.kinds]
        return buffers + [StepBuffer(f"read_rows_{kind}", (f"rows_{kind}",)) for kind in self.kinds]

    def constants(self) -> dict[str, int]:
        constants = {"get_offgraph_kv_max_seqs": self.max_seqs, "get_offgraph_kv_seq_capacity": self.capacity}
        if "ring" in self.kinds:
            constants["get_offgraph_kv_ring_rows"] = self.rows_of("ring")
        return constants

    def attention_scratch_bytes(self) -> int:
        # the ATen attention gathers each query token's column of the widest store, for the widest
        # step: a prefill chunk or a decode of every sequence
        column = max(2 * layer.rows * self.n_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype] for layer in self.layers)
        return max(self.max_step_tokens, self.max_seqs) * column

    def write_slots(self, call, pos, layer: LayerStore, step: dict):
        import torch

        aten = torch.ops.aten
        slots = call(aten.mul.Scalar, (call(aten.remainder.Scalar, (pos, layer.rows)), self.columns))
        return call(aten.add.Tensor, (slots, step["seq_cols"])) if "seq_cols" in step else slots

    def attend(self, call, q, k_store, v_store, pos, layer: LayerStore, step: dict, scale: float, kernel: AttentionKernel,
               plans: dict, q_meta, v_meta):
        import torch

        aten = torch.ops.aten
        cols = step["seq_cols"] if "seq_cols" in step else call(aten.zeros_like.default, (pos,))
        seq_info = step[f"seq_info_{layer.kind}"]
        if not kernel.planned:
            # the ATen attention reads (and gathers per query) the rows the step's sequences hold:
            # the first len(read_rows) rows of each query's column
            # (gathered from the whole stores: a slice of them would copy every column's rows)
            n_read = call(aten.sym_size.int, (step[f"read_rows_{layer.kind}"], 0))
            return call(kernel.rows, (
                q, k_store, v_store, pos, cols, seq_info, self.columns, n_read, scale, self.causal, layer.window))
        if layer.kind not in plans:  # every layer of a kind has the same bounds and shapes: one plan
            plans[layer.kind] = call(kernel.plan, (
                pos, cols, seq_info, self.columns, self.causal, layer.window, q_meta.shape[1],
                self.n_kv_heads, self.head_dim, v_meta.shape[-1], q_meta.element_size()))
        return call(kernel.attend, (
            q, k_store, v_store, pos, plans[layer.kind], self.columns, scale, self.causal, layer.window))

    def step_buffer_values(self, order: list[tuple[SeqState, int]], chosen: list[int], pool: Pool) -> dict:
        import torch

        buffers = {"seq_cols": torch.tensor([seq.slot for seq, n in order for _ in range(n)], dtype=torch.int64)}
        for kind in self.kinds:
            rows = self.rows_of(kind)
            segments = [run for seq, n in order for run in sequence_segments(seq.length + n, rows, seq.slot)]
            info = torch.zeros(self.max_segments, 4, dtype=torch.int64)
            if segments:
                info[: len(segments)] = torch.tensor(segments, dtype=torch.int64)
            buffers[f"seq_info_{kind}"] = info
            # every row up to the last one a sequence of the step holds (at least one: the method's
            # token axis is never empty)
            buffers[f"read_rows_{kind}"] = torch.arange(max([first + count for _, first, count, _ in segments] or [1]))
        return buffers


LAYOUT = SequenceLayout
