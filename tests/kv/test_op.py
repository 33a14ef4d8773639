"""One neutral op, ExecuTorch's: its own test suite passes next to our pipeline whichever is
imported first, and our eager reference caches agree with ExecuTorch's where both apply."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from executorch.extension.llm.cache.reference_cache import (
    CacheConfig,
    CellReferenceCache,
    ContiguousReferenceCache,
    LayerPolicy,
)
from executorch.extension.llm.cache.update_and_attend import REGISTRY

from conftest import compose_config
from pipeline.build.plan import plan_of
from pipeline.build.roles import TARGET
from pipeline.kv.op import NEUTRAL_OP, ReferenceCache, reference_cache
from pipeline.models.args import model_args
from pipeline.models.transformer import build_model

ET_TESTS = "executorch.extension.llm.cache.test_update_and_attend"
PIPELINE = "import pipeline.kv.op, pipeline.models.transformer, pipeline.stages.export, pipeline.stages.lower_kv"


def pipeline_works() -> None:
    """Our side in the same process: the eager oracle, export and lowering of the default model."""
    from pipeline.stages import export, lower_kv

    cfg = compose_config()
    exported = export.run(plan_of(cfg), {}, None)
    lowered = lower_kv.run(plan_of(cfg), exported, None)
    model = exported["models"][TARGET]
    with reference_cache(ReferenceCache(model.args.layer_kv())), torch.no_grad():
        model.logits(model.hidden(model.embed(torch.arange(5)), torch.arange(5)))
    assert set(lowered["lowered"]) == {"embed_text", "target_forward_from_embeddings"}


@pytest.mark.parametrize("first", ["pipeline", "executorch"])
def test_executorch_op_suite_passes_next_to_the_pipeline(first):
    """ExecuTorch's 38 op tests and our export + lowering in one process, either imported first
    (with an op of our own under the same name, one order broke 14 of theirs, the other ours)."""
    imports = [PIPELINE, f"import {ET_TESTS}"]
    if first == "executorch":
        imports.reverse()
    code = "; ".join([*imports, "import sys, unittest",
                      f"r = unittest.main(module='{ET_TESTS}', exit=False, argv=['x']).result",
                      "import test_op; test_op.pipeline_works()",
                      "sys.exit(0 if r.wasSuccessful() and r.testsRun >= 38 else 1)"])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parent, env={**os.environ, "PYTHONWARNINGS": "ignore",
                                                          "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                                                         os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Ran 38 tests" in proc.stderr and "\nOK" in proc.stderr


def test_the_op_is_executorchs():
    schema = NEUTRAL_OP._schema
    assert [a.name for a in schema.arguments] == ["q", "k", "v", "position", "layer_id", "scale", "out_dtype"]
    sources = Path(__file__).resolve().parents[2] / "pipeline"
    registering = [p for p in sources.rglob("*.py") if '"kvcache::update_and_attend"' in p.read_text()]
    assert registering == [], "the pipeline must not register an op of its own under ExecuTorch's name"


@pytest.fixture(scope="module")
def model():
    cfg = compose_config()  # tiny: ring (window 16) and flat layers alternate
    return build_model(model_args(cfg.model), cfg.model.seed)


def _policies(model):
    return [LayerPolicy.ring(layer.window) if layer.window else LayerPolicy.flat() for layer in model.args.layer_kv()]


def close(got, want) -> bool:
    """Equal up to fp32 rounding: 1e-5 of the oracle's logit range."""
    return float((got - want).abs().max()) <= 1e-5 * float(want.max() - want.min())


def _run(model, cache_ctx, tokens, start):
    with cache_ctx, torch.no_grad():
        return model.logits(model.hidden(model.embed(torch.tensor(tokens)), torch.arange(start, start + len(tokens))))


def test_reference_cache_agrees_with_executorchs_contiguous_cache(model):
    """One sequence: prefill, chunked prefill past the window, decodes; flat and ring layers."""
    a = model.args
    ours = ReferenceCache(a.layer_kv())
    theirs = ContiguousReferenceCache(CacheConfig(n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                                  capacity=256, layers=_policies(model)))
    REGISTRY.install("test-contiguous", theirs)
    gen = torch.Generator().manual_seed(0)
    start = 0
    try:
        for n in (13, 1, 9, 1, 1, 20, 1):  # 46 tokens: the ring layers' window of 16 slides
            tokens = torch.randint(0, a.vocab_size, (n,), generator=gen).tolist()
            got = _run(model, reference_cache(ours), tokens, start)
            want = _run(model, REGISTRY.active("test-contiguous"), tokens, start)
            assert close(got, want), (n, float((got - want).abs().max()))
            start += n
    finally:
        REGISTRY.uninstall("test-contiguous")


def test_per_sequence_caches_agree_with_executorchs_cell_cache(model):
    """Three sequences sharing ExecuTorch's cell pool in mixed steps against one of our caches each."""
    a = model.args
    cells = CellReferenceCache(CacheConfig(n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                           capacity=256, layers=_policies(model)))
    REGISTRY.install("test-cells", cells)
    ours = {s: ReferenceCache(a.layer_kv()) for s in range(3)}
    gen = torch.Generator().manual_seed(1)
    steps = [{0: 11, 1: 4}, {0: 1, 1: 1, 2: 17}, {0: 1, 1: 6, 2: 1}, {0: 1, 1: 1, 2: 1}, {0: 12, 2: 1}]
    try:
        for feeds in steps:
            tokens = {s: torch.randint(0, a.vocab_size, (n,), generator=gen).tolist() for s, n in feeds.items()}
            starts = {s: ours[s].length for s in feeds}
            flat_tokens = [t for s in feeds for t in tokens[s]]
            positions = [p for s in feeds for p in range(starts[s], starts[s] + feeds[s])]
            cells.begin_step([s for s in feeds for _ in range(feeds[s])])
            with REGISTRY.active("test-cells"), torch.no_grad():
                hidden = model.hidden(model.embed(torch.tensor(flat_tokens)), torch.tensor(positions))
                got = model.logits(hidden)
            offset = 0
            for s in feeds:
                want = _run(model, reference_cache(ours[s]), tokens[s], starts[s])
                assert close(got[offset: offset + feeds[s]], want), (feeds, s)
                offset += feeds[s]
    finally:
        REGISTRY.uninstall("test-cells")


def test_cross_check_can_fail(model):
    """The comparison above sees a wrong cache: a ring layer treated as flat disagrees."""
    a = model.args
    ours = ReferenceCache(a.layer_kv())
    theirs = ContiguousReferenceCache(CacheConfig(n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                                  capacity=256, layers=[LayerPolicy.flat()]))
    REGISTRY.install("test-wrong", theirs)
    tokens = torch.randint(0, a.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    try:
        got = _run(model, reference_cache(ours), tokens, 0)
        want = _run(model, REGISTRY.active("test-wrong"), tokens, 0)
    finally:
        REGISTRY.uninstall("test-wrong")
    assert not close(got, want)


def test_non_causal_reference_cache_sees_the_whole_block(model):
    """A non-causal cache (the draft's rule, which ExecuTorch's caches lack): every token of a block
    sees every other, so an earlier token's output changes with a later token."""
    a = model.args
    tokens = [5, 6, 7, 8]
    first = _run(model, reference_cache(ReferenceCache(a.layer_kv(), causal=False)), tokens, 0)
    other = _run(model, reference_cache(ReferenceCache(a.layer_kv(), causal=False)), tokens[:3] + [99], 0)
    causal = _run(model, reference_cache(ReferenceCache(a.layer_kv(), causal=True)), tokens[:3] + [99], 0)
    assert not close(first[0], other[0])
    assert close(causal[0], _run(model, reference_cache(ReferenceCache(a.layer_kv())), tokens, 0)[0])
