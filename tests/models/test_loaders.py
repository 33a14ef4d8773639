"""Real checkpoints through the model seam, against Hugging Face transformers on the same files:
SmolLM2-135M's GGUF, and tiny random Llama / Qwen2 / Qwen3 directories written by transformers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import compose_config, gguf_writer
from pipeline.build.plan import resolve, resolve_model
from pipeline.errors import BuildError, ConfigError
from pipeline.kv.op import ReferenceCache, reference_cache
from pipeline.models.args import model_args
from pipeline.models.families import FAMILIES, family
from pipeline.models.loaders import load_into
from pipeline.models.transformer import build_model

transformers = pytest.importorskip("transformers")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
# fp32 rounding across 30 layers, relative to the logit range; the weights are the same dequantized
# tensors on both sides (gguf's dequantizers), so anything above this is a mismatch, not rounding
BOUND = 1e-4


def relative(got, want) -> float:
    return float((got - want).abs().max() / (want.max() - want.min()))


def ours(cfg, fam=None):
    args = model_args(cfg.model)
    model = build_model(args, cfg.model.seed)
    load_into(model, cfg.model.checkpoint, fam or family(cfg.model.family))
    return model


def our_logits(model, ids):
    with reference_cache(ReferenceCache(model.args.layer_kv())), torch.no_grad():
        return model.logits(model.hidden(model.embed(ids), torch.arange(len(ids))))


def our_greedy(model, ids, n):
    cache, out, pos = ReferenceCache(model.args.layer_kv()), [], 0
    with reference_cache(cache), torch.no_grad():
        step = ids
        for _ in range(n):
            logits = model.logits(model.hidden(model.embed(step), torch.arange(pos, pos + len(step)))[-1:])[0]
            pos += len(step)
            step = logits.argmax().reshape(1)
            out.append(int(step))
    return out


@pytest.fixture(scope="module")
def smollm2():
    cfg = resolve_model(compose_config("model=smollm2_135m"), [])
    resolve(cfg)
    directory, name = os.path.split(cfg.model.checkpoint)
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    return cfg, ours(cfg), hf, tok


def test_smollm2_config_comes_from_the_file(smollm2):
    cfg = smollm2[0]
    got = {k: cfg.model[k] for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim",
                                     "rope_base", "tie_embeddings")}
    assert got == {"vocab_size": 49152, "dim": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "head_dim": 64,
                   "hidden_dim": 1536, "rope_base": 100000.0, "tie_embeddings": True}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_smollm2_logits_and_greedy_match_transformers(smollm2, prompt):
    _, model, hf, tok = smollm2
    ids = tok(prompt, return_tensors="pt").input_ids[0]
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    assert relative(our_logits(model, ids), want) <= BOUND
    seq = ids[None]
    with torch.no_grad():  # transformers' greedy, past end-of-sequence tokens too
        for _ in range(32):
            seq = torch.cat([seq, hf(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert our_greedy(model, ids, 32) == seq[0, len(ids):].tolist()


def test_smollm2_without_undoing_the_qk_permutation_disagrees(smollm2):
    """The parity above can fail: llama.cpp's q/k row order left in place breaks RoPE."""
    cfg, _, hf, tok = smollm2
    unpermuted = type(FAMILIES["llama"])(**{**FAMILIES["llama"].__dict__, "gguf_permutes_qk": False})
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids[0]
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    assert relative(our_logits(ours(cfg, unpermuted), ids), want) > 1e-2


# --- Hugging Face directories written by transformers ---

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False, rope_theta=50000.0),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=False),
}
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def save_tiny(name: str, path: Path, shard: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = getattr(transformers, HF_CLASSES[name])(HF_CONFIGS[name]()).eval()
    with torch.no_grad():  # norms and biases away from their init, so that a dropped one shows
        for p_name, p in model.named_parameters():
            if "norm" in p_name or "bias" in p_name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path, max_shard_size="50KB" if shard else "5GB")
    return model


@pytest.mark.parametrize("name", list(HF_CLASSES))
def test_hf_directory_matches_transformers(tmp_path, name):
    hf = save_tiny(name, tmp_path, shard=name == "llama")
    if name == "llama":
        assert (tmp_path / "model.safetensors.index.json").exists(), "one of them sharded"
    cfg = resolve_model(compose_config(f"+model.checkpoint={tmp_path}"), [])
    resolve(cfg)
    assert cfg.model.family == name and cfg.model.qkv_bias == (name == "qwen2") and cfg.model.qk_norm == (name == "qwen3")
    ids = torch.randint(0, 300, (19,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    assert relative(our_logits(ours(cfg), ids), want) <= 1e-5


# --- bad checkpoints: one line naming the file and the problem ---


def _gguf(path: Path, arch="llama", dtype=None):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(10)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=dtype or np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_reader_opened_once_while_the_file_is_unchanged(tmp_path):
    """A build reads one GGUF in several stages; the reader is parsed once, and again after the
    file is rewritten (its size or mtime changed)."""
    import os

    from pipeline.models.loaders.gguf import _reader

    path = _gguf(tmp_path / "m.gguf")
    first = _reader(path)
    assert _reader(path) is first and _reader(tmp_path / "." / "m.gguf") is first
    _gguf(path, dtype="float16")  # rewritten: other tensor type, other size
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 1))
    second = _reader(path)
    assert second is not first and second.tensors[0].tensor_type.name == "F16"


def _pipeline(tmp_path, *args):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "pipeline", f"output_root={tmp_path / 'out'}", *args],
                          capture_output=True, text=True, env=env, timeout=300, cwd=Path(__file__).parents[2])


def test_bad_checkpoints_refused_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(_gguf(tmp_path / "whole.gguf").read_bytes()[:100])
    cases = [
        (tmp_path / "nope.gguf", "does not exist"),
        (tmp_path / "empty", "no config.json"),
        (_gguf(tmp_path / "gpt2.gguf", arch="gpt2"), "architecture 'gpt2' is not supported"),
        (truncated, "is not a readable GGUF file"),
    ]
    for path, needle in cases:
        proc = _pipeline(tmp_path, f"+model.checkpoint={path}")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"error: model.checkpoint={path}") and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_and_bad_tensors(tmp_path):
    import numpy as np
    from safetensors.torch import load_file, save_file

    cfg = resolve_model(compose_config(f"+model.checkpoint={_gguf(tmp_path / 'f64.gguf', dtype=np.float64)}"), [])
    with pytest.raises(BuildError, match="token_embd.weight is of type F64"):
        ours(cfg)
    save_tiny("llama", tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    cfg = resolve_model(compose_config(f"+model.checkpoint={tmp_path / 'hf'}"), [])
    for change, needle in ((lambda w: w.pop("model.layers.1.mlp.up_proj.weight"), r"missing tensor layers.1.feed_forward.w3.weight"),
                           (lambda w: w.update({"model.norm.weight": torch.ones(65)}), r"norm.weight has shape \(65,\), the model expects \(64,\)")):
        broken = dict(weights)
        change(broken)
        save_file(broken, tmp_path / "hf" / "model.safetensors")
        with pytest.raises(BuildError, match=needle):
            ours(cfg)


def test_override_contradicting_the_checkpoint(tmp_path):
    save_tiny("qwen3", tmp_path)
    with pytest.raises(ConfigError, match=r"model.n_layers=5 contradicts model.checkpoint=.*which has n_layers=2"):
        resolve_model(compose_config(f"+model.checkpoint={tmp_path}", "model.n_layers=5"),
                        [f"+model.checkpoint={tmp_path}", "model.n_layers=5"])
    proc = _pipeline(tmp_path, f"model.checkpoint={tmp_path}", "model.family=llama")
    assert proc.returncode == 2 and "model.family=llama contradicts" in proc.stderr and "family=qwen3" in proc.stderr


def test_checkpoint_hash_is_in_the_stage_keys(tmp_path):
    """The export's key holds the checkpoint's content: a changed file is a different key."""
    from pipeline.cache import stage_keys
    from pipeline.stages import check_order

    save_tiny("qwen2", tmp_path)
    cfg = resolve_model(compose_config(f"+model.checkpoint={tmp_path}"), [])
    plan = check_order(["export"])
    before = stage_keys(cfg, plan)["export"]
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "note": 1}))
    after = stage_keys(cfg, plan)["export"]
    assert after["parts"]["files"]["model.checkpoint"] != before["parts"]["files"]["model.checkpoint"]
    assert after["digest"] != before["digest"]


def test_artifact_from_a_checkpoint_matches_transformers(tmp_path):
    """A Qwen3 directory -> a validated .pte; its logits through the session equal transformers'."""
    from pipeline.build.runner import build
    from pipeline.runtime.session import Session

    hf = save_tiny("qwen3", tmp_path / "qwen3")
    overrides = [f"+model.checkpoint={tmp_path / 'qwen3'}", "backend=portable", "kv.max_seqs=2", "kv.capacity=96",
                 f"output_root={tmp_path / 'out'}"]
    version = build(compose_config(*overrides), overrides)
    assert json.loads((version / "validation.json").read_text())["passed"]
    recorded = (version / ".hydra" / "config.yaml").read_text()
    assert "head_dim: 24" in recorded and "qk_norm: true" in recorded and "family: qwen3" in recorded
    session = Session(version)
    gen = torch.Generator().manual_seed(7)
    prompts = {"a": torch.randint(0, 300, (11,), generator=gen).tolist(), "b": torch.randint(0, 300, (5,), generator=gen).tolist()}
    for seq_id in prompts:
        session.add(seq_id)
    got = session.step(prompts)
    for seq_id, ids in prompts.items():
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -1]
        assert relative(got[seq_id], want) <= 1e-5


def test_session_generates_text_for_four_prompts_at_once(tmp_path, smollm2):
    """A checkpoint with SmolLM2's tokenizer (a tiny random Llama over its vocabulary) and a DFlash draft:
    the artifact carries the tokenizer, and four text prompts decoded together, plainly and
    speculatively, equal transformers' greedy text."""
    from pipeline.build.runner import build
    from pipeline.runtime.session import Session

    tok = smollm2[3]
    torch.manual_seed(1)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": len(tok)}, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    overrides = [f"+model.checkpoint={tmp_path / 'ckpt'}", "backend=portable", "kv.max_seqs=4", "draft=dflash",
                 "draft.target_layer_ids=[1]", f"output_root={tmp_path / 'out'}"]
    version = build(compose_config(*overrides), overrides)
    assert json.loads((version / "manifest.json").read_text())["tokenizer"] == "tokenizer"
    report = json.loads((version / "validation.json").read_text())  # the episode ran on text prompts
    assert report["passed"] and report["text"]["seq0"]["prompt"] == "The capital of France is"
    assert report["text"]["seq1"]["prompt"] == "def fibonacci(n):" and len(report["text"]["seq1"]["continuation"]) > 0
    # a chat model's tokenizer: each prompt went in as a user's message through its chat template
    templated = tok.apply_chat_template([{"role": "user", "content": "The capital of France is"}], tokenize=False,
                                        add_generation_prompt=True)
    assert report["chat_template"] is True and "<|im_start|>user" in templated
    assert report["scenario"]["sequences"][0]["prompt_tokens"] == len(tok(templated, add_special_tokens=False).input_ids)
    prompts = {f"p{i}": text for i, text in enumerate(PROMPTS + ["Hello"])}
    session = Session(version)
    got = session.generate(prompts, max_new_tokens=12, stop_at_eos=False, speculative=False)
    assert session.generate(prompts, max_new_tokens=12, stop_at_eos=False) == got  # speculative: the same text
    for seq_id, text in prompts.items():
        seq = tok(text, return_tensors="pt").input_ids
        n = seq.shape[1]
        with torch.no_grad():
            for _ in range(12):
                seq = torch.cat([seq, hf(seq).logits[:, -1:].argmax(-1)], dim=1)
        assert got[seq_id] == tok.decode(seq[0, n:], skip_special_tokens=True)


# --- GGUF files in every tensor type the loader is held to (F32 ... Q4_1, Q4_K, Q6_K) ---

# max |dequantized - original| relative to max |original|: the rounding of each format
GGUF_TYPES = {"F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2, "Q4_1": 1e-1, "Q4_0": 1.5e-1,
              "Q6_K": 3e-2, "Q4_K": 8e-2}


def quantize_k(values, qtype: str):
    """Q4_K or Q6_K blocks of float rows (length a multiple of 256), packed as ggml lays them out.

    The gguf package dequantizes K-quants but cannot quantize them; this plain round-to-nearest
    quantizer (no search for the best scales, unlike llama.cpp's) writes the bytes from ggml's block
    layout (ggml-common.h: block_q4_K, block_q6_K) so that the loader's reading of them, through the
    package's dequantizers, is tested against the original floats. A wrong packing here would show
    as errors near the weights' magnitude, far above the bounds of GGUF_TYPES."""
    import numpy as np

    rows = values.reshape(-1, 256).astype(np.float32)
    n = rows.shape[0]
    if qtype == "Q6_K":  # 16 sub-blocks of 16: x = d * scale[j] * (q - 32), q in [0, 64)
        sub = rows.reshape(n, 16, 16)
        sub_scale = np.abs(sub).max(-1) / 31
        d = np.maximum(np.abs(sub_scale).max(-1), 1e-12) / 127
        d16 = d.astype(np.float16)
        scales = np.clip(np.round(sub_scale / d16.astype(np.float32)[:, None]), -128, 127).astype(np.int8)
        step = d16.astype(np.float32)[:, None, None] * scales[..., None]
        q = np.clip(np.round(sub / np.where(step == 0, 1, step)) + 32, 0, 63).astype(np.uint8).reshape(n, 256)
        low, high = (q & 0xF).reshape(n, 2, 2, 64), (q >> 4).reshape(n, 2, 4, 32)
        ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
        qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
        blocks = [ql, qh, scales.view(np.uint8), d16.reshape(n, 1).view(np.uint8)]
    else:  # Q4_K: 8 sub-blocks of 32: x = d * sc[j] * q - dmin * m[j], q in [0, 16), 6-bit sc and m
        sub = rows.reshape(n, 8, 32)
        low = np.minimum(sub.min(-1), 0)
        sub_scale, offset = (sub.max(-1) - low) / 15, -low
        d = (np.maximum(sub_scale.max(-1), 1e-12) / 63).astype(np.float16)
        dmin = (np.maximum(offset.max(-1), 1e-12) / 63).astype(np.float16)
        sc = np.clip(np.round(sub_scale / d.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
        m = np.clip(np.round(offset / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
        step = d.astype(np.float32)[:, None, None] * sc[..., None]
        shifted = sub + dmin.astype(np.float32)[:, None, None] * m[..., None]
        q = np.clip(np.round(shifted / np.where(step == 0, 1, step)), 0, 15).astype(np.uint8).reshape(n, 4, 2, 32)
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
        packed = np.concatenate([  # bytes 0-3: sc[0:4] + top bits of sc[4:8]; 4-7: the same for m; 8-11: low nibbles
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6), (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=1)
        blocks = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), packed, qs]
    return np.concatenate(blocks, axis=1).reshape(*values.shape[:-1], -1)


def write_llama_gguf(path: Path, model, qtype: str, types: dict[str, str] | None = None) -> None:
    """Our model as llama.cpp's converter writes it: its names, q/k rows permuted, one tensor type
    (``types``: another for some of our tensor names)."""
    import gguf
    import numpy as np

    from pipeline.models.loaders.gguf import NAMES

    a = model.args
    w = gguf_writer(path, "llama", n_layers=a.n_layers, dim=a.dim, hidden_dim=a.hidden_dim, n_heads=a.n_heads,
                    n_kv_heads=a.n_kv_heads, norm_eps=a.norm_eps, rope_base=a.rope_base, vocab_size=a.vocab_size)
    ours_to_gguf = {}
    for pattern, ours in NAMES:
        for i in range(a.n_layers):
            gguf_name = pattern.replace(r"(\d+)", str(i)).replace(r"(weight|bias)", "weight").replace("\\", "")
            ours_to_gguf[ours.format(i, "weight") if "{}" in ours else ours] = gguf_name
    for name, tensor in model.state_dict().items():
        qt = gguf.GGMLQuantizationType[(types or {}).get(name, qtype)]
        values = tensor.numpy()
        if name.endswith(("wq.weight", "wk.weight")):  # llama.cpp's permute: halves -> adjacent pairs
            heads = a.n_heads if name.endswith("wq.weight") else a.n_kv_heads
            values = values.reshape(heads, 2, values.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(values.shape)
        kind = qt if values.ndim == 2 else gguf.GGMLQuantizationType.F32  # norms stay F32, as llama.cpp keeps them
        values = np.ascontiguousarray(values, dtype=np.float32)
        data = quantize_k(values, kind.name) if kind.name in ("Q4_K", "Q6_K") else gguf.quants.quantize(values, kind)
        w.add_tensor(ours_to_gguf[name], data, raw_shape=data.shape if kind == gguf.GGMLQuantizationType.F32 else None,
                     raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_gguf_tensor_types_round_trip(tmp_path, qtype):
    dim = 256 if qtype.endswith("_K") else 64  # K-quant rows are whole super-blocks of 256
    args = model_args(compose_config("model=tiny_flat", "model.hidden_dim=256", f"model.dim={dim}").model)
    source = build_model(args, 3)
    write_llama_gguf(tmp_path / f"tiny-{qtype}.gguf", source, qtype)
    cfg = resolve_model(compose_config(f"+model.checkpoint={tmp_path / f'tiny-{qtype}.gguf'}"), [])
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.tie_embeddings) == (dim, 2, False)
    loaded = ours(cfg)
    for name, want in source.state_dict().items():
        got = loaded.state_dict()[name]
        assert float((got - want).abs().max()) <= GGUF_TYPES[qtype] * float(want.abs().max()), (qtype, name)
    if qtype == "F32":  # exact weights: the same logits, so the q/k permutation was undone
        ids = torch.arange(9)
        assert relative(our_logits(loaded, ids), our_logits(source, ids)) <= 1e-6


@pytest.mark.slow
def test_smollm2_artifact_matches_transformers(smollm2, tmp_path):
    """The SmolLM2 .pte (kv.max_seqs=4) against transformers: prompt logits and 32 greedy tokens,
    one sequence alone and the same prompts as four sequences of one batch. Building takes about
    13 minutes here: SMOLLM2_ARTIFACT=<version dir> reuses a build of model=smollm2_135m kv.max_seqs=4."""
    from pipeline.build.runner import build
    from pipeline.runtime.session import Session

    _, _, hf, tok = smollm2
    version = os.environ.get("SMOLLM2_ARTIFACT")
    if not version:
        overrides = ["model=smollm2_135m", "kv.max_seqs=4", "stages=[export,lower_kv,compile]", f"output_root={tmp_path}"]
        version = build(compose_config(*overrides), overrides)
    session = Session(version)
    assert session.max_seqs == 4
    prompts = {f"p{i}": p for i, p in enumerate(PROMPTS + ["The three primary colors are"])}
    want = {}
    for seq_id, text in prompts.items():
        seq = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            first = hf(seq).logits[0, -1]
            n = seq.shape[1]
            for _ in range(32):
                seq = torch.cat([seq, hf(seq).logits[:, -1:].argmax(-1)], dim=1)
        want[seq_id] = (first, seq[0, n:].tolist())
    for group in ([["p0"]], [list(prompts)]):  # solo, then all four in one batch
        for ids in group:
            for seq_id in ids:
                session.add(seq_id)
            logits = {s: session.step({s: tok(prompts[s]).input_ids})[s] for s in ids}  # prefills, then decodes together
            for seq_id in ids:
                assert relative(logits[seq_id], want[seq_id][0]) <= BOUND
            tokens = {s: [int(logits[s].argmax())] for s in ids}
            for _ in range(31):
                step = session.step({s: tokens[s][-1:] for s in ids})
                for s in ids:
                    tokens[s].append(int(step[s].argmax()))
            for seq_id in ids:
                assert tokens[seq_id] == want[seq_id][1], seq_id
                session.release(seq_id)
    text = session.generate(prompts, max_new_tokens=32, stop_at_eos=False)
    assert text["p0"] == tok.decode(want["p0"][1], skip_special_tokens=True)
