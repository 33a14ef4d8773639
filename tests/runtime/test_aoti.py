"""The Inductor runners used for GPU validation (AOTInductor packages, torch.compile), exercised
on the CPU: the child process rebuilds the graphs from the config, refuses graphs that differ from
the parent's, and its separately compiled methods share one set of KV stores and match the oracle."""

import copy

import pytest
import torch

from conftest import compose_config
from pipeline.backends import backend
from pipeline.build.plan import plan_of
from pipeline.build.roles import TARGET
from pipeline.runtime.aoti import MethodServer, MethodServerError
from pipeline.runtime.session import Session
from pipeline.stages import compile as compile_stage
from pipeline.stages import export, lower_kv, validate

OVERRIDES = ("kv=cell", "kv.max_seqs=2", "kv.capacity=128", "backend=portable", "model=tiny_flat")


def _recipe(cfg, **model_changes):
    changed = copy.deepcopy(cfg)
    changed.model.merge_with(model_changes)
    return validate.programs_recipe(plan_of(changed))


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("aoti")
    cfg = compose_config(*OVERRIDES)
    exported = export.run(plan_of(cfg), {}, tmp)
    lowered = lower_kv.run(plan_of(cfg), exported, tmp)
    compile_stage.run(plan_of(cfg), {**exported, **lowered}, tmp)  # manifest.json for the session
    return cfg, exported["models"][TARGET], backend("portable").programs(lowered["lowered"]), tmp


@pytest.mark.parametrize("runtime", ["aoti", "inductor"])
def test_methods_share_stores_and_match_oracle(lowered, runtime):
    cfg, model, programs, artifact = lowered
    with MethodServer(_recipe(cfg), programs, device="cpu", runtime=runtime) as server:
        session = Session(artifact, methods=server.runners)
        scripts = validate.plan(cfg.validate, session.max_seqs, model.args.vocab_size)
        stats = validate.run_episode(session, model, scripts, causal=True)
    assert stats["decode_steps"] > 0 and stats["steps"] > stats["decode_steps"]
    # decode steps read what prefill steps (another compiled method) wrote: not shared -> large errors
    assert max(max(s.errors) for s in scripts) < 1e-4


def test_method_server_refuses_graphs_that_differ(lowered):
    cfg, _, programs, _ = lowered
    with pytest.raises(MethodServerError, match="rebuilt different graphs"):
        MethodServer(_recipe(cfg, seed=cfg.model.seed + 1), programs, device="cpu")  # other weights


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_method_server_reports_a_failure_in_the_child(lowered):
    cfg, _, programs, _ = lowered
    with pytest.raises(MethodServerError, match="compiling the methods"):
        MethodServer(_recipe(cfg), programs, device="cuda")  # the child cannot move them to a GPU
