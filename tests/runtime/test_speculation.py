"""An artifact with a DFlash draft: its manifest and constants, its validation, and speculative
sessions through the .pte that equal the target's greedy decoding whatever the draft proposes."""

import json

import pytest
import torch

from conftest import DRAFT_VISION, compose_config
from pipeline.build.plan import plan_of
from pipeline.build.roles import DRAFT, TARGET
from pipeline.models.methods import build_draft_model, build_target
from pipeline.runtime.session import Session, SessionError
from pipeline.runtime.speculative import greedy_generate

DRAFT_BATCHED = DRAFT_VISION  # the draft tests feed no images: the vision encoder does not take part
DRAFT_CELL = ("draft=dflash", "kv=cell", "kv.max_seqs=4", "backend=portable", "experiment_name=draftcell4")
PROMPTS = {"a": [5, 17, 300, 42, 9, 77, 1, 250, 11], "b": [400, 3], "c": list(range(60, 90)), "d": [128]}
NEW_TOKENS = 30


@pytest.fixture(scope="module")
def batched(build_dir):
    return build_dir(*DRAFT_BATCHED)


@pytest.fixture(scope="module")
def greedy():
    """The eager target's greedy continuation of each prompt (the output every speculative run must give)."""
    target, _ = build_target(compose_config(*DRAFT_BATCHED).model, None)
    out = {seq_id: greedy_generate(target, prompt, NEW_TOKENS + 1) for seq_id, prompt in PROMPTS.items()}
    assert all(len(set(tokens)) > 5 for tokens in out.values()), "the continuations vary"
    return out


def test_manifest_has_a_section_per_model(batched):
    manifest = json.loads((batched / "manifest.json").read_text())
    target, draft = manifest["target"], manifest["draft"]
    assert (target["layout"], target["max_seqs"], target["causal"]) == ("batched-sequence", 4, True)
    assert (draft["layout"], draft["max_seqs"], draft["causal"]) == ("batched-sequence", 4, False)
    assert (draft["block_size"], draft["target_layer_ids"], draft["mask_token_id"]) == (8, [1, 3], 1)
    assert len(draft["layers"]) == 1 and target["step_width"] == 4 * 8
    assert set(manifest["methods"]) == {"embed_text", "target_forward_from_embeddings", "draft_forward", "vision_encoder"}
    record = json.loads((batched / "build.json").read_text())
    assert set(record["models"]) == {"target", "draft", "vision"}
    assert record["models"]["draft"]["causal"] is False
    assert record["kv_bytes_total"] == target["kv_bytes_total"] + draft["kv_bytes_total"]


def test_constant_methods_agree(batched):
    s = Session(batched)  # checks every constant method against the manifest
    assert s.constant("get_offgraph_kv_max_seqs") == 4 and s.constant("get_draft_offgraph_kv_max_seqs") == 4
    assert s.constant("get_draft_offgraph_kv_seq_capacity") == 128 and s.constant("get_draft_offgraph_kv_causal") == 0
    assert s.constant("get_block_size") == 8 and s.constant("get_mask_token_id") == 1
    assert s.constant("get_target_layer_ids", many=True) == [1, 3] and s.constant("get_n_target_layers") == 2


def test_validation_ran_speculatively(batched):
    report = json.loads((batched / "validation.json").read_text())
    spec = report["speculative"]
    assert report["passed"] and spec["equals_greedy"] and spec["proposal_mismatches"] == 0
    assert spec["draft_max_relative_error"] < 1e-5 and report["scenario"]["speculative_rounds"] > 10
    assert all(spec["acceptance"].values())


def _speculate(artifact, propose=None, seqs=PROMPTS):
    """Prefill every prompt (chunked), then speculative rounds until NEW_TOKENS each; tokens per sequence."""
    s = Session(artifact)
    out = {}
    for seq_id in seqs:
        s.add(seq_id)
    pending = dict(seqs)
    while any(pending.values()):
        feeds, room = {}, s.max_step_tokens
        for seq_id, toks in pending.items():
            if toks and room:
                feeds[seq_id], pending[seq_id] = toks[:room], toks[room:]
                room -= len(feeds[seq_id])
        logits = s.step(feeds)
        out |= {seq_id: [int(logits[seq_id].argmax())] for seq_id in feeds if not pending[seq_id]}
    while live := [seq_id for seq_id in seqs if len(out[seq_id]) <= NEW_TOKENS]:
        rounds = s.speculate({seq_id: out[seq_id][-1] for seq_id in live},
                             propose=(lambda seq_id, p: propose(seq_id, len(out[seq_id]), p)) if propose else None)
        for seq_id, r in rounds.items():
            out[seq_id] += r.tokens
    return s, {seq_id: tokens[: NEW_TOKENS + 1] for seq_id, tokens in out.items()}


def test_the_drafts_own_proposals_give_greedy(batched, greedy):
    s, out = _speculate(batched)
    assert out == greedy
    assert all(n >= 1 for n in s.acceptance["a"])


def _oracle(greedy, corrupt_at=None):
    def propose(seq_id, have, proposals):  # the target's own continuation after the have tokens so far
        want = (greedy[seq_id] + [0] * 16)[have: have + len(proposals)]
        if corrupt_at is not None and corrupt_at < len(want):
            want[corrupt_at] = (want[corrupt_at] + 1) % 512
        return want
    return propose


@pytest.mark.parametrize("build", [DRAFT_BATCHED, DRAFT_CELL], ids=["batched-sequence", "cell"])
def test_oracle_proposals_are_all_accepted(build, build_dir, greedy):
    artifact = build_dir(*build)
    s, out = _speculate(artifact, _oracle(greedy))
    assert out == greedy
    # every round but the last takes the whole block: 7 proposals and the bonus token
    assert all(n == 8 for n in s.acceptance["a"][:-1]) and len(s.acceptance["a"]) == 4


@pytest.mark.parametrize("build", [DRAFT_BATCHED, DRAFT_CELL], ids=["batched-sequence", "cell"])
def test_a_wrong_proposal_cuts_the_round(build, build_dir, greedy):
    """Proposal 3 wrong: every round keeps proposals 0..2 and the target's token (4 tokens), and the
    output is still greedy (the rejected rows are never read again)."""
    s, out = _speculate(build_dir(*build), _oracle(greedy, corrupt_at=3))
    assert out == greedy
    assert all(n == 4 for n in s.acceptance["c"][:-1])
    if build is DRAFT_CELL:  # the rejected rows' cells were never taken; released sequences, evicted, free the rest
        for seq_id in PROMPTS:
            s.release(seq_id)
        for entry in list(s.prefix_cache.entries):
            s.evict(entry)
        assert len(s.pool.free_cells) == 512 and len(s.models[DRAFT].pool.free_cells) == 512


def _speculative(s: Session, seq_id, prompt: list[int], new: int) -> tuple[int, dict, list[int]]:
    """Add ``seq_id`` adopting what the session holds of all but the prompt's last token, prefill the
    rest, speculate until more than ``new`` tokens: (tokens reused, each model's length after the add,
    every token it gave; all but the last were fed)."""
    reused = s.add(seq_id, prompt[:-1])
    lengths = {name: model.seqs[seq_id].length for name, model in s.models.items()}
    lengths["pending"] = len(s.speculation.pending[seq_id])
    rest = prompt[reused:]
    for start in range(0, len(rest), s.max_step_tokens):
        logits = s.step({seq_id: rest[start: start + s.max_step_tokens]})[seq_id]
    out = [int(logits.argmax())]
    while len(out) <= new:
        out += s.speculate({seq_id: out[-1]})[seq_id].tokens
    return reused, lengths, out


@pytest.mark.parametrize("build", [DRAFT_BATCHED, DRAFT_CELL], ids=["batched-sequence", "cell"])
def test_an_adopted_prefix_takes_the_drafts_rows_too(build, build_dir, greedy):
    """The next turn of a conversation (everything the last one held, then new tokens) adopts its rows in
    both models: the draft's own rows as far as its context had reached, and the target features it had
    not seen yet. The tokens are those of a session that prefilled everything itself, and so is the
    draft's acceptance, round by round (its proposals are the same)."""
    s = Session(build_dir(*build))
    _, _, first = _speculative(s, "first", PROMPTS["c"], NEW_TOKENS)
    assert first[: NEW_TOKENS + 1] == greedy["c"]
    held = PROMPTS["c"] + first[:-1]  # every token fed: the ring rows hold its end (prefix_rows_held)
    draft_length = s.models[DRAFT].seqs["first"].length
    s.release("first")
    prompt = held + [7, 300, 42]
    reused, lengths, out = _speculative(s, "second", prompt, 12)
    assert reused == len(held) and lengths[TARGET] == reused
    assert lengths[DRAFT] == min(reused, draft_length) > 0, "the draft's rows are adopted"
    assert lengths[DRAFT] + lengths["pending"] == reused, "the draft is given the features it lacks"
    fresh = Session(build_dir(*build), prefix_cache=False)
    none, _, want = _speculative(fresh, "second", prompt, 12)
    assert none == 0 and out == want
    assert s.acceptance["second"] == fresh.acceptance["second"]


def test_speculation_errors(batched):
    s = Session(batched)
    s.add("a")
    with pytest.raises(SessionError, match="is empty: prefill its prompt"):
        s.speculate({"a": 3})
    s.step({"a": [1, 2, 3]})
    with pytest.raises(SessionError, match="outside the vocabulary"):
        s.speculate({"a": 512})
    with pytest.raises(SessionError, match="outside the vocabulary"):
        s.speculate({"a": 3}, propose=lambda seq_id, p: [600] * len(p))
    with pytest.raises(SessionError, match="propose returned 9 proposals for a block of 7"):
        s.speculate({"a": 3}, propose=lambda seq_id, p: [4] * 9)
    for _ in range(7):
        s.step({"a": [5] * 16})
    s.step({"a": [5] * 13})
    assert s.seqs["a"].length == 128
    with pytest.raises(SessionError, match="flat layers' capacity of 128"):
        s.speculate({"a": 3})


def test_no_draft_no_speculation(build_dir):
    from conftest import BATCHED

    with pytest.raises(SessionError, match="has no draft: build with draft=dflash"):
        Session(build_dir(*BATCHED)).speculate({"a": 1})


def test_validate_fails_on_a_wrong_draft(batched, tmp_path):
    """The program's draft was compiled from the true weights; an eager draft that disagrees fails it."""
    from pipeline.stages import validate

    cfg = compose_config(*DRAFT_BATCHED)
    target, _ = build_target(cfg.model, None)
    draft = build_draft_model(cfg.draft, target.args)
    with torch.no_grad():
        draft.fc.weight.add_(1e-2 * torch.randn_like(draft.fc.weight))
    for name in ("model.pte", "manifest.json"):
        (tmp_path / name).write_bytes((batched / name).read_bytes())
    with pytest.raises(validate.ValidationFailed, match="the draft's max relative logit error"):
        validate.run(plan_of(cfg), {"models": {TARGET: target, DRAFT: draft}}, tmp_path)
