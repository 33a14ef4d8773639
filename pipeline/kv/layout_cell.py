"""The cell layout: one pool of ``capacity`` cells per layer, shared by every sequence.

The session chooses the cells a step writes (``cell_ids``) and keeps, per cell, its position and
its owners (an int64 bitset, one bit per sequence slot: at most 63 sequences). A query attends to
the cells whose owners include its sequence's bit (``q_seq_bits``), by position, causal and window.

The pool hands out its lowest free cells, so the cells in use stay a prefix: ``cell_pos`` and
``cell_owners`` cover the cells up to the last one owned (after the step's writes), and the GPU's
attention (inlined ATen, compiled by Inductor) reads that prefix of the stores. On CPU backends the
session lists each sequence's own cells in position order instead (``gather_values``): a query reads
its sequence's cells only, so a decode of S sequences reads the cells they hold once, not S times.
"""

import bisect
import itertools
from dataclasses import dataclass

from pipeline.errors import SessionError
from pipeline.kv.gather import gather_buffers, gather_call, gather_values
from pipeline.kv.layouts import CELL_OWNER_BITS, KVConfigError, KVLayout, LayerStore, Pool, SeqState, StepBuffer


@dataclass(frozen=True)
class CellLayout(KVLayout):
    manifest_names = ("cell",)

    @classmethod
    def build(cls, spec, model_args) -> "CellLayout":
        max_seqs, capacity, step = spec.max_seqs, spec.capacity, spec.max_step_tokens
        if max_seqs > CELL_OWNER_BITS:
            raise KVConfigError(
                f"kv.max_seqs={max_seqs} exceeds the cell layout's limit of {CELL_OWNER_BITS} "
                "(owners are an int64 bitset); use kv=sequence for more sequences")
        if max_seqs * step > capacity:
            raise KVConfigError(
                f"kv.max_seqs={max_seqs} is more than the cell pool allows: {max_seqs} sequences of one "
                f"{step}-token step need {max_seqs * step} cells, kv.capacity={capacity}; "
                f"raise kv.capacity or lower kv.max_seqs to at most {capacity // step}")
        layers = tuple(LayerStore("ring" if layer.window else "flat", capacity, layer.window) for layer in model_args.layer_kv())
        return cls(layout="cell", max_seqs=max_seqs, capacity=capacity, max_step_tokens=step, causal=spec.causal,
                   n_kv_heads=model_args.n_kv_heads, head_dim=model_args.head_dim, dtype=spec.dtype,
                   layers=layers, max_seq_len=capacity)

    @property
    def session_length_limit(self) -> int | None:
        return None  # the pool bounds the sequences together (``CellPool.choose``)

    def step_buffers(self) -> list[StepBuffer]:
        if not self.planned:
            return [StepBuffer("cell_ids", ("n_tokens",)), *gather_buffers(self)]
        return [
            StepBuffer("cell_ids", ("n_tokens",)),
            StepBuffer("q_seq_bits", ("n_tokens",)),
            StepBuffer("cell_pos", ("cells",)),
            StepBuffer("cell_owners", ("cells",)),
        ]

    def key_kinds(self) -> list[str]:
        return ["cells"]  # every layer reads the one pool (a ring layer by its window)

    def key_rows(self, kind: str) -> int:
        return self.capacity

    def dim_bound(self, dim: str) -> int:
        return self.capacity if dim == "cells" else super().dim_bound(dim)

    def attention_scratch_bytes(self) -> int:
        # the gathered attention's keys at their bounds: a sequence's cells per token attending alone,
        # and once for the block
        cells = 2 * self.capacity * self.n_kv_heads * self.head_dim * self.gathered_item_bytes
        return 0 if self.planned else (max(self.max_step_tokens, self.max_seqs) + 1) * cells

    def constants(self) -> dict[str, int]:
        # a cell artifact declares its pool, and no sequence count (that marks the sequence paths)
        return {"get_kv_cell_count": self.capacity, "get_kv_cell_max_seqs": self.max_seqs}

    def check_episode(self, totals: list[int], validate_setting: str) -> None:
        # a bound, not a simulation: the sequences live together could all be at their longest
        peak = sum(totals[: self.max_seqs])
        if peak > self.capacity:
            raise KVConfigError(
                f"kv.capacity={self.capacity} cells may be too few for the validation episode: "
                f"{self.max_seqs} live sequences can hold up to {peak} tokens; raise kv.capacity to at least "
                f"{peak} or shorten {validate_setting}")

    def write_slots(self, call, pos, layer: LayerStore, step: dict):
        return step["cell_ids"]

    def attend(self, call, q, k_store, v_store, pos, layer: LayerStore, step: dict, scale: float, kernel,
               plans: dict, q_meta, v_meta, scales: tuple | None = None):
        import torch

        if not kernel.planned:  # the cells the session listed: each query's own sequence's
            return gather_call(self, call, kernel, q, k_store, v_store, pos, step, "cells", scale, layer.window, scales)
        # the cells up to the last one owned: the stores' prefix as long as cell_pos
        n_cells = call(torch.ops.aten.sym_size.int, (step["cell_pos"], 0))
        k_store = call(torch.ops.aten.slice.Tensor, (k_store, 0, 0, n_cells))
        v_store = call(torch.ops.aten.slice.Tensor, (v_store, 0, 0, n_cells))
        return call(torch.ops.kvcache.sdpa_cells.default, (
            q, k_store, v_store, pos, step["q_seq_bits"], step["cell_pos"], step["cell_owners"],
            scale, self.causal, layer.window))

    def pool(self) -> "CellPool":
        return CellPool(self.capacity)

    rows_in_column = False  # a slot is an owner bit; a sequence's rows are its cells

    def holds_prefix(self, length: int, seq: SeqState) -> bool:
        # every position has a cell of its own (a ring layer masks by its window, it overwrites nothing):
        # the cells of the first ``length`` positions hold them while the pool holds the cells
        return length <= seq.length

    def step_buffer_values(self, order: list[tuple[SeqState, int]], chosen: list[int], pool: "CellPool") -> dict:
        import torch

        if not self.planned:
            return {"cell_ids": torch.tensor(chosen, dtype=torch.int64)} | gather_values(order, _cells_after(order, chosen, pool))
        cell_pos, cell_owners = pool.cell_pos.clone(), pool.cell_owners.clone()  # as the step will leave them
        bits = []
        taken = iter(chosen)
        for seq, n in order:
            for i in range(n):
                cell = next(taken)
                cell_pos[cell], cell_owners[cell] = seq.length + i, 1 << seq.slot
                bits.append(1 << seq.slot)
        owned = cell_owners.nonzero()
        n_cells = int(owned[-1]) + 1 if len(owned) else 1  # a step writes at least one cell
        return {"cell_ids": torch.tensor(chosen, dtype=torch.int64), "q_seq_bits": torch.tensor(bits, dtype=torch.int64),
                "cell_pos": cell_pos[:n_cells], "cell_owners": cell_owners[:n_cells]}


def _cells_after(order: list[tuple[SeqState, int]], chosen: list[int], pool: "CellPool"):
    """keys_of for ``gather_values``: a sequence's cells once the step wrote its tokens into the cells
    chosen for them (in ``order``'s turn), in position order, and their positions."""
    import torch

    new, taken = {}, iter(chosen)
    for seq, n in order:
        new[seq.slot] = [next(taken) for _ in range(n)]

    def keys_of(seq: SeqState, n: int) -> dict:
        held = torch.tensor(seq.cells, dtype=torch.int64)
        cells = torch.cat([held, torch.tensor(new[seq.slot], dtype=torch.int64)])
        positions = torch.cat([pool.cell_pos[held], torch.arange(seq.length, seq.length + n, dtype=torch.int64)])
        order_by_pos = positions.argsort()
        return {"cells": (cells[order_by_pos], positions[order_by_pos])}

    return keys_of


class CellPool(Pool):
    """Each cell's position and owners, the free cells, and the cells of released sequences kept for the
    prefix cache (``retained``: groups oldest first, each a released sequence's cells, owned by nobody).

    A step's cells come from the free cells, lowest first, and only when those are too few from the
    retained groups, least recently released first; a group one of whose cells is written (the step ran
    or failed) is given up whole: its other cells are free again. ``generation`` counts each cell's
    writes, so a receipt (the group and its cells' counts) no longer holds once any of them was written."""

    def __init__(self, n_cells: int):
        import torch

        self.n_cells = n_cells
        self.cell_pos = torch.zeros(n_cells, dtype=torch.int64)
        self.cell_owners = torch.zeros(n_cells, dtype=torch.int64)
        self.free_cells = list(range(n_cells))
        self.retained: dict[int, list[int]] = {}  # group -> its cells, in release order (oldest first)
        self.group_of: dict[int, int] = {}  # a retained cell -> its group
        self.generation = [0] * n_cells
        self._groups = itertools.count()

    def choose(self, n_tokens: int) -> list[int]:
        if n_tokens <= len(self.free_cells):
            return self.free_cells[:n_tokens]
        kept = [cell for cells in self.retained.values() for cell in cells]
        if n_tokens > len(self.free_cells) + len(kept):
            raise SessionError(f"the cell pool is full: the step needs {n_tokens} cells, {len(self.free_cells)} of "
                               f"{self.n_cells} are free and {len(kept)} hold released sequences' prefixes")
        return self.free_cells + kept[: n_tokens - len(self.free_cells)]

    def writing(self, chosen: list[int]) -> None:
        for group in {self.group_of[cell] for cell in chosen if cell in self.group_of}:
            self._free(self._give_up(group))
        for cell in chosen:
            self.generation[cell] += 1

    def commit(self, order: list[tuple[SeqState, int]], chosen: list[int]) -> None:
        """``order``'s sequences take ``chosen`` in turn, n cells each (those a step wrote and keeps:
        a speculative step keeps a prefix of each sequence's cells, and the rest stay free)."""
        taken = iter(chosen)
        for seq, n in order:
            for i, cell in zip(range(n), taken, strict=False):  # the next n cells
                self.cell_pos[cell] = seq.length + i
                self.cell_owners[cell] = 1 << seq.slot
                seq.cells.append(cell)
        kept = set(chosen)
        self.free_cells = [cell for cell in self.free_cells if cell not in kept]

    def release(self, seq: SeqState) -> None:
        self._free(self._disown(seq))

    def retain(self, seq: SeqState) -> tuple[int, tuple[int, ...]]:
        group = next(self._groups)
        self.retained[group] = self._disown(seq)
        self.group_of.update(dict.fromkeys(self.retained[group], group))
        return group, tuple(self.generation[cell] for cell in seq.cells)

    def holds(self, seq: SeqState, receipt) -> bool:
        if receipt is None:
            return False
        group, generations = receipt
        return (self.retained.get(group) == list(seq.cells)
                and all(self.generation[cell] == g for cell, g in zip(seq.cells, generations, strict=True)))

    def adopt(self, old: SeqState, receipt, new: SeqState, length: int) -> None:
        """``new`` owns the cells of ``old``'s first ``length`` positions; the others are free."""
        cells = self._give_up(receipt[0])
        new.cells = [cell for cell in cells if int(self.cell_pos[cell]) < length]
        for cell in new.cells:
            self.cell_owners[cell] = 1 << new.slot
        self._free([cell for cell in cells if int(self.cell_pos[cell]) >= length])

    def evict(self, seq: SeqState, receipt) -> None:
        if receipt is not None and receipt[0] in self.retained:
            self._free(self._give_up(receipt[0]))

    def _give_up(self, group: int) -> list[int]:
        """A retained group's cells, no longer kept for it (owned by nobody, not yet free)."""
        cells = self.retained.pop(group)
        for cell in cells:
            del self.group_of[cell]
        return cells

    def _disown(self, seq: SeqState) -> list[int]:
        """Clear ``seq``'s owner bit from its cells; those nobody owns now."""
        bit, alone = 1 << seq.slot, []
        for cell in seq.cells:
            self.cell_owners[cell] &= ~bit
            if self.cell_owners[cell] == 0:
                alone.append(cell)
        return alone

    def _free(self, cells: list[int]) -> None:
        for cell in cells:
            bisect.insort(self.free_cells, cell)  # lowest first: the cells in use stay low

    def snapshot(self) -> tuple:
        return list(self.free_cells), self.cell_pos.clone(), self.cell_owners.clone(), dict(self.retained), dict(self.group_of)


LAYOUT = CellLayout
