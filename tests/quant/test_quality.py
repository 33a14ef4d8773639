"""validate's two measures of a quantized artifact (issue 51): exactness, the .pte against its
quantized oracle held to the oracle's own noise floor, and quality, KL divergence, top-1 agreement and
the perplexity ratio against the unquantized model on the fixed text. Each is shown failing on a
planted fault."""

import math
import os

import pytest
import torch
import transformers
from test_quant import QUANT_MODEL

from conftest import compose_config
from pipeline.models.methods import build_target
from pipeline.quant.apply import quantize
from pipeline.validation import quality


def test_measures_against_their_definitions():
    """KL(P || Q), top-1 agreement and the perplexity ratio against a direct float64 computation on
    random logits; a model against itself is at 0, 100% and 1."""
    gen = torch.Generator().manual_seed(0)
    want, got = torch.randn(50, 30, generator=gen) * 3, torch.randn(50, 30, generator=gen) * 3
    targets = torch.randint(0, 30, (50,), generator=gen)
    m = quality.summarize([quality.compare(got, want, targets)])
    p, q = torch.softmax(want.double(), -1), torch.softmax(got.double(), -1)
    kld = (p * (p / q).log()).sum(-1)
    assert m["mean_kld"] == pytest.approx(float(kld.mean()), rel=1e-9)
    assert m["max_kld"] == pytest.approx(float(kld.max()), rel=1e-9)
    assert m["top1_agreement"] == float((got.argmax(-1) == want.argmax(-1)).double().mean())
    nll = -q[torch.arange(50), targets].log().mean()
    nll_ref = -p[torch.arange(50), targets].log().mean()
    assert m["ppl_ratio"] == pytest.approx(math.exp(float(nll - nll_ref)), rel=1e-9)
    same = quality.summarize([quality.compare(want, want, targets)])
    assert same["max_kld"] < 1e-12 and same["top1_agreement"] == 1 and same["ppl_ratio"] == pytest.approx(1)


def test_bounds_name_what_they_break():
    cfg = compose_config("quant=from_checkpoint").validate
    good = {"mean_kld": 0.01, "p99_kld": 0.05, "top1_agreement": 0.95, "ppl_ratio": 1.01}
    assert quality.held(good, cfg) == []
    bad = quality.held({**good, "mean_kld": 1.0, "top1_agreement": 0.1}, cfg)
    assert len(bad) == 2 and "validate.max_mean_kld" in bad[0] and "validate.min_top1_agreement" in bad[1]


def test_windows_cover_the_text():
    tokens = list(range(1100))
    got = quality.windows(tokens, 1024)
    assert [len(w) for w in got] == [512, 512, 76] and sum(got, []) == tokens
    assert [len(w) for w in quality.windows(list(range(130)), 64)] == [64, 64, 2]  # a 2-token tail is kept, 1 is not
    assert quality.windows(list(range(129)), 64)[-1] == [64 + i for i in range(64)]


@pytest.fixture(scope="module")
def smollm2_quantized():
    """SmolLM2-135M's GGUF: the unquantized model (its blocks dequantized) and the oracle of
    quant=from_checkpoint (the blocks kept, activations quantized per token as the .pte's)."""
    from pipeline.build.plan import resolve_model
    from pipeline.quant.oracle import with_dequantized_weights

    cfg = resolve_model(compose_config("model=smollm2_135m", "quant=from_checkpoint"), [])
    reference = build_target(cfg.model, None)[0].float().eval()
    model, _ = build_target(cfg.model, None)
    quantize(model, cfg.quant, cfg.model)
    directory, name = os.path.split(cfg.model.checkpoint)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    ids = tokenizer(quality.TEXT)["input_ids"][:384]
    return cfg, reference, with_dequantized_weights(model).eval(), ids


def test_quality_bounds_fail_a_planted_scale_fault(smollm2_quantized):
    """On SmolLM2's first 384 tokens of the fixed text, the quantized oracle (what the .pte computes, up
    to its rounding noise) is within quant=from_checkpoint's bounds; with one layer's 4-bit scales 50%
    off it breaks them. (A 2% error on one layer is inside the activation quantization's own noise:
    docs/design.md, "Weight quantization".)"""
    cfg, reference, oracle, ids = smollm2_quantized
    want, targets = quality.eager_logits(reference, ids)[:-1], torch.tensor(ids[1:])

    def measured():
        return quality.summarize([quality.compare(quality.eager_logits(oracle, ids)[:-1], want, targets)])

    clean = measured()
    assert quality.held(clean, cfg.validate) == [], clean
    weight = oracle.layers[10].feed_forward.w2.inner.weight
    kept = weight.clone()
    weight.mul_(1.5)
    try:
        planted = measured()
    finally:
        weight.copy_(kept)
    broken = quality.held(planted, cfg.validate)
    assert any("validate.max_mean_kld" in b for b in broken), (clean, planted)


def _per_layer(x: torch.Tensor) -> torch.Tensor:
    """An 8-bit KV cache with one scale per layer (for everything a step writes into it), not per token and head."""
    from pipeline.kv.quantize import QMAX

    scale = x.abs().amax() / QMAX
    return (x / scale).round().clamp(-QMAX, QMAX) * scale


def test_kv_cache_bounds_fail_a_per_layer_scale(smollm2_quantized):
    """kv.dtype=int8 with float weights, held by quant=none's bounds (conf/quant/none.yaml): on SmolLM2's
    first 384 tokens of the fixed text, the store's rounding (a scale per token and KV head,
    kv/quantize.py) keeps within them; a scale per layer breaks them."""
    from pipeline.kv.quantize import rounding

    _, reference, _, ids = smollm2_quantized
    bounds = compose_config("kv.dtype=int8").validate  # quant=none: the bounds of the KV cache alone
    want, targets = quality.eager_logits(reference, ids)[:-1], torch.tensor(ids[1:])

    def measured(kv_rounding):
        return quality.summarize([quality.compare(quality.eager_logits(reference, ids, kv_rounding)[:-1], want, targets)])

    clean, planted = measured(rounding("int8")), measured(_per_layer)
    assert quality.held(clean, bounds) == [], clean
    assert 0 < clean["mean_kld"]  # the oracle's cache rounds
    broken = quality.held(planted, bounds)
    assert any("validate.max_mean_kld" in b for b in broken), (clean, planted)


def _truncating(x: torch.Tensor) -> torch.Tensor:
    """Per-token asymmetric 8-bit quantization as torchao's, but rounding toward -inf (a wrong rounding mode)."""
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 255).clamp_min(1e-12)
    zero = -128 - torch.round(lo / scale)
    return (torch.clamp(torch.floor(x / scale) + zero, -128, 127) - zero) * scale


def test_exactness_fails_an_oracle_that_rounds_wrongly(build_dir, monkeypatch):
    """The tiny int8 artifact's episode against its oracle: within the oracle's own noise floor (the
    errors' median and p90); the same with an oracle whose activations' rounding truncates fails. The
    .pte's every-row logits (the quality measure's teacher forcing) equal a step per token's."""
    from pipeline.errors import SessionError
    from pipeline.quant import oracle as quant_oracle
    from pipeline.quant.validation import exactness, noise_floor
    from pipeline.runtime.session import Session
    from pipeline.validation.episode import plan, run_episode

    overrides = (*QUANT_MODEL, "quant=int8", "validate.decode_steps=16", "experiment_name=q_int8")
    version, cfg = build_dir(*overrides), compose_config(*overrides)
    model, _ = build_target(cfg.model, None)
    quantize(model, cfg.quant, cfg.model)

    def failures() -> list[str]:
        oracle = quant_oracle.with_dequantized_weights(model).eval()
        session = Session(version)
        scripts = plan(cfg.validate, session.max_seqs, model.args.vocab_size)
        run_episode(session, oracle, scripts, causal=True)
        floor = noise_floor(oracle, scripts, "range", cfg.validate.noise_copies, cfg.validate.seed)
        return exactness([e for s in scripts for e in s.errors], floor, cfg.validate)[1]

    assert failures() == []
    monkeypatch.setattr(quant_oracle, "_apply_int8_act_asym_per_token_quant_dequant", _truncating)
    wrong = failures()
    assert wrong and "the median relative logit error" in wrong[0], wrong

    session = Session(version)
    window = torch.randint(0, cfg.model.vocab_size, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    rows = quality.pte_logits(session, window)
    session.add("one")
    single = torch.stack([session.step({"one": [t]})["one"] for t in window])
    assert rows.shape == single.shape and float((rows - single).abs().max()) <= 1e-4 * float(single.abs().max())
    with pytest.raises(SessionError, match=f"every row's logits takes at most max_seqs={session.max_seqs} tokens"):
        session.step({"one": window[: session.max_seqs + 1]}, every_row=True)
    assert session.sequence("one").length == len(window)  # refused before anything changed
