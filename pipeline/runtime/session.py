"""A serving session over a built artifact directory, through the ExecuTorch runtime.

The artifact decides the layout (manifest.json, cross-checked with the
program's constant methods); the session assigns a column (sequence layouts)
or cells (cell layout) to each sequence, fills the step buffers, runs mixed
prefill/decode steps and returns logits for the last token of every sequence
fed in the step: the rows a sampler reads, never one per token.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.kv.layouts import sequence_segments


class SessionError(RuntimeError):
    pass


@dataclass
class _Sequence:
    slot: int  # column (sequence layouts) or owner bit (cell layout)
    length: int = 0
    cells: list[int] = field(default_factory=list)


class Session:
    """``methods`` replaces the ExecuTorch runtime with other runners of the same methods
    (name -> callable(list of inputs) -> list of outputs), e.g. AOTInductor on a GPU."""

    def __init__(self, artifact_dir: str | Path, methods: dict | None = None):
        artifact_dir = Path(artifact_dir)
        self.manifest = json.loads((artifact_dir / "manifest.json").read_text())
        self.kv = self.manifest["target"]
        self._methods = {}
        if methods is None:
            from executorch.runtime import Runtime

            self.program = Runtime.get().load_program(str(artifact_dir / self.manifest["program"]))
            self.runtime = "executorch.runtime"
            self._check_constants()
        else:
            self.program = None
            self.runtime = "external runners"
            self._methods = {name: _Runner(fn) for name, fn in methods.items()}
        self.layout = self.kv["layout"]
        self.max_seqs = self.kv["max_seqs"]
        self.max_step_tokens = self.kv["max_step_tokens"]
        self.rows = {layer["kind"]: layer["rows"] for layer in self.kv["layers"]}
        self.seqs: dict[object, _Sequence] = {}
        n_cells = self.kv["capacity"]
        self.cell_pos = torch.zeros(n_cells, dtype=torch.int64)
        self.cell_owners = torch.zeros(n_cells, dtype=torch.int64)
        self.free_cells = list(range(n_cells))

    def method(self, name: str):
        if name not in self._methods:
            self._methods[name] = self.program.load_method(name)
        return self._methods[name]

    def _check_constants(self) -> None:
        expect = {"get_offgraph_kv_max_segments": self.kv["max_segments"], "get_max_step_tokens": self.kv["max_step_tokens"]}
        if self.kv["layout"] == "cell":
            expect |= {"get_kv_cell_max_seqs": self.kv["max_seqs"], "get_kv_cell_count": self.kv["capacity"]}
        else:
            expect |= {"get_offgraph_kv_max_seqs": self.kv["max_seqs"]}
        for name, value in expect.items():
            got = self.constant(name)
            if got != value:
                raise SessionError(f"artifact disagrees with its manifest: {name}() = {got}, manifest says {value}")

    def constant(self, name: str):
        if name not in self.program.method_names:
            raise SessionError(f"the program has no constant method {name}")
        return self.method(name).execute([])[0]

    # --- sequences ---

    def add(self, seq_id) -> None:
        if seq_id in self.seqs:
            raise SessionError(f"sequence {seq_id!r} is already live")
        if len(self.seqs) >= self.max_seqs:
            raise SessionError(
                f"cannot add sequence {seq_id!r}: {self.max_seqs} sequences are live, the artifact's max_seqs; "
                "release one first or build with a larger kv.max_seqs")
        taken = {s.slot for s in self.seqs.values()}
        self.seqs[seq_id] = _Sequence(slot=min(set(range(self.max_seqs)) - taken))

    def release(self, seq_id) -> None:
        seq = self._get(seq_id)
        bit = 1 << seq.slot
        for cell in seq.cells:
            self.cell_owners[cell] &= ~bit
            if self.cell_owners[cell] == 0:
                self.free_cells.append(cell)
        del self.seqs[seq_id]

    def _get(self, seq_id) -> _Sequence:
        if seq_id not in self.seqs:
            raise SessionError(f"unknown sequence {seq_id!r}; live: {sorted(map(str, self.seqs))}")
        return self.seqs[seq_id]

    # --- steps ---

    def step(self, feeds: dict[object, list[int]]) -> dict[object, torch.Tensor]:
        """Append ``feeds[seq]`` tokens to each sequence; return each one's next-token logits."""
        if not feeds:
            raise SessionError("a step needs at least one sequence with tokens")
        n_tokens = sum(len(t) for t in feeds.values())
        if n_tokens > self.max_step_tokens:
            raise SessionError(f"a step of {n_tokens} tokens exceeds the artifact's max_step_tokens={self.max_step_tokens}")
        tokens, positions, order = [], [], []
        for seq_id, toks in feeds.items():
            seq = self._get(seq_id)
            if not toks:
                raise SessionError(f"sequence {seq_id!r} is fed no tokens")
            end = seq.length + len(toks)
            if self.layout != "cell" and "flat" in self.rows and end > self.rows["flat"]:
                raise SessionError(f"sequence {seq_id!r} would reach {end} tokens, past the flat layers' capacity of {self.rows['flat']}")
            tokens += toks
            positions += range(seq.length, end)
            order.append((seq_id, seq, len(toks)))
        step_buffers = self._step_buffers(order, n_tokens)
        for _, seq, n in order:
            seq.length += n
        token_t = torch.tensor(tokens, dtype=torch.int64)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        embeddings = self.method("embed_text").execute([token_t])[0]
        if all(n == 1 for *_, n in order):
            logits = self.method("decode_from_embedding").execute([embeddings, pos_t, *step_buffers])[0]
        else:
            last_rows = torch.tensor(list(_cumulative_last([n for *_, n in order])), dtype=torch.int64)
            logits = self.method("forward_from_embeddings").execute([embeddings, pos_t, last_rows, *step_buffers])[0]
        return {seq_id: logits[i] for i, (seq_id, *_) in enumerate(order)}

    def _step_buffers(self, order, n_tokens: int) -> list[torch.Tensor]:
        if self.layout == "cell":
            return self._cell_buffers(order)
        seq_cols = torch.tensor([seq.slot for _, seq, n in order for _ in range(n)], dtype=torch.int64)
        buffers = {"seq_cols": seq_cols}
        for kind, rows in self.rows.items():
            segments = [run for _, seq, n in order for run in sequence_segments(seq.length + n, rows, seq.slot)]
            info = torch.zeros(self.kv["max_segments"], 4, dtype=torch.int64)
            if segments:
                info[: len(segments)] = torch.tensor(segments, dtype=torch.int64)
            buffers[f"seq_info_{kind}"] = info
        return [buffers[b["name"]] for b in self.kv["step_buffers"]]

    def _cell_buffers(self, order) -> list[torch.Tensor]:
        needed = sum(n for *_, n in order)
        if needed > len(self.free_cells):
            raise SessionError(f"the cell pool is full: the step needs {needed} cells, {len(self.free_cells)} of {self.kv['capacity']} are free")
        cell_ids, bits = [], []
        for _, seq, n in order:
            for i in range(n):
                cell = self.free_cells.pop(0)
                self.cell_pos[cell] = seq.length + i
                self.cell_owners[cell] = 1 << seq.slot
                seq.cells.append(cell)
                cell_ids.append(cell)
                bits.append(1 << seq.slot)
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        buffers = {"cell_ids": as_t(cell_ids), "q_seq_bits": as_t(bits),
                   "cell_pos": self.cell_pos.clone(), "cell_owners": self.cell_owners.clone()}
        return [buffers[b["name"]] for b in self.kv["step_buffers"]]


@dataclass
class _Runner:
    execute: object  # callable(list) -> list, like an ExecuTorch method


def _cumulative_last(counts: list[int]):
    total = 0
    for n in counts:
        total += n
        yield total - 1
