"""What a session keeps of one model of the artifact that keeps KV (the target, a draft), read from
its manifest section: every such model alike (``Session.models``)."""

from dataclasses import dataclass, field

import torch

from pipeline.kv.layouts import KVLayout, Pool, SeqState, layout_from_manifest


@dataclass
class ModelState:
    """One model of the artifact that keeps KV (the target, a draft), as its manifest section says: the
    layout's index math, its per-session state (the cell pool) and its live sequences."""

    section: dict
    layout: KVLayout
    pool: Pool
    seqs: dict = field(default_factory=dict)  # sequence id -> SeqState

    @classmethod
    def of(cls, section: dict) -> "ModelState":
        layout = layout_from_manifest(section)
        return cls(section, layout, layout.pool())

    def step_buffers(self, order: list[tuple[SeqState, int]], cells: list[int]) -> list[torch.Tensor]:
        """The step buffers for the step about to run, computed from the state it will leave."""
        values = self.layout.step_buffer_values(order, cells, self.pool)
        return [values[b["name"]] for b in self.section["step_buffers"]]

    def writing(self, order: list[tuple[SeqState, int]], cells: list[int]) -> None:
        """The program is about to write the step's rows (kept or not, run or failed): each sequence's
        ``written`` mark moves past them, and the pool gives up any released rows among ``cells``."""
        for seq, n in order:
            seq.written = max(seq.written, seq.length + n)
        self.pool.writing(cells)

    def commit(self, order: list[tuple[SeqState, int]], cells: list[int]) -> None:
        """The step ran: its sequences are longer, and its cells (cell layout) theirs."""
        self.pool.commit(order, cells)
        for seq, n in order:
            seq.length += n
