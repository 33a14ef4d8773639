"""Each stage alone, in order, on the default config; validate proven able to fail."""

import copy
import json

import pytest
import torch

from conftest import compose_config
from pipeline.build.plan import plan_of
from pipeline.build.roles import TARGET
from pipeline.passes.lower_offgraph_kv import count_neutral
from pipeline.stages import StageOrderError, check_order, export, lower_kv, validate
from pipeline.stages import compile as compile_stage


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    cfg = compose_config("backend=portable")
    work = tmp_path_factory.mktemp("stages")
    out = {"cfg": cfg, "work": work}
    out["export"] = export.run(plan_of(cfg), {}, work)
    out["lower_kv"] = lower_kv.run(plan_of(cfg), out["export"], work)
    out["compile"] = compile_stage.run(plan_of(cfg), {**out["export"], **out["lower_kv"]}, work)
    return out


def test_export_alone(staged):
    exported = staged["export"]["exported"]
    assert set(exported) == {"embed_text", "target_forward_from_embeddings"}
    assert count_neutral(exported["embed_text"]) == 0
    assert count_neutral(exported["target_forward_from_embeddings"]) == 4


def test_lower_kv_alone(staged):
    out = staged["lower_kv"]
    assert all(count_neutral(ep) == 0 for ep in out["lowered"].values())
    assert set(out["lowered"]) == {"embed_text", "target_forward_from_embeddings"}


def test_compile_alone_writes_program_and_manifest(staged):
    from executorch.runtime import Runtime

    work = staged["work"]
    manifest = json.loads((work / "manifest.json").read_text())
    assert manifest["program"] == "model.pte" and manifest["backend"] == "portable"
    kv = manifest["target"]
    assert (kv["layout"], kv["max_seqs"], kv["max_segments"], kv["causal"]) == ("sequence", 1, 2, True)
    assert manifest["methods"]["target_forward_from_embeddings"] == [
        "embeddings", "positions", "logit_rows", "block_q", "out_rows", "one_flat", "block_flat", "one_ring", "block_ring"]
    program = Runtime.get().load_program(str(work / "model.pte"))
    assert program.load_method("get_offgraph_kv_max_seqs").execute([])[0] == 1
    assert program.load_method("get_offgraph_kv_max_segments").execute([])[0] == 2


def test_validate_alone_passes(staged):
    cfg = staged["cfg"]
    inputs = {**staged["export"], **staged["lower_kv"]}
    report = validate.run(plan_of(cfg), inputs,
                          staged["work"])["validation"]
    assert report["passed"] and report["max_relative_error"] < 1e-5
    assert report["scenario"]["mixed_steps"] > 0 or report["scenario"]["max_live"] == 1


def test_oracle_over_each_sequence_equals_the_step_by_step_oracle(staged):
    """validate's oracle for a causal artifact (one forward per sequence once the episode is done)
    gives each step's error as the step-by-step oracle over the sequence's own cache does."""
    from pipeline.runtime.session import Session

    cfg, model = staged["cfg"], staged["export"]["models"][TARGET]
    runs = {}
    for stepwise in (True, False):
        session = Session(staged["work"])
        scripts = validate.plan(cfg.validate, session.max_seqs, model.args.vocab_size)
        validate.run_episode(session, model, scripts, causal=True, stepwise=stepwise)
        runs[stepwise] = scripts
    steps = 0
    for by_step, at_end in zip(runs[True], runs[False], strict=True):
        assert len(at_end.errors) == len(by_step.errors) == len(at_end.oracle_agree) > 0
        assert at_end.oracle_agree == by_step.oracle_agree
        assert max(abs(a - b) for a, b in zip(at_end.errors, by_step.errors, strict=True)) < 1e-6
        steps += len(at_end.errors)
    assert steps > 10 and max(e for s in runs[False] for e in s.errors) > 0  # errors measured, not zeros


def test_the_episode_adopts_a_released_prefix_within_tolerance_of_both_oracles(staged):
    """The episode's last sequence begins with the first's prompt and waits for its column: it adopts
    those rows (here 37 tokens: the ring layers still hold what it reads) and prefills the rest; the
    .pte stays within tolerance of the oracle, whether it runs step by step over a cache that holds the
    prefix or once over the whole sequence, and gives the greedy tokens of a session without the cache."""
    from omegaconf import OmegaConf

    from pipeline.runtime.session import Session

    cfg, model = staged["cfg"], staged["export"]["models"][TARGET]
    validate_cfg = OmegaConf.merge(cfg.validate, {"prompt_lengths": [37, 50]})
    runs = {}
    for name, prefix_cache, stepwise in (("step", True, True), ("end", True, False), ("off", False, False)):
        scripts = validate.plan(validate_cfg, 1, model.args.vocab_size)
        assert scripts[1].prompt[:37] == scripts[0].prompt
        stats = validate.run_episode(Session(staged["work"], prefix_cache=prefix_cache), model, scripts, causal=True,
                                     stepwise=stepwise)
        assert stats["reused"] == ({"seq1": 37} if prefix_cache else {})
        assert max(e for s in scripts for e in s.errors) < 1e-5
        runs[name] = scripts
    for step, end, off in zip(runs["step"], runs["end"], runs["off"], strict=True):
        assert len(step.errors) == len(end.errors) > 0
        assert max(abs(a - b) for a, b in zip(step.errors, end.errors, strict=True)) < 1e-6
        assert step.generated == end.generated == off.generated


def test_validate_fails_on_a_corrupted_weight(staged, tmp_path):
    """The program was compiled from the true weights; an oracle that disagrees must fail the build."""
    model = copy.deepcopy(staged["export"]["models"][TARGET])
    with torch.no_grad():
        model.layers[1].attention.wo.weight.add_(1e-2 * torch.randn_like(model.layers[1].attention.wo.weight))
    for name in ("model.pte", "manifest.json"):
        (tmp_path / name).write_bytes((staged["work"] / name).read_bytes())
    with pytest.raises(validate.ValidationFailed, match="exceeds validate.tolerance"):
        cfg = staged["cfg"]
        validate.run(plan_of(cfg), {"models": {TARGET: model}}, tmp_path)
    report = json.loads((tmp_path / "validation.json").read_text())
    assert report["passed"] is False and report["max_relative_error"] > report["tolerance"]


def test_stage_order_checks():
    assert [s.name for s in check_order(["export", "lower_kv", "compile"])] == ["export", "lower_kv", "compile"]
    with pytest.raises(StageOrderError, match="'lower_kv' needs"):
        check_order(["lower_kv", "export"])
    with pytest.raises(StageOrderError, match="not a stage"):
        check_order(["export", "quantize"])
    with pytest.raises(StageOrderError, match="twice"):
        check_order(["export", "export"])



def test_compile_leaves_the_lowered_programs_intact(tmp_path):
    """compile (XNNPACK) works on the lowered programs without copying their weights; the programs
    it was given keep every constant, unchanged."""
    cfg = compose_config("model=tiny_flat")  # the smallest model XNNPACK partitions
    exported = export.run(plan_of(cfg), {}, tmp_path)
    lowered = lower_kv.run(plan_of(cfg), exported, tmp_path)
    ep = lowered["lowered"]["target_forward_from_embeddings"]
    before = {name: t.clone() for name, t in {**ep.state_dict, **ep.constants}.items()}
    compile_stage.run(plan_of(cfg), {**exported, **lowered}, tmp_path)
    after = {**ep.state_dict, **ep.constants}
    assert set(after) == set(before) and len(before) > 10
    assert all(torch.equal(after[name], t) for name, t in before.items())
    ep.module()  # the graph still refers to all of them
