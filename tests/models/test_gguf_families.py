"""GGUF files of every family (written as llama.cpp's converter writes them: ``gguf_families.py``) through our
reader: the logits of our Transformer equal transformers' own loading of the same file (where transformers
loads the architecture) and the model the file was made from; each comparison is shown failing on a planted
error, and a broken file is refused in one line naming it and what is wrong."""

import os
from pathlib import Path

import pytest
import torch
from gguf_families import CONFIGS, TYPES, VOCAB, rounded, tiny_model, write_gguf
from omegaconf import OmegaConf

from conftest import compose_config
from pipeline.build.plan import resolve_model
from pipeline.errors import BuildError, ConfigError
from pipeline.kv.op import ReferenceCache, reference_cache
from pipeline.models.families import FAMILIES
from test_loaders import ours, relative

transformers = pytest.importorskip("transformers")

BOUND = 1e-4  # of the logit range, fp32: the same weights on both sides
FAILS = 100 * BOUND  # a planted error is further than this (measured: 6e-2 and more)
# the original (unrounded) model against a file of each type: the rounding of the type (measured: F16 ~1e-3,
# Q8_0 ~1e-2 on these models)
ROUNDING = {"F32": BOUND, "F16": 5e-3, "Q8_0": 5e-2}
IDS = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(4))  # longer than the windows (8)
# the tokens' positions: 700 apart where no layer slides (RoPE is relative: Llama 3's divided frequencies turn
# noticeably only over thousands of positions); 0..18 where windows are (transformers' sliding masks count
# tokens, ours positions) and for Phi-3 (transformers takes the long factors beyond 32 positions)
SPREAD = ("llama", "mistral", "qwen3", "smollm3")
POSITIONS = {family: torch.arange(len(IDS)) * (700 if family in SPREAD else 1) for family in CONFIGS}

# transformers' GGUF loading (GGUF_CONFIG_MAPPING / TENSOR_PROCESSORS of transformers.integrations.ggml and
# modeling_gguf_pytorch_utils): the architectures it loads, and the settings of each family it does not take
# from the file's metadata (it keeps its config class's defaults): supplied from the original config, so that
# its weights (names, q/k un-permutation, Gemma's norm - 1, Phi-3's fused tensors) are compared under the
# model's own settings. smollm3 is not among its architectures.
NOT_READ = {
    "llama": ("rope_parameters",),  # llama3 scaling: it ignores rope_freqs and writes no rope_scaling
    "mistral": (),  # read as a Llama (its general.name is not exactly "mistral"): the same model without a window
    "qwen2": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "rope_parameters"),
    "qwen3": ("head_dim",),  # attention.key_length is not mapped for qwen3: it takes the default 128
    "gemma3": ("rope_parameters", "query_pre_attn_scalar"),  # linear scaling, swa base; scalar default 256
    "phi3": ("rope_parameters", "original_max_position_embeddings", "pad_token_id"),  # partial rotary, longrope
}
# what it does read, checked against the original
READ = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "tie_word_embeddings")


def our_logits(model, positions: torch.Tensor) -> torch.Tensor:
    with reference_cache(ReferenceCache(model.args.layer_kv())), torch.no_grad():
        return model.logits(model.hidden(model.embed(IDS), positions))


def hf_logits(model, positions: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS[None], position_ids=positions[None]).logits[0]


def checkpoint_cfg(path: Path, *overrides: str):
    return resolve_model(compose_config(f"+model.checkpoint={path}", *overrides), [])


def transformers_gguf(path: Path, family: str, original) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``, the settings it does not read from
    the file (``NOT_READ``) given from the original config."""
    directory, name = os.path.split(path)
    config = transformers.AutoConfig.from_pretrained(directory, gguf_file=name)
    for key in READ:
        assert getattr(config, key) == getattr(original.config, key), (family, key)
    for key in NOT_READ[family]:
        setattr(config, key, getattr(original.config, key))
    return transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=config,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{family: (original model, {type: GGUF path})}."""
    transformers.logging.set_verbosity_error()
    tmp = tmp_path_factory.mktemp("gguf_families")
    out = {}
    for family in CONFIGS:
        model = tiny_model(family)
        out[family] = (model, {t: write_gguf(model, family, tmp / f"{family}-{t}.gguf", t) for t in TYPES})
    return out


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("family", list(CONFIGS))
def test_gguf_matches_transformers_and_the_original(files, family, qtype):
    """Our logits from the file equal (1) the original model with its weights rounded as the file stores them,
    (2) transformers' loading of the same file where it loads the architecture (both dequantize the same
    blocks), within 1e-4 of the logit range; and the original itself within the rounding of the type."""
    original, paths = files[family]
    cfg = checkpoint_cfg(paths[qtype])
    assert cfg.model.family == ("llama" if family == "mistral" else family)
    positions = POSITIONS[family]
    got = our_logits(ours(cfg), positions)
    assert relative(got, hf_logits(rounded(original, qtype), positions)) <= BOUND
    assert relative(got, hf_logits(original, positions)) <= ROUNDING[qtype]
    if family in NOT_READ:
        assert relative(got, hf_logits(transformers_gguf(paths[qtype], family, original), positions)) <= BOUND


def test_config_read_from_the_file(files):
    """The settings each file implies: the family's features as llama.cpp's metadata (and its code's constants)
    say them."""
    got = {family: checkpoint_cfg(paths["F32"]).model for family, (_, paths) in files.items()}
    assert got["llama"].rope_scaling.type == "llama3" and got["llama"].rope_scaling.factor == 32
    assert (got["llama"].rope_scaling.original_context, got["llama"].rope_scaling.high_freq_factor) == (8192, 4)
    assert got["llama"].tie_embeddings and not got["mistral"].tie_embeddings
    assert (got["qwen2"].layer_pattern, got["qwen2"].sliding_window, got["qwen2"].qkv_bias) == ("FRR", 8, True)
    assert (got["qwen2"].rope_scaling.type, got["qwen2"].rope_scaling.factor, got["qwen2"].rope_scaling.original_context) \
        == ("yarn", 4, 32)
    assert (got["qwen3"].head_dim, got["qwen3"].qk_norm) == (24, True)
    g = got["gemma3"]
    assert (g.layer_pattern, g.sliding_window, g.rope_base, g.rope_local_base) == ("RRRRRF", 8, 1e6, 1e4)
    assert (g.rope_scaling.type, g.rope_scaling.factor, g.post_norms, g.post_norm_eps, g.mlp_act, g.embed_scale) == \
        ("linear", 8, True, 1e-6, "gelu_tanh", True)
    assert g.attn_scale == pytest.approx(32**-0.5)
    p = got["phi3"]
    assert (p.rope_dim, p.head_dim, p.rope_scaling.type, p.rope_scaling.original_context, p.rope_scaling.factor) == \
        (12, 16, "longrope", 32, 4)
    assert list(p.rope_scaling.short_factor) == pytest.approx([1.0, 1.1, 1.3, 1.7, 2.3, 3.1])
    assert got["smollm3"].rope_layers == "1110" and got["llama"].rope_layers == ""


def test_the_file_implies_what_the_checkpoint_directory_does(files):
    """Each file's settings (llama.cpp's metadata, tensors and fixed constants) are the ones our Hugging Face
    reader takes from the original config.json, where llama.cpp keeps them; RoPE compared by the frequencies and
    the factor on cos and sin it computes (llama.cpp stores Llama 3's and Phi-3's scaling as tensors, Phi-3's
    attention factor as a number our config derives). Qwen2's windows compare because this converter writes
    them in llama.cpp's window keys; llama.cpp's own drops them (a planted case below shows the difference)."""
    from pipeline.models.args import RopeScaling
    from pipeline.models.loaders.gguf_config import read_config
    from pipeline.models.loaders.hf_config import settings_of
    from pipeline.models.rope import frequencies

    for family, (original, paths) in files.items():
        _, got = read_config(paths["F32"])
        want = settings_of(original.config.to_dict(), family, "config.json")
        for key, value in want.items():
            if key == "rope_scaling":
                rotary = want["rope_dim"] or want["head_dim"]
                (f_got, a_got), (f_want, a_want) = (frequencies(want["rope_base"], rotary, RopeScaling(**s))
                                                    for s in (got[key], value))
                assert torch.allclose(f_got, f_want, rtol=1e-6) and a_got == pytest.approx(a_want), family
            elif key == "attn_scale" and not value:
                assert got[key] in (0, want["head_dim"] ** -0.5), family
            else:
                assert got[key] == value, (family, key)


# --- each comparison fails on a planted error -----------------------------------------------------------------


def _permutation_left(family):
    return {"fam": type(FAMILIES[family])(**{**FAMILIES[family].__dict__, "gguf_permutes_qk": False})}


def _swapped_split(tensor: str, a: int, b: int):
    """The reader splitting fused tensors ``tensor`` with parts ``a`` and ``b`` swapped."""
    def patch(monkeypatch):
        from pipeline.models.loaders import gguf as reader

        real = reader.fused_parts

        def swapped(name, args, family):
            parts = real(name, args, family)
            if parts is not None and tensor in name:
                parts[a], parts[b] = (parts[b][0], *parts[a][1:]), (parts[a][0], *parts[b][1:])
            return parts

        monkeypatch.setattr(reader, "fused_parts", swapped)
    return patch


def _factors_unchecked(monkeypatch):
    """The reader not holding the file's RoPE factor tensors to the config (so that a dropped scaling loads)."""
    from pipeline.models.loaders import gguf as reader

    monkeypatch.setattr(reader, "_check_rope_factors", lambda *a: None)


# case -> (family, what the test plants, the references that must catch it)
PLANTED = {
    "llama: q/k permutation left in place": ("llama", {"family": True}, ("original", "transformers")),
    "smollm3: q/k permutation left in place": ("smollm3", {"family": True}, ("original",)),
    "llama: llama3 scaling dropped": ("llama", {"set": {"rope_scaling.type": "default"}, "patch": _factors_unchecked},
                                      ("original", "transformers")),
    "gemma3: norms written without +1": ("gemma3", {"write": {"norm_shift": False}}, ("original",)),
    "gemma3: local RoPE base dropped": ("gemma3", {"set": {"rope_local_base": 0.0}}, ("original", "transformers")),
    "gemma3: no sliding windows": ("gemma3", {"set": {"layer_pattern": "F"}}, ("original", "transformers")),
    "qwen2: window keys left out (llama.cpp's own file)": ("qwen2", {"write": {"window_keys": False}}, ("original",)),
    "qwen2: yarn dropped": ("qwen2", {"set": {"rope_scaling.type": "default"}}, ("original", "transformers")),
    "phi3: gate and up swapped": ("phi3", {"patch": _swapped_split("ffn_up", 0, 1)}, ("original", "transformers")),
    "phi3: k and v swapped": ("phi3", {"patch": _swapped_split("attn_qkv", 1, 2)}, ("original", "transformers")),
    "phi3: longrope dropped": ("phi3", {"set": {"rope_scaling.type": "default"}, "patch": _factors_unchecked},
                               ("original", "transformers")),
    "smollm3: RoPE on every layer": ("smollm3", {"set": {"rope_layers": ""}}, ("original",)),
}


@pytest.mark.parametrize("case", PLANTED)
def test_comparison_fails_on_a_planted_error(files, tmp_path, monkeypatch, case):
    """The comparisons above can fail: each planted error moves our logits far past the bound from the references
    that should catch it. (A converter that forgets Gemma's +1 is invisible to transformers' loading, which takes 1
    off again: only the original catches it.)"""
    family, plant, caught_by = PLANTED[case]
    original, paths = files[family]
    path = paths["F32"]
    if "write" in plant:
        path = write_gguf(original, family, tmp_path / f"{family}.gguf", **plant["write"])
    if "patch" in plant:
        plant["patch"](monkeypatch)
    cfg = checkpoint_cfg(path)
    for key, value in plant.get("set", {}).items():  # the reader's settings changed (an override of them is refused)
        OmegaConf.update(cfg.model, key, value)
    fam = _permutation_left(cfg.model.family)["fam"] if plant.get("family") else None
    got = our_logits(ours(cfg, fam), POSITIONS[family])
    refs = {"original": lambda: hf_logits(original, POSITIONS[family]),
            "transformers": lambda: hf_logits(transformers_gguf(path, family, original), POSITIONS[family])}
    for name in caught_by:
        assert relative(got, refs[name]()) > FAILS, (case, name)
    if case.startswith("gemma3: norms written"):
        assert relative(got, refs["transformers"]()) <= BOUND  # transformers reads the file the same wrong way


# --- broken files: one line naming the file and what is wrong ---------------------------------------------------


@pytest.mark.parametrize("family, missing", [("llama", "blk.1.ffn_up.weight"), ("phi3", "blk.0.attn_qkv.weight"),
                                             ("gemma3", "blk.3.post_ffw_norm.weight")])
def test_missing_tensor_named_in_one_line(files, tmp_path, family, missing):
    path = write_gguf(files[family][0], family, tmp_path / "broken.gguf", skip=(missing,))
    with pytest.raises(BuildError) as err:
        ours(checkpoint_cfg(path))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"model.checkpoint={path}: tensor {missing} is missing"), message


def test_missing_tensor_refused_by_the_pipeline(files, tmp_path):
    """The same through ``python -m pipeline``: exit 2, one line on stderr, nothing published."""
    from test_loaders import _pipeline

    path = write_gguf(files["gemma3"][0], "gemma3", tmp_path / "broken.gguf", "F16", skip=("blk.1.ffn_up.weight",))
    proc = _pipeline(tmp_path, f"+model.checkpoint={path}", "backend=portable")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: model.checkpoint={path}: tensor blk.1.ffn_up.weight is missing"), proc.stderr


@pytest.mark.parametrize("family, key, value, needle", [
    ("qwen3", "qwen3.attention.clamp_kqv", 8.0, "metadata qwen3.attention.clamp_kqv is not understood"),
    ("gemma3", "gemma3.attn_logit_softcapping", 50.0, "metadata gemma3.attn_logit_softcapping is not understood"),
    ("llama", "llama.rope.scaling.yarn_log_multiplier", 0.1, "llama.rope.scaling.yarn_log_multiplier=0.1"),
    ("phi3", "phi3.rope.scaling.type", "yarn", "longrope factor tensors with phi3.rope.scaling.type=yarn"),
])
def test_unknown_metadata_refused(files, tmp_path, family, key, value, needle):
    path = write_gguf(files[family][0], family, tmp_path / "odd.gguf", extra={key: value})
    with pytest.raises(ConfigError) as err:
        checkpoint_cfg(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"model.checkpoint={path}: ") and needle in message, message


def test_rope_freqs_checked_against_the_model(files, tmp_path):
    """Llama 3's rope_freqs: factors that are no llama3 scaling are refused when the config is read; an override
    of the scaling that the file's factors contradict is refused when the weights are."""
    import gguf
    import numpy as np

    original, paths = files["llama"]
    cfg = checkpoint_cfg(paths["F32"])
    cfg.model.rope_scaling.factor = 8.0
    with pytest.raises(BuildError, match=r"tensor rope_freqs.weight holds RoPE factors .* not model.rope_scaling"):
        ours(cfg)
    reader = gguf.GGUFReader(str(paths["F32"]))
    path = tmp_path / "odd-freqs.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        data = np.array(t.data) if t.name != "rope_freqs.weight" else np.linspace(1, 5, t.data.size, dtype=np.float32)
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"rope_freqs.weight holds RoPE factors that are not Llama 3's"):
        checkpoint_cfg(path)


@pytest.mark.parametrize("name", ["smollm3", "phi3"])
def test_from_checkpoint_keeps_q8_0_blocks_of_a_new_family(files, name):
    """quant=from_checkpoint on a Q8_0 file (SmolLM3: q/k permuted, tied head; Phi-3: fused attn_qkv and ffn_up,
    whose blocks are split by rows): the embedding's blocks are kept bit for bit, the linears requantized per
    channel (XNNPACK has no 8-bit groups), and the quantized model's logits stay near the file's dequantized ones."""
    from pipeline.models.methods import build_target
    from pipeline.quant.apply import dequantized, quantize

    original, paths = files[name]
    cfg = resolve_model(compose_config(f"+model.checkpoint={paths['Q8_0']}", "quant=from_checkpoint"), [])
    model, _ = build_target(cfg.model, None)
    want_embedding = model.tok_embeddings.weight.detach().clone()
    want = our_logits(model, POSITIONS[name])
    report = quantize(model, cfg.quant, cfg.model)
    embedding = report["tensors"]["tok_embeddings"]
    assert "Q8_0 blocks kept" in embedding["format"] and embedding["bit_exact"]
    assert torch.equal(dequantized(model, "tok_embeddings"), want_embedding)
    assert all("requantized" in t["format"] for n, t in report["tensors"].items() if n != "tok_embeddings")
    assert relative(our_logits(model, POSITIONS[name]), want) <= 2e-2


@pytest.mark.parametrize("family,layout", [("gemma3", "cell"), ("qwen2", "sequence")])
def test_gguf_artifact_equals_the_original(files, tmp_path, family, layout):
    """A GGUF of a new family built into a .pte (F32: the original's weights exactly): through a continuous-batching
    episode its logits equal the original model's forward of each sequence alone (test_families.episode)."""
    import json

    from gguf_families import write_gguf
    from test_families import BOUND, LAYOUTS, episode

    from conftest import compose_config
    from pipeline.build.runner import build
    from pipeline.runtime.session import Session

    original = files[family][0]
    path = write_gguf(original, family, tmp_path / f"{family}.gguf", "F32", tokenizer=False)
    overrides = [f"+model.checkpoint={path}", "backend=portable", *LAYOUTS[layout], f"output_root={tmp_path}"]
    version = build(compose_config(*overrides), overrides)
    assert json.loads((version / "validation.json").read_text())["passed"]
    assert episode(Session(version), original.eval(), torch.Generator().manual_seed(5)) <= BOUND


def test_an_unreadable_tokenizer_is_named_in_one_line(files, tmp_path):
    """The placeholder vocabulary the tests write for transformers' loader is no tokenizer transformers can convert:
    the build stops naming the file, not with the converter's KeyError."""
    from test_loaders import _pipeline

    path = files["gemma3"][1]["F32"]
    proc = _pipeline(tmp_path, f"+model.checkpoint={path}", "backend=portable")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: model.checkpoint={path}: its tokenizer cannot be read by transformers")
    assert not list((tmp_path / "out").rglob("v0*"))
