"""The serving session: it reads the layout from the artifact and refuses what it cannot serve."""

import re

import pytest
import torch

from conftest import BATCHED, CELL
from pipeline.runtime.session import Session, SessionError


@pytest.fixture(scope="module")
def batched(build_dir):
    return build_dir(*BATCHED)


def test_layout_comes_from_the_artifact(batched, build_dir):
    assert Session(batched).layout == "batched-sequence" and Session(batched).max_seqs == 4
    assert Session(build_dir(*CELL)).layout == "cell"


def test_errors(batched):
    s = Session(batched)
    for i in range(4):
        s.add(i)
    with pytest.raises(SessionError, match="4 sequences are live"):
        s.add(4)
    with pytest.raises(SessionError, match="unknown sequence 'nope'"):
        s.step({"nope": [1]})
    with pytest.raises(SessionError, match="exceeds the artifact's max_step_tokens=16"):
        s.step({0: [1] * 17})
    s.release(3)
    s.add("new")  # a freed column is reused
    assert s.seqs["new"].slot == 3
    for _ in range(8):
        s.step({0: [5] * 16})
    with pytest.raises(SessionError, match="past the flat layers' capacity of 128"):
        s.step({0: [5]})


def test_logits_only_for_sampled_rows(batched):
    s = Session(batched)
    s.add("a")
    s.add("b")
    out = s.step({"a": [1] * 10, "b": [2] * 5})
    assert set(out) == {"a", "b"} and out["a"].shape == (512,)


def test_cell_pool_full(build_dir):
    s = Session(build_dir(*CELL))
    s.add("a")
    for _ in range(512 // 16):
        s.step({"a": [3] * 16})
    with pytest.raises(SessionError, match="cell pool is full"):
        s.step({"a": [3]})
    s.release("a")
    s.add("b")
    s.step({"b": [1, 2]})  # released cells are free again


# --- a refused or failed step changes nothing ---

LAYOUT_BUILDS = {"sequence": (), "batched-sequence": BATCHED, "cell": CELL}


class Oracle:
    """The eager model with one independent reference cache per sequence."""

    def __init__(self, *overrides):
        from conftest import compose_config
        from pipeline.models.args import model_args
        from pipeline.models.transformer import build_model

        cfg = compose_config(*overrides)
        self.model = build_model(model_args(cfg.model), cfg.model.seed)
        self.causal = cfg.model.causal
        self.caches = {}

    def add(self, seq_id):
        from pipeline.kv.op import ReferenceCache

        self.caches[seq_id] = ReferenceCache(self.model.args.layer_kv(), self.causal)

    def logits(self, seq_id, tokens):
        from pipeline.kv.op import reference_cache

        cache = self.caches[seq_id]
        start = cache.length
        with reference_cache(cache), torch.no_grad():
            hidden = self.model.hidden(self.model.embed(torch.tensor(tokens)), torch.arange(start, start + len(tokens)))
            return self.model.logits(hidden[-1:])[0]


def snapshot(s: Session):
    return ({k: (q.slot, q.length, tuple(q.cells)) for k, q in s.seqs.items()}, *s.pool.snapshot())


def assert_same(a, b):
    assert len(a) == len(b) and a[0] == b[0]
    for x, y in zip(a[1:], b[1:], strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def step_and_check(s: Session, oracle: Oracle, feeds: dict):
    got = s.step(feeds)
    for seq_id, toks in feeds.items():
        want = oracle.logits(seq_id, toks)
        err = float((got[seq_id] - want).abs().max() / (want.max() - want.min()))
        assert err < 1e-4, f"{seq_id}: relative error {err:.2e} against the oracle"


BAD_TOKENS = [
    ([512], "token 0 is 512, outside the vocabulary [0, 512)"),
    ([3, -1], "token 1 is -1, outside the vocabulary"),
    ([2.5], "token 0 is 2.5 (float), not an integer id"),
    ([True], "token 0 is True (bool), not an integer id"),
    (torch.tensor([1.0, 2.0]), "1-d integer tensor, got torch.float32"),
    ("hello", "must be a list of token ids"),
    ([], "is fed no tokens"),
]


@pytest.mark.parametrize("layout", LAYOUT_BUILDS)
def test_refused_step_changes_nothing(build_dir, layout):
    """Bad tokens next to a valid sequence: a clear error naming the sequence, the state untouched,
    and the next steps of every sequence still equal the oracle."""
    s = Session(build_dir(*LAYOUT_BUILDS[layout]))
    oracle = Oracle(*LAYOUT_BUILDS[layout])
    ids = ["a", "b"] if s.max_seqs > 1 else ["a"]
    gen = torch.Generator().manual_seed(3)
    for seq_id in ids:
        s.add(seq_id)
        oracle.add(seq_id)
    step_and_check(s, oracle, {seq_id: torch.randint(0, 512, (5,), generator=gen).tolist() for seq_id in ids})
    bad_id = ids[-1]
    for bad, needle in BAD_TOKENS:
        before = snapshot(s)
        with pytest.raises(SessionError, match=re.escape(f"sequence {bad_id!r}") + ".*" + re.escape(needle)):
            s.step({**{seq_id: [7] for seq_id in ids[:-1]}, bad_id: bad})
        assert_same(before, snapshot(s))
    with pytest.raises(SessionError, match="unknown sequence 'zz'"):
        s.step({ids[0]: [7], "zz": [1]})
    assert_same(before, snapshot(s))
    for token in (7, 11, 13):
        step_and_check(s, oracle, {seq_id: [token] for seq_id in ids})


@pytest.mark.parametrize("layout", LAYOUT_BUILDS)
def test_program_failure_leaves_the_session_as_it_was(build_dir, layout):
    """The program runs (and writes KV rows or cells) and then fails: the session is as before the
    step, and what the failed step wrote is never read."""
    s = Session(build_dir(*LAYOUT_BUILDS[layout]))
    oracle = Oracle(*LAYOUT_BUILDS[layout])
    ids = ["a", "b"] if s.max_seqs > 1 else ["a"]
    for seq_id in ids:
        s.add(seq_id)
        oracle.add(seq_id)
    step_and_check(s, oracle, {seq_id: [5 + i, 9, 2, 40 + i] for i, seq_id in enumerate(ids)})
    real = s.method("target_forward_from_embeddings")

    class WritesThenFails:
        def execute(self, args):
            real.execute(args)  # the stores now hold this step's rows
            raise RuntimeError("injected failure after the program ran")

    s._methods["target_forward_from_embeddings"] = WritesThenFails()
    before = snapshot(s)
    with pytest.raises(SessionError, match="program failed.*injected failure.*session is unchanged"):
        s.step({seq_id: [100, 200, 300] for seq_id in ids})
    assert_same(before, snapshot(s))
    s._methods["target_forward_from_embeddings"] = real
    for token in (8, 21, 34):  # decodes: the failed step's last two rows (or cells) lie past every length
        step_and_check(s, oracle, {seq_id: [token] for seq_id in ids})
    step_and_check(s, oracle, {seq_id: [55, 89] for seq_id in ids})


def test_add_and_release_refused_without_change(batched):
    s = Session(batched)
    s.add("a")
    before = snapshot(s)
    for bad, needle in ((lambda: s.add("a"), "already live"), (lambda: s.add(["x"]), "not hashable"),
                        (lambda: s.release("nope"), "unknown sequence 'nope'"), (lambda: s.release(["x"]), "unknown sequence")):
        with pytest.raises(SessionError, match=needle):
            bad()
        assert_same(before, snapshot(s))


def test_decode_step_may_be_wider_than_max_step_tokens(tmp_path):
    """With more live sequences than max_step_tokens, a decode step takes one token of each."""
    from conftest import compose_config
    from pipeline.build.runner import build

    overrides = ("kv.max_seqs=6", "kv.max_step_tokens=4", "backend=portable", "model=tiny_flat")
    version = build(compose_config(f"output_root={tmp_path}", *overrides, "stages=[export,lower_kv,compile]"))
    s, oracle = Session(version), Oracle(*overrides)
    for i in range(6):
        s.add(i)
        oracle.add(i)
        step_and_check(s, oracle, {i: [i + 1, 2 * i + 3]})
    step_and_check(s, oracle, {i: [i + 7] for i in range(6)})
    with pytest.raises(SessionError, match="a step of 6 tokens exceeds the artifact's max_step_tokens=4"):
        s.step({0: [1, 2], 1: [3, 4], 2: [5, 6]})


def _gathered_logits(s, values, feeds: dict):
    """The step method run on ``values`` (step buffers by name, edited by the caller), one logit row per
    sequence of ``feeds`` ({seq: one token}), without committing anything to the session."""
    method = s.method("target_forward_from_embeddings")
    emb = s.method("embed_text").execute([torch.tensor(list(feeds.values()))])[0]
    pos = torch.tensor([s.seqs[k].length for k in feeds])
    names = [b["name"] for b in s.kv["step_buffers"]]
    return method.execute([emb, pos, torch.arange(len(feeds)), *[values[n] for n in names]])[0].clone()


def test_attention_reads_only_the_rows_each_sequence_holds(batched):
    """The CPU attention reads the store slots the session lists per query: each decode its own
    sequence's rows in position order (the shorter one's list padded with position -1, never another
    column's rows). Hiding the longer sequence's last listed key changes its logits only: the lists are
    live in the program."""
    s = Session(batched)
    oracle = Oracle(*BATCHED)
    gen = torch.Generator().manual_seed(5)
    lengths = {"a": 9, "b": 14}
    for seq_id, n in lengths.items():
        s.add(seq_id)
        oracle.add(seq_id)
        step_and_check(s, oracle, {seq_id: torch.randint(0, 512, (n,), generator=gen).tolist()})
    order = [(s.seqs[k], 1) for k in lengths]
    values = s.kv_layout.step_buffer_values(order, [], s.pool)
    columns = s.kv_layout.columns
    for kind in s.kv_layout.kinds:
        rows = s.kv_layout.rows_of(kind)
        for row, (seq, _) in enumerate(order):
            held = min(seq.length + 1, rows)
            slots, kpos, _ = values[f"one_{kind}"][row]
            assert kpos[:held].tolist() == list(range(seq.length + 1 - held, seq.length + 1))
            assert bool((kpos[held:] == -1).all()), "past a sequence's rows its list is padding"
            assert bool((slots[:held] % columns == seq.slot).all()), "a query reads its own column only"
    feeds = {"a": 17, "b": 23}
    full = _gathered_logits(s, values, feeds)
    want = torch.stack([oracle.logits(k, [t]) for k, t in feeds.items()])
    assert float((full - want).abs().max() / (want.max() - want.min())) < 1e-4
    hidden = {**values, "one_flat": values["one_flat"].clone()}
    hidden["one_flat"][1, 1, lengths["b"]] = -1  # b's newest key (its own token) in the flat layers
    short = _gathered_logits(s, hidden, feeds)
    assert (short[1] - full[1]).abs().max() > 1e-3, "hiding a listed key must change b's logits"
    assert torch.equal(short[0], full[0]), "a's list is untouched"


def test_prefill_chunk_shares_one_key_list(batched):
    """A prefill chunk is the step's block: its sequence's rows are listed once for all its tokens
    (``block_<kind>``), while a decode in the same step attends alone; both match the oracle."""
    s = Session(batched)
    oracle = Oracle(*BATCHED)
    for seq_id, prompt in (("a", [5, 6, 7]), ("b", [9])):
        s.add(seq_id)
        oracle.add(seq_id)
        step_and_check(s, oracle, {seq_id: prompt})
    order = [(s.seqs["a"], 1), (s.seqs["b"], 4)]
    values = s.kv_layout.step_buffer_values(order, [], s.pool)
    assert values["block_q"].tolist() == [1, 2, 3, 4] and values["one_flat"][:, 2, 0].tolist() == [0]
    assert values["block_flat"][1].tolist() == list(range(5)), "b's rows once, after its 4 new tokens"
    assert values["out_rows"].tolist() == [0, 1, 2, 3, 4]
    step_and_check(s, oracle, {"a": [11], "b": [12, 13, 14, 15]})


def test_cell_attention_reads_each_sequences_own_cells(build_dir):
    """The pool hands out its lowest free cells (released ones too); a query reads the cells of its own
    sequence, listed in position order wherever they lie in the pool. Hiding one of b's cells changes
    b's logits only. (Without the prefix cache: it keeps a released sequence's cells until the free ones
    run out.)"""
    s = Session(build_dir(*CELL), prefix_cache=False)
    oracle = Oracle(*CELL)
    for seq_id, n in (("a", 6), ("b", 4)):
        s.add(seq_id)
        oracle.add(seq_id)
        step_and_check(s, oracle, {seq_id: list(range(1, n + 1))})
    s.release("a")  # cells 0..5 free again: the next step takes them before any higher cell
    s.add("c")
    oracle.add("c")
    step_and_check(s, oracle, {"c": [9, 8, 7]})
    assert s.seqs["c"].cells == [0, 1, 2]
    order = [(s.seqs["b"], 1), (s.seqs["c"], 1)]
    chosen = s.pool.choose(2)
    assert chosen == [3, 4]
    values = s.kv_layout.step_buffer_values(order, chosen, s.pool)
    assert values["one_cells"][:, 0].tolist() == [[6, 7, 8, 9, 3], [0, 1, 2, 4, 0]]
    assert values["one_cells"][:, 1].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, -1]]
    feeds = {"b": 17, "c": 23}
    full = _gathered_logits(s, values, feeds)
    want = torch.stack([oracle.logits("b", [17]), oracle.logits("c", [23])])
    assert float((full - want).abs().max() / (want.max() - want.min())) < 1e-4
    hidden = {**values, "one_cells": values["one_cells"].clone()}
    hidden["one_cells"][0, 1, 3] = -1
    short = _gathered_logits(s, hidden, feeds)
    assert (short[0] - full[0]).abs().max() > 1e-3, "hiding one of b's cells must change its logits"
    assert torch.equal(short[1], full[1]), "c's cells are untouched"
