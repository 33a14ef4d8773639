"""Quantized artifacts (pipeline/quant): each scheme's .pte against the eager model quantized the same
way, a GGUF's blocks kept without a float round trip, and the report the build records."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import compose_config
from pipeline.build.plan import resolve_model
from pipeline.kv.op import ReferenceCache, reference_cache
from pipeline.models.args import model_args
from pipeline.models.methods import build_target
from pipeline.models.transformer import build_model
from pipeline.quant.apply import dequantized, quantize
from test_loaders import write_llama_gguf

# tiny_flat with a feed-forward width that is a multiple of 32 (XNNPACK's 4-bit groups)
QUANT_MODEL = ("model=tiny_flat", "model.hidden_dim=192")
SCHEMES = {"int8": ("quant=int8",), "int4": ("quant=int4",)}
# the max error a shallow model's .pte shows against its quantized oracle on one prompt (measured here:
# 3.2e-3 and 5.1e-3); a deep one's is the activation rounding's noise (validate holds its distribution)
SHALLOW_BOUND = {"int8": 1e-2, "int4": 2e-2}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / (want.max() - want.min()))


def _eager_logits(model, prompt: list[int]) -> torch.Tensor:
    with reference_cache(ReferenceCache(model.args.layer_kv(), causal=True)), torch.no_grad():
        hidden = model.hidden(model.embed(torch.tensor(prompt)), torch.arange(len(prompt)))
        return model.logits(hidden)[-1]


@pytest.fixture(scope="module")
def quantized_build(build_dir):
    def _build(scheme: str):
        overrides = (*QUANT_MODEL, *SCHEMES[scheme], "validate.decode_steps=16", f"experiment_name=q_{scheme}")
        return build_dir(*overrides), compose_config(*overrides)

    return _build


@pytest.mark.parametrize("scheme", SCHEMES)
def test_scheme_artifact_matches_the_quantized_eager_model(quantized_build, scheme):
    """The .pte (XNNPACK's quantized kernels) against the eager model quantized the same way (torchao's
    reference), on a fresh prompt: within a shallow model's bound, while the unquantized model is further away
    than that bound (so the bound tells the two apart), and the build's validation agrees: its errors'
    median and p90 within its noise floor's, the quality measured on seeded tokens within the scheme's bounds."""
    from pipeline.runtime.session import Session

    version, cfg = quantized_build(scheme)
    eager, _ = build_target(cfg.model, None)
    float_model, _ = build_target(cfg.model, None)
    report = quantize(eager, cfg.quant, cfg.model)
    prompt = torch.randint(0, cfg.model.vocab_size, (13,), generator=torch.Generator().manual_seed(7)).tolist()
    session = Session(version)
    session.add("a")
    got = session.step({"a": prompt})["a"]
    error = _relative(got, _eager_logits(eager, prompt))
    assert error <= SHALLOW_BOUND[scheme], (scheme, error)
    if scheme == "int4":  # 4-bit weights move the logits far more than the bound
        assert _relative(got, _eager_logits(float_model, prompt)) > SHALLOW_BOUND[scheme]

    validation = json.loads((version / "validation.json").read_text())
    assert validation["passed"] and validation["tolerance"] is None
    q = validation["quant"]
    assert q["greedy_agreement_with_oracle"] >= 0.9  # greedy tokens are the quantized eager model's, but for near ties
    exact = q["exactness"]
    assert all(exact["pte_vs_oracle"][k] <= exact["bounds"][k] for k in ("median", "p90"))
    assert exact["oracle_vs_perturbed_oracle"]["count"] == cfg.validate.noise_copies * exact["pte_vs_oracle"]["count"]
    quality = q["quality"]
    assert "seeded random tokens" in quality["text"] and quality["tokens_scored"] > 0.9 * cfg.validate.quality_tokens
    assert 0 < quality["mean_kld"] <= cfg.validate.max_mean_kld and quality["top1_agreement"] >= cfg.validate.min_top1_agreement
    assert 0 < q["episode_against_unquantized"]["max_relative_error"]

    # a fresh process serves it (the quantized embedding's kernels register when the session loads)
    code = ("import sys; from pipeline.runtime.session import Session; s = Session(sys.argv[1]); s.add('a'); "
            "print(int(s.step({'a': [1, 2, 3]})['a'].argmax()))")
    proc = subprocess.run([sys.executable, "-c", code, str(version)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().isdigit(), proc.stderr[-2000:]

    record = json.loads((version / "build.json").read_text())["quant"]
    manifest = json.loads((version / "manifest.json").read_text())["quant"]
    assert record == manifest == json.loads(json.dumps(report))  # the same report, recomputed here
    assert record["scheme"] == scheme and record["group_size"] == cfg.quant.group_size
    # every linear (the 2 layers' 7, the untied head) and the embedding
    assert len(record["tensors"]) == 2 * 7 + 2 and "tok_embeddings" in record["tensors"]
    if scheme == "int4":  # the head in 8 bits per channel (quant.head_bits), the rest in the groups
        assert record["tensors"]["output"]["format"] == "int8 per channel (8da8w; quant.head_bits=8)"
        assert record["tensors"]["layers.0.attention.wq"]["format"] == "int4 g32, no_clipping scales as bf16 (8da4w)"
    assert all(t["relative_rms_error"] > 0 for t in record["tensors"].values())


@pytest.mark.parametrize("scheme,bound", [("int8", 1e-6), ("int4", 1e-6), ("from_checkpoint", 1e-5)])
def test_one_quantized_linear_matches_torchao(tmp_path, scheme, bound):
    """One linear of the quantized model through XNNPACK against torchao's reference on the layer's own
    activations: both to fp32 rounding (int4 because the oracle's scales are bfloat16, as XNNPACK
    stores them: with float32 scales this is 1.0e-3). from_checkpoint: a GGUF's Q4_1 linear
    (``OffsetLinear``: the 4-bit groups with the int8 activations, plus the float offset term), the
    oracle's arithmetic held where it can be: on SmolLM2's own layers 1.3e-7 to 2.5e-6. (Through 30
    layers the dynamic int8 activations turn fp32 rounding into integer flips, so the whole model's
    logits differ by ~0.08 of their range between any two fp32 orders of the same arithmetic,
    design.md "Quantization".)"""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
    from torch import nn

    from pipeline.quant.gguf import OffsetLinear

    cfg = _gguf_config(tmp_path, "Q4_1")[0] if scheme == "from_checkpoint" else compose_config(*QUANT_MODEL, *SCHEMES[scheme])
    model, _ = build_target(cfg.model, None)
    captured = {}

    def keep_input(module, inputs, output):  # returns None: the output stands
        captured.setdefault("x", inputs[0][0].clone())

    quantize(model, cfg.quant, cfg.model)
    assert isinstance(model.layers[1].feed_forward.w2, OffsetLinear) == (scheme == "from_checkpoint")
    model.layers[1].feed_forward.w2.register_forward_hook(keep_input)
    _eager_logits(model, list(range(40, 60)))
    x, linear = captured["x"], nn.Sequential(model.layers[1].feed_forward.w2)
    buffer = to_edge_transform_and_lower(torch.export.export(linear, (x,)), partitioner=[XnnpackPartitioner()]).to_executorch().buffer
    got = Runtime.get().load_program(buffer).load_method("forward").execute([x])[0]  # (buffer held: the program reads it)
    with torch.no_grad():
        want = linear(x)
    assert _relative(got, want) <= bound, _relative(got, want)


# --- quant=from_checkpoint: a GGUF's blocks -------------------------------------------------------


@pytest.mark.parametrize("scheme", ["int8", "int4", "from_checkpoint"])
def test_oracle_with_dequantized_weights_is_the_same_model(tmp_path, scheme):
    """validate's quantized oracle (``with_dequantized_weights``: weights and embedding tables
    dequantized once) computes the quantized eager model's logits bit for bit, prompt and decodes:
    torchao's linears (8- and 4-bit, the head among them), the quantized embedding, GGUF Q4_1 offsets."""
    from pipeline.quant.oracle import DequantizedEmbedding, DequantizedLinear, with_dequantized_weights

    if scheme == "from_checkpoint":
        cfg, _ = _gguf_config(tmp_path, "Q4_1", "Q8_0")
    else:
        cfg = compose_config(*QUANT_MODEL, f"quant={scheme}", "quant.embedding=true")
    model, _ = build_target(cfg.model, None)
    quantize(model, cfg.quant, cfg.model)
    fast = with_dequantized_weights(model)
    kinds = {type(m) for m in fast.modules()}
    assert DequantizedLinear in kinds and DequantizedEmbedding in kinds
    assert not any(isinstance(m, (DequantizedLinear, DequantizedEmbedding)) for m in model.modules())  # a copy
    prompt = torch.randint(0, cfg.model.vocab_size, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = []
    for m in (model, fast):
        cache, out = ReferenceCache(m.args.layer_kv(), causal=True), []
        with reference_cache(cache), torch.no_grad():
            toks, start = prompt, 0
            for _ in range(4):
                out.append(m.logits(m.hidden(m.embed(torch.tensor(toks)), torch.arange(start, start + len(toks)))))
                start += len(toks)
                toks = [int(out[-1][-1].argmax())]
        logits.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*logits, strict=True))


def _gguf_config(tmp_path, qtype: str, embedding: str | None = None):
    args = model_args(compose_config(*QUANT_MODEL).model)
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_llama_gguf(path, build_model(args, 3), qtype, {"tok_embeddings.weight": embedding} if embedding else None)
    return resolve_model(compose_config(f"+model.checkpoint={path}", "quant=from_checkpoint"), []), path


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_1"])
def test_gguf_blocks_kept_without_a_float_round_trip(tmp_path, qtype):
    """Each mapped tensor against llama.cpp's dequantization of the same file (the loader's weights, by
    the gguf package): bit for bit for the embedding rows (Q4_0 and Q8_0: their ops take float32 scales); for the 4-bit
    groups the integers are llama.cpp's and each scale is llama.cpp's float16 ``d`` rounded to
    bfloat16, as XNNPACK stores it, so every weight is within 2^-8 of its own value (an integer off by
    one would be off by ``d``, a zero weight must stay zero); for Q4_1 the offset term ``m + 8 d`` adds
    one float32 rounding."""
    from pipeline.quant.gguf import OffsetLinear

    cfg, _ = _gguf_config(tmp_path, qtype)
    model, _ = build_target(cfg.model, None)  # llama.cpp's dequantized weights
    want = {name: m.weight.detach().clone() for name, m in model.named_modules() if hasattr(m, "weight")
            and m.weight is not None and m.weight.ndim == 2}
    want["output"] = want["output"] if "output" in want else want["tok_embeddings"]
    report = quantize(model, cfg.quant, cfg.model)
    for name, stats in report["tensors"].items():
        got = dequantized(model, name)
        if qtype in ("Q4_0", "Q8_0") and name == "tok_embeddings":  # the embedding ops take float32 scales
            assert "kept" in stats["format"] and torch.equal(got, want[name]), (name, stats)
            assert stats["bit_exact"]
        elif qtype == "Q4_0":
            w = model.get_submodule(name).weight
            assert "kept" in stats["format"] and torch.equal(w.scale, w.scale.bfloat16().float())
            assert bool(((got - want[name]).abs() <= 2.0 ** -8 * want[name].abs()).all()), (name, stats)
        elif qtype == "Q4_1" and name != "tok_embeddings":
            module = model.get_submodule(name)
            assert isinstance(module, OffsetLinear)
            w = module.inner.weight
            assert w.qdata.min() >= -8 and w.qdata.max() <= 7 and torch.equal(w.scale, w.scale.bfloat16().float())
            # |q - 8| |d - bf16(d)| <= 8 * 2^-8 |d| < 1.01 * 2^-5 |bf16(d)|, plus the float32 rounding of m + 8 d
            bound = 1.01 * 2.0 ** -5 * w.scale.abs().repeat_interleave(32, dim=1) + 4 * torch.finfo(torch.float32).eps * want[name].abs().max()
            assert bool(((got - want[name]).abs() <= bound).all()), (name, stats)
        elif qtype == "Q8_0":  # a Q8_0 linear: requantized per channel (XNNPACK has no 8-bit groups)
            assert "requantized" in stats["format"] and not stats["bit_exact"]
            assert stats["relative_rms_error"] < 1e-2
    if qtype == "Q4_1":  # no exact 4-bit embedding with offsets: the embedding stays float
        assert "dequantized" in report["tensors"]["tok_embeddings"]["format"]


def test_gguf_block_comparison_can_fail(tmp_path, monkeypatch):
    """The check above (each weight within 2^-8 of llama.cpp's) catches a wrong nibble order (columns j and
    j + 16 swapped)."""
    from pipeline.quant import gguf as quant_gguf

    real = quant_gguf.blocks

    def swapped(tensor):
        b = real(tensor)
        if b["kind"] == "Q4_0":
            q = b["q"].reshape(b["q"].shape[0], -1, 2, 16)
            b["q"] = np.ascontiguousarray(q[:, :, ::-1]).reshape(b["q"].shape)
        return b

    cfg, _ = _gguf_config(tmp_path, "Q4_0")
    model, _ = build_target(cfg.model, None)
    want = model.layers[0].feed_forward.w2.weight.detach().clone()
    monkeypatch.setattr(quant_gguf, "blocks", swapped)
    quantize(model, cfg.quant, cfg.model)
    got = dequantized(model, "layers.0.feed_forward.w2")
    assert not bool(((got - want).abs() <= 2.0 ** -8 * want.abs()).all())


def test_from_checkpoint_artifact(build_dir, tmp_path_factory):
    """A GGUF as SmolLM2's is written (Q4_1 linears, a Q8_0 embedding and tied head) built with its
    blocks kept: the .pte validates against the quantized eager model."""
    tmp = tmp_path_factory.mktemp("gguf")
    args = model_args(compose_config(*QUANT_MODEL, "model.tie_embeddings=true").model)
    path = tmp / "tiny-q41.gguf"
    write_llama_gguf(path, build_model(args, 3), "Q4_1", {"tok_embeddings.weight": "Q8_0"})
    version = build_dir(f"+model.checkpoint={path}", "quant=from_checkpoint", "validate.decode_steps=16",
                        "experiment_name=q_gguf")
    validation = json.loads((version / "validation.json").read_text())
    assert validation["passed"] and validation["quant"]["greedy_agreement_with_oracle"] >= 0.9
    tensors = json.loads((version / "build.json").read_text())["quant"]["tensors"]
    assert tensors["tok_embeddings"]["bit_exact"] and "Q8_0 blocks kept" in tensors["tok_embeddings"]["format"]
    assert "requantized" in tensors["output"]["format"]  # the tied head: XNNPACK has no 8-bit groups
    assert all("Q4_1 blocks kept" in t["format"] for n, t in tensors.items() if n.startswith("layers."))


def test_from_checkpoint_refuses_an_unquantized_gguf(tmp_path):
    from pipeline.build.runner import build
    from pipeline.errors import ConfigError

    cfg, path = _gguf_config(tmp_path, "F32")
    cfg.output_root = str(tmp_path / "out")
    with pytest.raises(ConfigError, match=f"model.checkpoint={path} is not quantized .*F32.*quant=int8"):
        build(cfg, [f"+model.checkpoint={path}", "quant=from_checkpoint"])
    assert not (tmp_path / "out").exists()


def test_from_checkpoint_keeps_the_draft_in_float(tmp_path):
    """A GGUF's blocks with a draft: built (the draft's linears in float); ``quant.draft`` is refused, the
    GGUF holding none of the draft's weights."""
    from pipeline.build.plan import resolve
    from pipeline.errors import ConfigError

    _, path = _gguf_config(tmp_path, "Q4_0")
    overrides = [f"+model.checkpoint={path}", "quant=from_checkpoint", "draft=dflash", "draft.target_layer_ids=[0,1]"]
    resolve(resolve_model(compose_config(*overrides), overrides))
    overrides.append("quant.draft=true")
    with pytest.raises(ConfigError, match="quant.draft=true with quant=from_checkpoint: the GGUF holds the target's blocks"):
        resolve(resolve_model(compose_config(*overrides), overrides))


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "measured: the int4 SmolLM2 is chaotic under its dynamic activation rounding: multiplying the eager "
    "model's input embeddings by 1 + 1e-7 * noise moves its logits by 8e-2 of their range and changes 10% "
    "of greedy tokens, and the .pte (whose linears match the oracle to 1e-7) differs by 1.1e-1; a 32-token "
    "free-running continuation leaves the oracle's within a few tokens (docs/design.md, Weight quantization)"))
def test_smollm2_int4_eight_prompts_match_the_quantized_eager_model(tmp_path):
    """``model=smollm2_135m quant=int4 kv.max_seqs=8``: built and validated; the session decodes 8 text
    prompts at once, and the first 32 greedy tokens of 3 of them equal the quantized eager model's
    (plain greedy decoding, one sequence alone). About 20 minutes to build here:
    SMOLLM2_INT4_ARTIFACT=<version dir> reuses a build of that command."""
    import os

    from pipeline.build.runner import build
    from pipeline.runtime.session import Session
    from pipeline.runtime.speculative import greedy_generate

    overrides = ["model=smollm2_135m", "quant=int4", "kv=sequence", "kv.max_seqs=8"]
    version = os.environ.get("SMOLLM2_INT4_ARTIFACT") or build(compose_config(*overrides, f"output_root={tmp_path}"),
                                                               overrides)
    assert json.loads((Path(version) / "validation.json").read_text())["passed"]
    session = Session(version)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "The three primary colors are", "Water boils at", "My favourite book is", "import numpy as np",
               "The quick brown fox"]
    got = session.generate({i: p for i, p in enumerate(prompts)}, max_new_tokens=32, stop_at_eos=False)
    assert len(got) == 8 and all(got.values())  # eight at once: this part holds
    cfg = resolve_model(compose_config(*overrides), overrides)
    eager, _ = build_target(cfg.model, None)
    quantize(eager, cfg.quant, cfg.model)
    tok = session.tokenizer
    for i in range(3):
        want = greedy_generate(eager, tok(prompts[i]).input_ids, 32)
        assert got[i] == tok.decode(want, skip_special_tokens=True), (prompts[i], got[i])


# a 4-bit target with a DFlash draft whose own linears are 4-bit too (quant.draft): every width a multiple of 32
QUANT_DRAFT = (*QUANT_MODEL, "draft=dflash", "draft.target_layer_ids=[0,1]", "draft.hidden_dim=192", *SCHEMES["int4"],
               "quant.draft=true", "kv.max_seqs=2", "validate.decode_steps=16", "experiment_name=q_draft")


@pytest.fixture(scope="module")
def quantized_draft(build_dir):
    return build_dir(*QUANT_DRAFT)


def _eager_quantized(cfg):
    """The export's eager models: the target and the draft quantized as ``cfg`` says."""
    from pipeline.models.methods import build_draft_model
    from pipeline.quant.apply import quantize_draft

    target, _ = build_target(cfg.model, None)
    quantize(target, cfg.quant, cfg.model)
    draft = build_draft_model(cfg.draft, target.args)
    quantize_draft(draft, cfg.quant)
    return target, draft


def _session_decode(session, prompt: list[int], n: int, speculate: bool = False, propose=None) -> tuple[list[int], list[int]]:
    """``n`` greedy tokens after ``prompt`` (prefilled in chunks) through the .pte: one step per token,
    or speculative rounds (``propose(have, proposals)``: replace the draft's); and the tokens each round gave."""
    session.add("x")
    for i in range(0, len(prompt), session.max_step_tokens):
        logits = session.step({"x": prompt[i: i + session.max_step_tokens]})["x"]
    out = [int(logits.argmax())]
    while len(out) < n:
        if speculate:
            out += session.speculate({"x": out[-1]}, propose=(lambda _, p: propose(len(out), p)) if propose else None)["x"].tokens
        else:
            out.append(int(session.step({"x": [out[-1]]})["x"].argmax()))
    acceptance = session.acceptance.get("x", [])
    session.release("x")
    return out[:n], acceptance


def test_quantized_target_with_a_draft(quantized_draft):
    """A 4-bit target with a draft (its linears 4-bit too) builds and validates: the target's and the draft's
    logits against the eager models quantized the same way, every round's tokens the .pte target's greedy
    choice, the scheme's cost against the unquantized target. Through the .pte, speculative decoding gives
    the quantized target's plain greedy output, with the draft's proposals, with the target's own (whole
    blocks accepted) and with a wrong one in each block; that output agrees with the quantized eager
    model's greedy choice on the same tokens but for near ties."""
    from pipeline.kv.op import ReferenceCache, reference_cache
    from pipeline.runtime.session import Session

    cfg = compose_config(*QUANT_DRAFT)
    validation = json.loads((quantized_draft / "validation.json").read_text())
    assert validation["passed"] and validation["tolerance"] is None
    spec, q = validation["speculative"], validation["quant"]
    assert spec["follows_target_greedy"] and spec["rounds_off_target_greedy"] == {}
    assert 0 < spec["draft_max_relative_error"] <= cfg.validate.quant_tolerance
    assert validation["scenario"]["speculative_rounds"] > 10
    assert q["greedy_agreement_with_oracle"] >= 0.9
    assert q["quality"]["top1_agreement"] >= cfg.validate.min_top1_agreement
    report = json.loads((quantized_draft / "manifest.json").read_text())["quant"]
    assert report["scheme"] == "int4" and len(report["tensors"]) == 2 * 7 + 2  # the target's, as without a draft
    assert set(report["draft"]["tensors"]) == {"fc"} | {f"layers.0.{n}" for n in (
        "attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
        "feed_forward.w3")}
    assert all(t["format"] == "int4 g32, no_clipping scales as bf16 (8da4w)" for t in report["draft"]["tensors"].values())

    session, n = Session(quantized_draft), 24
    eager, _ = _eager_quantized(cfg)
    gen = torch.Generator().manual_seed(11)
    agree = []
    for length in (5, 21):
        prompt = torch.randint(0, cfg.model.vocab_size, (length,), generator=gen).tolist()
        greedy, _ = _session_decode(session, prompt, n)
        assert len(set(greedy)) > 5, "the continuation varies"
        assert _session_decode(session, prompt, n, speculate=True)[0] == greedy
        oracle = lambda have, p: (greedy + [0] * 8)[have: have + len(p)]  # noqa: E731
        tokens, acceptance = _session_decode(session, prompt, n, speculate=True, propose=oracle)
        assert tokens == greedy and acceptance[:2] == [8, 8]  # whole blocks: 7 proposals and the target's token
        wrong = lambda have, p: [t if i != 2 else (t + 1) % 512 for i, t in enumerate(oracle(have, p))]  # noqa: E731
        tokens, acceptance = _session_decode(session, prompt, n, speculate=True, propose=wrong)
        assert tokens == greedy and acceptance[:2] == [3, 3]  # proposals 0 and 1, then the target's token
        tokens = prompt + greedy
        with reference_cache(ReferenceCache(eager.args.layer_kv())), torch.no_grad():
            want = eager.logits(eager.hidden(eager.embed(torch.tensor(tokens)), torch.arange(len(tokens))))
        agree += (want[len(prompt) - 1: -1].argmax(-1) == torch.tensor(greedy)).tolist()
    assert sum(agree) / len(agree) >= 0.9, agree


def test_quantized_speculative_validation_fails_on_a_broken_round(quantized_draft, tmp_path, monkeypatch):
    """A session whose rounds keep a token the target did not choose (the bonus token off by one) fails
    validation, though every logit still matches the oracle's on the tokens it was fed."""
    from pipeline.build.plan import plan_of
    from pipeline.build.roles import DRAFT, TARGET
    from pipeline.runtime.session import Session
    from pipeline.stages import validate

    speculate = Session.speculate

    def broken(self, feeds, *args, **kwargs):
        rounds = speculate(self, feeds, *args, **kwargs)
        for r in rounds.values():
            r.tokens[-1] = (r.tokens[-1] + 1) % 512
        return rounds

    cfg = compose_config(*QUANT_DRAFT)
    target, draft = _eager_quantized(cfg)
    for name in ("model.pte", "manifest.json"):
        (tmp_path / name).write_bytes((quantized_draft / name).read_bytes())
    monkeypatch.setattr(Session, "speculate", broken)
    with pytest.raises(validate.ValidationFailed, match="is not the target's greedy output: .* rounds kept tokens"):
        validate.run(plan_of(cfg), {"models": {TARGET: target, DRAFT: draft}}, tmp_path)
