"""Speculative rounds of a session over an artifact with a DFlash draft: the draft proposes a block per
sequence from the target's tapped features, the target verifies every block in one step, each model
commits only what it keeps. ``Speculation`` holds the draft's side (its model state, each sequence's
pending target features, the tokens each round gave) and drives the session through its public steps
(``Session.sequence``, ``check_tokens``, ``run_target``, its ``models``)."""

from dataclasses import dataclass, field

import torch

from pipeline.build.roles import DRAFT_STEP, TARGET
from pipeline.errors import SessionError
from pipeline.runtime.sampling import Greedy

_GREEDY = Greedy()


@dataclass
class Round:
    """One sequence's speculative round."""

    tokens: list[int]  # the tokens it gave: the accepted proposals, then the target's next token
    proposals: list[int]  # the block after the fed token, as the target verified it
    logits: torch.Tensor  # the target's logits for every row of the block [1 + len(proposals), vocab]
    draft_logits: torch.Tensor  # the draft's logits for its proposals [len(proposals), vocab]


@dataclass
class Speculation:
    """The draft's side of a session's speculative rounds."""

    draft: object  # the draft's ModelState (its section, layout, pool and sequences)
    pending: dict = field(default_factory=dict)  # sequence id -> target features not yet given to the draft
    acceptance: dict = field(default_factory=dict)  # sequence id -> tokens each round gave it

    @property
    def block_size(self) -> int:
        return self.draft.section["block_size"]

    def add(self, seq_id, pending: torch.Tensor | None = None) -> None:
        """A new sequence; ``pending``: the target features it adopted and the draft has not seen (a prefix
        adopted from a released sequence whose draft context lagged its target)."""
        self.pending[seq_id] = torch.zeros(0, self.draft.section["feature_dim"]) if pending is None else pending
        self.acceptance[seq_id] = []

    def release(self, seq_id) -> torch.Tensor:
        """Forget a sequence; its pending target features (the prefix cache keeps them with its rows)."""
        del self.acceptance[seq_id]
        return self.pending.pop(seq_id)

    def keep_features(self, kept: list[tuple[object, int, int]], features: torch.Tensor | None) -> None:
        """Append to each sequence's pending features the first ``keep`` of its ``n`` rows of the step
        (``kept``: (seq_id, n, keep) in the step's order)."""
        row = 0
        for seq_id, n, keep in kept:
            self.pending[seq_id] = torch.cat([self.pending[seq_id], features[row: row + keep].float()])
            row += n

    def round(self, session, feeds: dict[object, int], propose=None, policies: dict | None = None) -> dict[object, "Round"]:
        """One speculative round for each sequence of ``feeds`` (sequence id -> its next token, the last
        one sampled and not yet fed): the draft proposes ``block_size - 1`` tokens after it, the target
        verifies every sequence's block in one step, and each sequence keeps the proposals the target's
        greedy choice agrees with plus the target's token after them. Returns each sequence's ``Round``:
        those tokens (at least one; the last is again not yet fed), the proposals and both models'
        logits. ``propose(seq_id, proposals) -> proposals`` may replace the draft's, as many of them
        (tests: an oracle or a corrupted draft). ``policies`` (sequence id -> a ``runtime.sampling``
        policy; default ``Greedy``) choose each sequence's proposals from the draft's logits and verify
        them against the target's. Greedy: the tokens are the target's greedy continuation, whatever the
        draft proposes; sampled: the rejection rule keeps the target's distribution."""
        if not isinstance(feeds, dict) or not feeds:
            raise SessionError("a speculative step needs a dict of at least one sequence id -> next token")
        order = []
        for seq_id, token in feeds.items():
            seq = session.sequence(seq_id)
            (token,) = session.check_tokens(seq_id, [token])
            if seq.length == 0:
                raise SessionError(f"sequence {seq_id!r} is empty: prefill its prompt with step() before speculating")
            if seq_id in session.images:
                raise SessionError(f"sequence {seq_id!r} has image features whose placeholder tokens were not fed yet; "
                                   "feed them with step() before speculating")
            limit = session.kv_layout.session_length_limit
            room = self.block_size if limit is None else min(self.block_size, limit - seq.length)
            if room < 1:
                raise SessionError(f"sequence {seq_id!r} holds {seq.length} tokens, the flat layers' capacity of "
                                   f"{session.max_length}; release it or build with a larger kv.capacity")
            order.append((seq_id, seq, token, room))
        policies = {seq_id: (policies or {}).get(seq_id) or _GREEDY for seq_id, *_ in order}
        proposals, draft_logits = self._draft_proposals(session, [(seq_id, token, room) for seq_id, _, token, room in order])
        for seq_id, *_ in order:
            if len(draft_logits[seq_id]) and not isinstance(policies[seq_id], Greedy):
                proposals[seq_id] = policies[seq_id].propose(draft_logits[seq_id])
        if propose is not None:
            for seq_id, *_ in order:
                given = list(propose(seq_id, list(proposals[seq_id])))
                if len(given) != len(proposals[seq_id]):
                    raise SessionError(f"sequence {seq_id!r}: propose returned {len(given)} proposals for a block "
                                       f"of {len(proposals[seq_id])}")
                proposals[seq_id] = given
        blocks = [(seq_id, seq, session.check_tokens(seq_id, [token, *proposals[seq_id]])) for seq_id, seq, token, _ in order]
        n_tokens = sum(len(block) for *_, block in blocks)
        target = session.models[TARGET]
        cells = target.pool.choose(n_tokens)
        logits, features = session.run_target(blocks, list(range(n_tokens)), cells)
        out, kept, kept_cells, row = {}, [], [], 0
        for seq_id, seq, block in blocks:
            rows = logits[row: row + len(block)]
            accepted, token = policies[seq_id].verify(block, rows, draft_logits[seq_id])
            out[seq_id] = Round(block[1: accepted + 1] + [token], block[1:], rows.clone(), draft_logits[seq_id])
            kept.append((seq_id, seq, len(block), accepted + 1))  # the fed token and the accepted proposals
            kept_cells += cells[row: row + accepted + 1] if cells else []
            row += len(block)
        target.commit([(seq, keep) for _, seq, _, keep in kept], kept_cells)
        for (seq_id, _, block), (*_, keep) in zip(blocks, kept, strict=True):
            session.committed(seq_id, block[:keep])
        self.keep_features([(seq_id, n, keep) for seq_id, _, n, keep in kept], features)
        for seq_id, result in out.items():
            self.acceptance[seq_id].append(len(result.tokens))
        return out

    def _draft_proposals(self, session, order: list[tuple[object, int, int]]) -> tuple[dict, dict]:
        """The draft's ``room - 1`` proposals after each sequence's ``token``. Its pending context first
        goes in in context-only steps, until what is left and the blocks fit one step."""
        width, block = self.draft.section["step_width"], self.block_size
        chunks = []  # (seq_id, rows) context-only
        for seq_id, _, _ in order:
            extra = len(self.pending[seq_id]) - block
            for start in range(0, max(extra, 0), width):
                chunks.append((seq_id, min(width, extra - start)))
        while chunks:  # a sequence's chunks but its last fill a step each: no step has two of one sequence
            step, room = [], width
            while chunks and chunks[0][1] <= room:
                step.append(chunks.pop(0))
                room -= step[-1][1]
            self._draft_step(session, [(seq_id, n, []) for seq_id, n in step])
        proposing = [(seq_id, len(self.pending[seq_id]), [token] + [self.draft.section["mask_token_id"]] * (room - 1))
                     for seq_id, token, room in order if room > 1]
        proposals = {seq_id: [] for seq_id, *_ in order}
        logits_of = {seq_id: torch.zeros(0, session.vocab_size) for seq_id, *_ in order}
        if proposing:
            logits = self._draft_step(session, proposing)
            row = 0
            for seq_id, _, blk in proposing:
                logits_of[seq_id] = logits[row: row + len(blk) - 1].clone()
                proposals[seq_id] = logits_of[seq_id].argmax(-1).tolist()
                row += len(blk) - 1
        return proposals, logits_of

    def _draft_step(self, session, rows: list[tuple[object, int, list[int]]]) -> torch.Tensor:
        """One call of the draft: for each (seq_id, n_ctx, block) the first ``n_ctx`` pending features
        as context rows, then the block's tokens; keeps the context, returns the logits of every block
        row after its first (the proposals)."""
        draft = self.draft
        order = [(seq_id, draft.seqs[seq_id], n_ctx, blk) for seq_id, n_ctx, blk in rows]
        n_tokens = sum(n_ctx + len(blk) for _, _, n_ctx, blk in order)
        cells = draft.pool.choose(n_tokens)
        step_buffers = draft.step_buffers([(seq, n_ctx + len(blk)) for _, seq, n_ctx, blk in order], cells)
        feature_dim, dtype = draft.section["feature_dim"], self.pending[order[0][0]].dtype
        features, tokens, is_context, positions, logit_rows = [], [], [], [], []
        for seq_id, seq, n_ctx, blk in order:
            features += [self.pending[seq_id][:n_ctx], torch.zeros(len(blk), feature_dim, dtype=dtype)]
            tokens += [draft.section["mask_token_id"]] * n_ctx + blk
            is_context += [1] * n_ctx + [0] * len(blk)
            base = len(positions)
            positions += range(seq.length, seq.length + n_ctx + len(blk))
            logit_rows += range(base + n_ctx + 1, base + n_ctx + len(blk))
        args = [torch.cat(features)[None].to(getattr(torch, draft.section["feature_dtype"])), torch.tensor(tokens, dtype=torch.int64),
                torch.tensor(is_context, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                torch.tensor(logit_rows or [0], dtype=torch.int64), *step_buffers]
        try:
            draft.writing([(seq, n_ctx + len(blk)) for _, seq, n_ctx, blk in order], cells)
            logits = session.method(DRAFT_STEP).execute(args)[0]
        except Exception as err:
            raise SessionError(f"the program failed on the draft step of sequences "
                               f"{', '.join(repr(s) for s, *_ in order)} ({err})") from err
        kept_cells, row = [], 0
        for _, _, n_ctx, blk in order:
            kept_cells += cells[row: row + n_ctx] if cells else []
            row += n_ctx + len(blk)
        draft.commit([(seq, n_ctx) for _, seq, n_ctx, _ in order], kept_cells)
        for seq_id, _, n_ctx, _ in order:
            self.pending[seq_id] = self.pending[seq_id][n_ctx:]
        return logits if logit_rows else logits[:0]
