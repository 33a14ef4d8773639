"""Prefix reuse across sequences through real programs: the tiny model (ring layers of window 16 and
flat layers, 16-token steps: 31 ring rows) in the sequence (one column), batched-sequence and cell layouts, driven by the
server's schedule. Greedy output with a released sequence's rows adopted equals the output of a session
without the prefix cache, token for token (and every chosen token's logits within 1e-4): multi-turn
chats, a batch sharing a long prefix, a prompt diverging one token before the cached end, a prompt
shorter than the cached prefix. The ring rule's edge, and a planted reuse of rows since overwritten."""

import pytest
import torch

from conftest import BATCHED, CELL
from pipeline.kv.layout_sequence import ColumnPool
from pipeline.runtime import schedule
from pipeline.runtime.schedule import Budget, Slot
from pipeline.runtime.session import Session

LAYOUTS = {"sequence": (), "batched-sequence": BATCHED, "cell": CELL}  # test_session.py's builds
TOLERANCE = 1e-4  # of the logits' range: the same arithmetic in other chunks


@pytest.fixture(scope="module", params=list(LAYOUTS))
def artifact(request, build_dir):
    return build_dir(*LAYOUTS[request.param])


def serve(s: Session, prompts: dict, new: int, reuse: bool = True) -> tuple[dict, dict, dict]:
    """The prompts at once through the server's schedule, greedy, ``new`` tokens each; then released.
    Returns each one's tokens, the logits that chose them, and the prompt tokens its sequence reused."""
    slots = [Slot(seq_id, list(prompt)) for seq_id, prompt in prompts.items()]
    by_id = {slot.id: slot for slot in slots}
    budget = Budget(s.max_step_tokens, s.max_seqs, prefix_cache=reuse)
    out, rows, reused = ({seq_id: [] for seq_id in prompts} for _ in range(3))
    while slots:
        plan = schedule.plan(slots, budget)
        for slot in plan.released:
            s.release(slot.id)
            slots.remove(slot)
        for slot in plan.admitted:
            reused[slot.id] = s.add(slot.id, plan.prefixes.get(slot.id, ()))
            plan.admit(slot, reused[slot.id])
        if plan.feeds:
            logits = s.step(plan.feeds)
            for seq_id, toks in plan.feeds.items():
                if by_id[seq_id].took(len(toks)):
                    rows[seq_id].append(logits[seq_id])
                    out[seq_id].append(int(logits[seq_id].argmax()))
                    by_id[seq_id].next_token = out[seq_id][-1]
                    if len(out[seq_id]) == new:
                        by_id[seq_id].finish()
    return out, rows, reused


def same(s: Session, fresh: Session, prompts: dict, new: int) -> tuple[dict, dict]:
    """``prompts`` through ``s`` (the prefix cache on) and ``fresh`` (off): the same tokens, logits
    within TOLERANCE; (tokens, reused)."""
    got, got_rows, reused = serve(s, prompts, new)
    want, want_rows, none = serve(fresh, prompts, new, reuse=False)
    assert set(none.values()) == {0}
    for seq_id in prompts:
        assert got[seq_id] == want[seq_id], f"{seq_id}: reused {reused[seq_id]} tokens and the output differs"
        a, b = torch.stack(got_rows[seq_id]), torch.stack(want_rows[seq_id])
        err = float((a - b).abs().max() / (b.max() - b.min()))
        assert err < TOLERANCE, f"{seq_id}: relative logit error {err:.1e} with {reused[seq_id]} tokens reused"
    return got, reused


def words(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=gen).tolist()


def test_a_multi_turn_chat_prefills_only_each_new_turn(artifact):
    """Each turn's prompt is the last turn's prompt, its reply and a new message: the sequence adopts all
    the last one held (its prompt and its reply less the reply's last token, which was never fed)."""
    s, fresh = Session(artifact), Session(artifact, prefix_cache=False)
    gen = torch.Generator().manual_seed(0)
    history, held = words(gen, 20), 0
    for turn in range(4):
        out, reused = same(s, fresh, {turn: history}, 8)
        assert reused[turn] == held, f"turn {turn}"
        held = len(history) + 8 - 1
        history = history + out[turn] + words(gen, 10)


def test_a_batch_sharing_a_long_prefix(artifact):
    """One request, then three at once with its 50-token prefix (one adopts the released rows, whose entry
    is then used up; the others prefill beside it), then a fifth: it adopts one of the three."""
    s, fresh = Session(artifact), Session(artifact, prefix_cache=False)
    system = words(torch.Generator().manual_seed(1), 50)
    _, reused = same(s, fresh, {"first": system + [1, 2, 3, 4, 5]}, 6)
    assert reused == {"first": 0}
    _, reused = same(s, fresh, {f"b{i}": system + [10 + i, 20 + i, 30 + i] for i in range(3)}, 6)
    # one column: the three run in turn, each adopting the last one's
    assert sorted(reused.values()) == ([0, 0, 50] if s.max_seqs > 1 else [50, 50, 50])
    _, reused = same(s, fresh, {"last": system + [40, 41]}, 6)
    assert reused == {"last": 50}


def test_a_prompt_diverging_one_token_before_the_cached_end_and_one_shorter_than_it(artifact):
    """A shorter prompt adopts all of its tokens but the last where the rows still hold them: always in the
    cell layout; in a column, only while its ring has not wrapped past them (``prefix_rows_held``)."""
    s, fresh = Session(artifact), Session(artifact, prefix_cache=False)
    prompt = words(torch.Generator().manual_seed(2), 30)
    out, _ = same(s, fresh, {"a": prompt}, 6)
    held = prompt + out["a"][:-1]  # 35 tokens
    diverging = held[:-1] + [(held[-1] + 1) % 512, 7, 8]
    out, reused = same(s, fresh, {"b": diverging}, 6)
    assert reused == {"b": len(held) - 1}
    held = diverging + out["b"][:-1]  # 42 tokens: the ring (31 rows) has wrapped, positions 0..10 are gone
    _, reused = same(s, fresh, {"c": held[:12]}, 6)
    assert reused == {"c": 11 if s.layout == "cell" else 0}
    short = prompt[:20]
    out, _ = same(s, fresh, {"e": short}, 3)  # 22 tokens: the ring has not wrapped
    _, reused = same(s, fresh, {"f": (short + out["e"])[:12]}, 6)
    assert reused == {"f": 11}, "all but the prompt's last token, whose logits choose the first token"


def test_the_ring_rule_at_its_edge(artifact):
    """60 tokens written: a ring column holds positions 29..59, so a resumed query at 44 (reading 29..43)
    may adopt the column and one at 43 (reading 28, overwritten by 59) may not; the cell layout keeps
    every position and adopts both."""
    s, fresh = Session(artifact), Session(artifact, prefix_cache=False)
    held = words(torch.Generator().manual_seed(3), 60)
    same(s, fresh, {"a": held}, 1)  # its one token never fed: the rows hold the 60 prompt tokens
    cell = s.layout == "cell"
    _, reused = same(s, fresh, {"b": held[:43] + [500]}, 4)
    assert reused == {"b": 43 if cell else 0}
    s, fresh = Session(artifact), Session(artifact, prefix_cache=False)
    same(s, fresh, {"a": held}, 1)
    _, reused = same(s, fresh, {"b": held[:44] + [500]}, 4)
    assert reused == {"b": 44}


def test_without_the_ring_rule_a_wrapped_column_gives_other_logits(build_dir, monkeypatch):
    """The rule is what keeps the output right: bypassed, the column is adopted at 43 and the first
    query reads position 59's row as position 28's."""
    artifact = build_dir(*BATCHED)
    s, fresh = Session(artifact), Session(artifact, prefix_cache=False)
    held = words(torch.Generator().manual_seed(3), 60)
    same(s, fresh, {"a": held}, 1)
    monkeypatch.setattr(type(s.kv_layout), "holds_prefix", lambda self, length, seq: length <= seq.length)
    with pytest.raises(AssertionError, match="reused 43 tokens|relative logit error"):
        same(s, fresh, {"b": held[:43] + [500]}, 4)


def _planted(artifact, fill: int) -> tuple[Session, Session, list[int]]:
    """Sequence a's rows released, then taken by b (a fresh sequence that writes ``fill`` tokens), every
    sequence released, and a's entry planted back into the cache as if the take had gone unnoticed."""
    s, fresh = Session(artifact), Session(artifact, prefix_cache=False)
    gen = torch.Generator().manual_seed(4)
    prompt = words(gen, 20)
    same(s, fresh, {"a": prompt}, 1)
    (stale,) = s.prefix_cache.entries
    if s.kv_layout.rows_in_column:  # the other columns busy: b takes a's, the least recently released
        for i in range(s.max_seqs - 1):
            s.add(f"busy{i}")
    s.add("b")
    if s.kv_layout.rows_in_column:
        assert s.seqs["b"].slot == stale.states["target"].slot
        assert s.prefix_cache.entries == [], "a's entry is given up once its column is taken"
    for i in range(0, fill, s.max_step_tokens):
        s.step({"b": words(gen, min(s.max_step_tokens, fill - i))})
    for seq_id in list(s.seqs):
        s.release(seq_id)
    s.prefix_cache.entries.insert(0, stale)
    return s, fresh, prompt


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_planted_reuse_of_rows_since_overwritten_is_detected(build_dir, layout):
    """The pools check a receipt against the rows (a column's generation; the cells' group and write
    counts): the stale entry is not adopted and the output is right."""
    cells = layout == "cell"  # b's 496 tokens take the 492 free cells and 4 of a's 20
    s, fresh, prompt = _planted(build_dir(*LAYOUTS[layout]), fill=496 if cells else 20)
    _, reused = same(s, fresh, {"d": prompt + [7]}, 4)
    assert reused == {"d": 0}


def test_a_planted_reuse_that_went_unchecked_gives_other_logits(build_dir, monkeypatch):
    """With the column's check bypassed, the planted entry is adopted, and its rows are b's: the logits
    differ. (The check above is what keeps the output right.)"""
    s, fresh, prompt = _planted(build_dir(*BATCHED), fill=20)
    monkeypatch.setattr(ColumnPool, "holds", lambda self, seq, receipt: True)
    with pytest.raises(AssertionError, match="relative logit error|the output differs"):
        same(s, fresh, {"d": prompt + [7]}, 4)


def test_a_refused_add_changes_nothing_and_keeps_the_cache(artifact):
    """add refuses a bad prefix token before anything changes: the entry is still there, still adoptable."""
    from pipeline.runtime.session import SessionError

    s, fresh = Session(artifact), Session(artifact, prefix_cache=False)
    prompt = words(torch.Generator().manual_seed(5), 20)
    same(s, fresh, {"a": prompt}, 3)
    entries = list(s.prefix_cache.entries)
    with pytest.raises(SessionError, match="token 1 is 600, outside the vocabulary"):
        s.add("x", [prompt[0], 600])
    assert s.prefix_cache.entries == entries and not s.seqs
    _, reused = same(s, fresh, {"x": prompt + [1]}, 3)
    assert reused == {"x": 20}



def test_a_non_causal_target_keeps_no_prefix_cache(build_dir):
    """A chunk that sees itself whole writes rows that depend on the tokens after them in the chunk, so a
    prefix's rows are not those of the prefix alone: the session keeps no prefix cache. One forced on
    such a session adopts 11 tokens of a 16-token chunk, and the logits differ from a fresh run's."""
    from pipeline.runtime.prefix_cache import PrefixCache

    artifact = build_dir("model.causal=false", "kv=sequence", "kv.max_seqs=4", "backend=portable",
                         "experiment_name=noncausal4", "stages=[export,lower_kv,compile]")
    gen = torch.Generator().manual_seed(6)
    first = words(gen, 25)
    second = first[:11] + words(gen, 9)
    s, fresh = Session(artifact), Session(artifact, prefix_cache=False)
    assert s.prefix_cache is None
    serve(s, {"a": first}, 3)
    assert serve(s, {"b": second}, 3)[2] == {"b": 0}
    s.prefix_cache = PrefixCache(s.models)  # what the session refuses to do
    serve(s, {"a": first}, 3)
    _, got, reused = serve(s, {"b": second}, 3)
    _, want, _ = serve(fresh, {"b": second}, 3, reuse=False)
    assert reused == {"b": 11}
    assert float((got["b"][0] - want["b"][0]).abs().max()) > 1e-3
