"""The role table (``pipeline/build/roles/``): a model is present by being a row of it. A new role
added through the table alone (here a dummy encoder: a linear map of a fixed-size input to the
target's width) is built, exported, lowered, compiled into the program, listed in the manifest with its
constant methods, and run by ExecuTorch's runtime as its eager module runs; no stage module knows of it."""

import json
from dataclasses import dataclass

import pytest
import torch

from conftest import compose_config
from pipeline.build.plan import plan_of
from pipeline.build.roles import DRAFT, ROLES, TARGET, VISION, MethodSpec, Role, register, unregister

PROBE, PROBE_METHOD, IN_DIM = "probe", "probe_encoder", 8


@dataclass(frozen=True)
class ProbeArgs:
    in_dim: int
    dim: int

    def n_parameters(self) -> int:
        return self.in_dim * self.dim + self.dim


class Probe(Role):
    """A dummy encoder over the target's width; it keeps no KV and reads the model section only."""

    name, section, stage = PROBE, "model", "export"

    def present(self, cfg) -> bool:
        return True

    def args(self, cfg, parts):
        return ProbeArgs(IN_DIM, parts[TARGET].args.dim)

    def methods(self, cfg, part, parts, width, max_seqs):
        return [MethodSpec(PROBE_METHOD)]

    def manifest_section(self, cfg, part, parts):
        return {"in_dim": part.args.in_dim, "out_dim": part.args.dim}

    def constants(self, section, sections):
        return {"get_probe_out_dim": section["out_dim"]}

    def build(self, cfg, part, built, workdir):
        from pipeline.models.transformer import seeded

        return seeded(lambda: torch.nn.Linear(part.args.in_dim, part.args.dim), 7).to(getattr(torch, cfg.model.dtype)), {}

    def views(self, part, built):
        return {PROBE_METHOD: built[PROBE]}

    def example_inputs(self, spec, part, parts, dtype, view):
        from pipeline.passes.lower_offgraph_kv import MethodInputs

        return MethodInputs((torch.zeros(1, part.args.in_dim, dtype=dtype),), None, None, None)


@pytest.fixture
def probe_role():
    register(Probe())
    try:
        yield
    finally:
        unregister(PROBE)


def test_a_model_is_present_by_being_in_the_table():
    assert list(plan_of(compose_config()).parts) == [TARGET]
    assert list(plan_of(compose_config("draft=dflash", "vision=smolvlm_tiny")).parts) == [TARGET, DRAFT, VISION]
    assert list(ROLES) == [TARGET, DRAFT, VISION]


def test_layouts_and_bounds_derived_once_by_the_plan():
    plan = plan_of(compose_config("draft=dflash", "kv.max_seqs=4"))
    target, draft = plan.parts[TARGET], plan.parts[DRAFT]
    block = draft.args.block_size
    assert target.layout.step_width == max(16, 4 * block) and target.layout.causal  # a step verifies every block
    assert draft.layout.step_width == draft.layout.max_step_tokens == 2 * 4 * block and not draft.layout.causal
    assert {m.name: (m.width, m.rows) for m in target.methods + draft.methods} == {
        "embed_text": (32, 0), "target_forward_from_embeddings": (32, 32), "draft_forward": (64, 64)}
    sections = plan.manifest_sections()
    assert sections[TARGET]["step_width"] == 32 and sections[DRAFT]["block_size"] == block


def test_a_new_role_through_the_table_alone(probe_role, tmp_path):
    from executorch.runtime import Runtime

    from pipeline.build.runner import build
    from pipeline.runtime.session import Session

    cfg = compose_config(f"output_root={tmp_path}", "backend=portable")
    plan = plan_of(cfg)
    assert list(plan.parts) == [TARGET, PROBE] and plan.parts[PROBE].layout is None
    version = build(cfg)
    manifest = json.loads((version / "manifest.json").read_text())
    assert manifest[PROBE] == {"in_dim": IN_DIM, "out_dim": plan.target.args.dim}
    assert list(manifest["methods"]) == ["embed_text", "target_forward_from_embeddings", PROBE_METHOD]
    assert json.loads((version / "build.json").read_text())["models"][PROBE]["weights_sha256"]
    program = Runtime.get().load_program(str(version / "model.pte"))
    assert program.load_method("get_probe_out_dim").execute([])[0] == plan.target.args.dim
    x = torch.randn(1, IN_DIM)
    eager = Probe().build(cfg, plan.parts[PROBE], {}, None)[0]
    got = program.load_method(PROBE_METHOD).execute([x])[0]
    assert torch.allclose(got, eager(x), atol=1e-6)
    Session(version)  # the session checks every constant method against the manifest, the probe's included
    assert json.loads((version / "validation.json").read_text())["passed"]
