"""Muse Glimmer's three checkpoints in ExecuTorch's GGUF layouts (tiny ones, ``glimmer_gguf.py``): the
target (``model.checkpoint``), the mmproj vision tower (``vision.checkpoint``) and the DFlash draft
(``draft.checkpoint``), each read by our loaders, against ExecuTorch's loaders and models reading the
same file (fp32); then all three in one artifact. Each comparison is shown failing on a planted error."""

import dataclasses
import json

import pytest
import torch
from executorch.examples.models.muse_glimmer.model.dflash_model import DFlashConfig, DFlashDraftModel
from executorch.examples.models.muse_glimmer.model.model import MuseGlimmerConfig
from executorch.examples.models.muse_glimmer.vision.precompute import (
    MuseGlimmerVisionConfig,
    patchify_image,
    precompute_vision_inputs,
)
from glimmer_gguf import glimmer_reference, write_dflash, write_mmproj, write_target

from conftest import compose_config
from pipeline.build.plan import resolve, resolve_model
from pipeline.errors import BuildError, ConfigError
from pipeline.kv.op import ReferenceCache, reference_cache
from pipeline.models.args import GlimmerVisionArgs, model_args, vision_args
from pipeline.models.families import family
from pipeline.models.loaders import load_into
from pipeline.models.transformer import build_model
from pipeline.models.vision import build_vision

# K-quant rows are whole super-blocks of 256: every quantized tensor's input width is a multiple of it
WIDTH = 256
BOUND = 1e-5  # fp32 rounding; both sides dequantize the same blocks with the gguf package


def target_config() -> MuseGlimmerConfig:  # a fresh one: ExecuTorch's loader writes its fusion flags into it
    return MuseGlimmerConfig(dim=WIDTH, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=512, max_seq_len=128,
                             global_attn_cfg="[16,16,16,0]", every_n_layers_nope=4, fuse_qkv=False, fuse_gate_up=False)


VISION = dict(latent_dim=WIDTH, n_heads=4, n_layers=4, mlp_hidden=512, adapter_dim=WIDTH, hidden_size=WIDTH)
DRAFT = DFlashConfig(dim=WIDTH, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=768, vocab_size=512, block_size=8,
                     target_layers=[1, 2], rope_theta=500000.0, norm_eps=1e-5, mask_token_id=3, max_seq_len=128)
TARGET_PRESET = ("model=muse_glimmer_tiny",)
VISION_PRESET = ("model=muse_glimmer_tiny", f"model.dim={WIDTH}", "vision=muse_glimmer_tiny")
DRAFT_PRESET = ("model=muse_glimmer_tiny", f"model.dim={WIDTH}", "draft=dflash_muse_glimmer_tiny")


def relative(got, want) -> float:
    return float((got - want).abs().max() / (want.max() - want.min()))


@pytest.fixture(scope="module")
def sources():
    """The weights the files are written from: ExecuTorch's target and draft, our tower (random)."""
    tower = build_vision(GlimmerVisionArgs(**VISION, image_size=56, pos_grid=8), 7)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "ln_" in name and name.endswith("weight") else 0.05 * torch.randn_like(p))
    torch.manual_seed(0)
    draft = DFlashDraftModel(DRAFT, max_context_length=128)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return {"target": dict(glimmer_reference(target_config()).named_parameters()), "vision": dict(tower.named_parameters()),
            "draft": dict(draft.named_parameters())}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("glimmer")
    return {"target": write_target(root / "target.gguf", sources["target"], target_config()),
            "bare": write_target(root / "bare.gguf", sources["target"], target_config(), metadata=False),
            "mmproj": write_mmproj(root / "mmproj.gguf", sources["vision"]),
            "dflash": write_dflash(root / "dflash.gguf", sources["draft"], DRAFT)}


# --- the target ---


def executorchs_target(path):
    from executorch.examples.models.muse_glimmer.loaders.checkpoint_loader import load_gguf_model

    model, _ = load_gguf_model(str(path), backend="mlx", config=target_config(), activation_dtype=torch.float32)
    return model


def our_target(*overrides: str):
    cfg = resolve_model(compose_config(*TARGET_PRESET, *overrides), list(overrides)).model
    model = build_model(model_args(cfg), 5)
    load_into(model, cfg.checkpoint, family(cfg.family))
    return cfg, model


def target_error(ours, ref) -> float:
    """The worst relative logit error over a 12-token prefill and 13 decodes (every window slides),
    against ExecuTorch's prefill (its embedding and norm in fp32: its embed_text casts to bf16)."""
    gen = torch.Generator().manual_seed(1)
    tokens, start, worst = torch.randint(0, 512, (12,), generator=gen), 0, 0.0
    with torch.no_grad(), reference_cache(ReferenceCache(ours.args.layer_kv())):
        for _ in range(14):
            positions = torch.arange(start, start + len(tokens))
            want = ref.prefill_from_embeds(ref.tok_norm(ref.embed_tokens(tokens[None])), positions)[0]
            got = ours.logits(ours.hidden(ours.embed(tokens), positions))
            worst = max(worst, relative(got, want))
            start += len(tokens)
            tokens = want[-1].argmax().reshape(1)
    return worst


TARGET_FILES = {"llama.cpp metadata": ("target", ()),
                # ExecuTorch's own test file carries no metadata: its config says the head dim, ours the preset
                "no metadata": ("bare", ("model.head_dim=64",))}


@pytest.mark.parametrize("case", TARGET_FILES)
def test_target_gguf_equals_executorchs_loader_and_model(files, case):
    name, overrides = TARGET_FILES[case]
    cfg, ours = our_target(f"model.checkpoint={files[name]}", *overrides)
    c = target_config()
    assert (cfg.dim, cfg.n_layers, cfg.hidden_dim, cfg.head_dim, cfg.vocab_size) == (c.dim, c.n_layers, c.ffn_dim, c.head_dim, c.vocab_size)
    assert (cfg.layer_pattern, cfg.sliding_window, cfg.qk_norm, cfg.attn_gate, cfg.tie_embeddings) == ("RRRF", 16, True, True, False)
    assert target_error(ours, executorchs_target(files[name])) <= BOUND


def test_target_comparison_sees_a_wrong_metadata_value_and_a_transposed_tensor(files, sources, tmp_path):
    """ExecuTorch ignores the metadata and we read it: a wrong RoPE base in the file shows; so does a
    loader that left a (square) tensor transposed."""
    ref = executorchs_target(files["target"])
    path = write_target(tmp_path / "wrong.gguf", sources["target"], dataclasses.replace(target_config(), rope_theta=10000.0))
    _, ours = our_target(f"model.checkpoint={path}")
    assert ours.args.rope_base == 10000.0 and target_error(ours, ref) > 1e-3
    _, ours = our_target(f"model.checkpoint={files['target']}")
    with torch.no_grad():
        ours.layers[0].attention.wq.weight.copy_(ours.layers[0].attention.wq.weight.T.clone())
    assert target_error(ours, ref) > 1e-3


# --- the mmproj ---


def executorchs_tower(path):
    """ExecuTorch's tower and position table from the mmproj, for ExecuTorch's config of the file's model
    (not ours: a setting we misread shows)."""
    from executorch.examples.models.muse_glimmer.loaders.checkpoint_loader import load_mmproj_vision_model

    config = MuseGlimmerVisionConfig(**VISION, pos_emb_grid_h=8, pos_emb_grid_w=8, encoder_output_dim=4 * WIDTH)
    model, table, config = load_mmproj_vision_model(str(path), config=config, backend="mlx", activation_dtype=torch.float32)
    return model, table.float(), config  # its table comes back in bf16; the file's values are bf16 already


def our_tower(*overrides: str):
    from pipeline.models.loaders.glimmer_vision import load_vision

    cfg = resolve_model(compose_config(*VISION_PRESET, *overrides), list(overrides))
    tower = build_vision(vision_args(cfg.vision, model_args(cfg.model)), 3)
    load_vision(tower, cfg.vision.checkpoint)
    return cfg.vision, tower


def tower_error(ours, ref) -> float:
    model, table, config = ref
    image = torch.rand(3, 56, 56, generator=torch.Generator().manual_seed(5)) * 2 - 1
    with torch.no_grad():
        want = model(*precompute_vision_inputs(image, table, config).as_args()).float()
        got = ours(patchify_image(image, config)[0])
    assert got.shape == want.shape == (1, 4, WIDTH)
    return relative(got, want)


MMPROJ_FILES = {"ExecuTorch's names": {}, "the 30B file's names": {"numeric_projector": True, "folded_patches": (3, 14)}}


@pytest.mark.parametrize("case", MMPROJ_FILES)
def test_mmproj_equals_executorchs_loader_and_tower(files, sources, tmp_path, case):
    """The mmproj's sizes replace the preset's; the tower equals ExecuTorch's on a 56x56 image. The 30B
    spelling: mm.0/1/2 and a 4-D patch embedding of one temporal slot."""
    path = files["mmproj"] if not MMPROJ_FILES[case] else write_mmproj(tmp_path / "mm30b.gguf", sources["vision"], **MMPROJ_FILES[case])
    v, ours = our_tower(f"vision.checkpoint={path}")
    assert (v.dim, v.n_layers, v.hidden_dim, v.adapter_dim, v.scale_factor, v.pos_grid) == (WIDTH, 4, 512, WIDTH, 2, 8)
    assert tower_error(ours, executorchs_tower(path)) <= BOUND


def test_mmproj_comparison_sees_a_wrong_metadata_value_and_a_transposed_tensor(files, sources, tmp_path):
    ref = executorchs_tower(files["mmproj"])
    # llama.cpp's head count, which we read and ExecuTorch does not: 8 heads of 32 instead of 4 of 64
    path = write_mmproj(tmp_path / "heads8.gguf", sources["vision"], metadata={"clip.vision.attention.head_count": 8})
    v, ours = our_tower(f"vision.checkpoint={path}")
    assert v.n_heads == 8 and tower_error(ours, ref) > 1e-3
    _, ours = our_tower(f"vision.checkpoint={files['mmproj']}")
    with torch.no_grad():
        weight = ours.encoder.blocks[0].q_proj.weight
        weight.copy_(weight.T.clone())
    assert tower_error(ours, ref) > 1e-3


def test_mmproj_settings_that_contradict_are_refused(files):
    with pytest.raises(ConfigError, match=r"vision.n_layers=6 contradicts vision.checkpoint=.*mmproj.gguf, which has n_layers=4"):
        resolve_model(compose_config(*VISION_PRESET, f"vision.checkpoint={files['mmproj']}", "vision.n_layers=6"),
                      ["vision.checkpoint", "vision.n_layers"])
    with pytest.raises(ConfigError, match=r"makes image tokens of width 256, but the target has model.dim=64"):
        resolve_model(compose_config("model=muse_glimmer_tiny", "vision=muse_glimmer_tiny", f"vision.checkpoint={files['mmproj']}"), [])
    with pytest.raises(ConfigError, match=r"v.patch_embd.weight has shape \(256, 1176\), but vision.patch_temporal=2 x 3 .*patch_size=16"):
        resolve_model(compose_config(*VISION_PRESET, f"vision.checkpoint={files['mmproj']}", "vision.patch_size=16",
                                     "vision.image_size=64"), [])


# --- the DFlash draft ---


def executorchs_draft(path):
    from executorch.examples.models.muse_glimmer.loaders.dflash_loader import load_dflash_gguf

    model, _ = load_dflash_gguf(str(path), backend="mlx", max_seq_len=128, activation_dtype=torch.float32)
    for fqn, buf in list(model.named_buffers()):  # its context caches stay on the meta device: zeros, as its export has
        if buf.device.type == "meta":
            module, _, leaf = fqn.rpartition(".")
            model.get_submodule(module).register_buffer(leaf, torch.zeros(buf.shape), persistent=False)
    return model


def our_draft(*overrides: str):
    from pipeline.models.methods import build_draft_model

    cfg = resolve_model(compose_config(*DRAFT_PRESET, *overrides), list(overrides))
    resolve(cfg)
    return cfg.draft, build_draft_model(cfg.draft, model_args(cfg.model))


def draft_error(ours, ref) -> float:
    """Three blocks of 8 after contexts of 6, 3 and 1 new positions (ExecuTorch's context cache against
    ours rolled back to the context between blocks)."""
    gen = torch.Generator().manual_seed(2)
    cache, start, worst = ReferenceCache(ours.layer_kv(), causal=False), 0, 0.0
    for n_ctx in (6, 3, 1):
        features, block = torch.randn(1, n_ctx, 2 * WIDTH, generator=gen), torch.randn(1, 8, WIDTH, generator=gen)
        with torch.no_grad():
            want = ref(block, features, torch.tensor([start]))
            with reference_cache(cache):
                got = ours(features, block, torch.arange(start, start + n_ctx), torch.arange(start + n_ctx, start + n_ctx + 8))
        start += n_ctx
        cache.truncate(start)
        worst = max(worst, relative(got, want))
    return worst


def test_dflash_gguf_equals_executorchs_loader_and_draft(files):
    d, ours = our_draft(f"draft.checkpoint={files['dflash']}")
    assert (d.num_hidden_layers, d.n_heads, d.n_kv_heads, d.head_dim, d.hidden_dim) == (2, 4, 2, 64, 768)
    assert (d.block_size, list(d.target_layer_ids), d.mask_token_id, d.rope_base) == (8, [1, 2], 3, 500000.0)
    assert draft_error(ours, executorchs_draft(files["dflash"])) <= BOUND


def test_dflash_comparison_sees_a_transposed_tensor_and_a_wrong_setting(files, sources, tmp_path):
    ref = executorchs_draft(files["dflash"])
    _, ours = our_draft(f"draft.checkpoint={files['dflash']}")
    with torch.no_grad():
        weight = ours.layers[1].attention.wq.weight
        weight.copy_(weight.T.clone())
    assert draft_error(ours, ref) > 1e-3
    # a reader that missed the RoPE base (the preset's 10000 instead of the file's 500000)
    path = write_dflash(tmp_path / "no_base.gguf", sources["draft"], DRAFT, metadata={"dflash.rope.freq_base": None})
    d, ours = our_draft(f"draft.checkpoint={path}", "draft.rope_base=10000.0")
    assert d.rope_base == 10000.0 and draft_error(ours, ref) > 1e-3


def test_dflash_gguf_that_does_not_fit_is_refused(files, sources, tmp_path):
    with pytest.raises(ConfigError, match=r"draft.checkpoint=.*dflash.gguf has hidden_size=256, but the target has model.dim=64"):
        resolve_model(compose_config("model=muse_glimmer_tiny", "draft=dflash_muse_glimmer_tiny", f"draft.checkpoint={files['dflash']}"), [])
    with pytest.raises(ConfigError, match=r"draft.block_size=16 contradicts draft.checkpoint=.*, which has block_size=8"):
        resolve_model(compose_config(*DRAFT_PRESET, f"draft.checkpoint={files['dflash']}", "draft.block_size=16"), ["draft.block_size"])
    sliding = write_dflash(tmp_path / "swa.gguf", sources["draft"], DRAFT,
                           metadata={"dflash.attention.sliding_window": 64, "dflash.attention.sliding_window_pattern": [True, False]})
    with pytest.raises(ConfigError, match=r"has sliding-window layers \(dflash.attention.sliding_window=64"):
        resolve_model(compose_config(*DRAFT_PRESET, f"draft.checkpoint={sliding}"), [])
    with pytest.raises(ConfigError, match=r"target.gguf has no tensor fc.weight: it is not a DFlash draft"):
        resolve_model(compose_config(*DRAFT_PRESET, f"draft.checkpoint={files['target']}"), [])


# --- a missing tensor: one line naming the file and the tensor ---


def test_missing_tensor_is_one_line_naming_file_and_tensor(sources, tmp_path):
    target = write_target(tmp_path / "t.gguf", sources["target"], target_config(), leave_out=("blk.1.ffn_up.weight",))
    mmproj = write_mmproj(tmp_path / "m.gguf", sources["vision"], leave_out=("v.blk.2.attn_k.bias",))
    draft = write_dflash(tmp_path / "d.gguf", sources["draft"], DRAFT, leave_out=("blk.0.attn_q_norm.weight",))
    no_embeddings = write_target(tmp_path / "e.gguf", sources["target"], target_config(), leave_out=("token_embd.weight",))
    # (what fails, the setting and file it names, the tensor: the file's name or ours)
    cases = [(lambda: our_target(f"model.checkpoint={target}"), f"model.checkpoint={target}: ",
              ("blk.1.ffn_up.weight", "layers.1.feed_forward.w3.weight")),
             (lambda: our_tower(f"vision.checkpoint={mmproj}"), f"vision.checkpoint={mmproj}: ", ("v.blk.2.attn_k.bias",)),
             (lambda: our_draft(f"draft.checkpoint={draft}"), f"draft.checkpoint={draft}: ", ("blk.0.attn_q_norm.weight",)),
             (lambda: our_target(f"model.checkpoint={no_embeddings}"), f"model.checkpoint={no_embeddings}: ", ("token_embd.weight",))]
    for run, start, tensor in cases:
        with pytest.raises((BuildError, ConfigError)) as err:
            run()
        message = str(err.value)
        assert message.startswith(start) and "missing" in message and any(t in message for t in tensor), message
        assert "\n" not in message



# --- one artifact ---


def test_target_mmproj_and_dflash_build_one_artifact_that_validates(files, tmp_path):
    """The three GGUFs -> one .pte (portable, two sequences): it validates (target logits, the draft's
    proposals, the tower's features, each against our eager models), and its target's logits equal
    ExecuTorch's model loaded from the same file."""
    from pipeline.build.runner import build
    from pipeline.runtime.session import Session

    overrides = ["model=muse_glimmer_tiny", f"model.checkpoint={files['target']}", "vision=muse_glimmer_tiny",
                 f"vision.checkpoint={files['mmproj']}", "draft=dflash_muse_glimmer_tiny", f"draft.checkpoint={files['dflash']}",
                 "backend=portable", "kv=sequence", "kv.max_seqs=2", "kv.capacity=64", "validate.prompt_lengths=[13,5]",
                 "validate.decode_steps=12", f"output_root={tmp_path / 'out'}"]
    version = build(compose_config(*overrides), overrides)
    report = json.loads((version / "validation.json").read_text())
    assert report["passed"] and report["speculative"]["equals_greedy"], report
    assert report["images"]["vision_max_relative_error"] < 1e-5
    manifest = json.loads((version / "manifest.json").read_text())
    assert set(manifest["methods"]) == {"embed_text", "target_forward_from_embeddings", "draft_forward", "vision_encoder"}
    assert (manifest["draft"]["block_size"], manifest["vision"]["out_dim"], manifest["target"]["vocab_size"]) == (8, WIDTH, 512)
    session = Session(version)
    session.add("a")
    tokens = torch.randint(0, 512, (10,), generator=torch.Generator().manual_seed(2))
    got = session.step({"a": tokens.tolist()})["a"]
    ref = executorchs_target(files["target"])
    with torch.no_grad():
        want = ref.prefill_from_embeds(ref.tok_norm(ref.embed_tokens(tokens[None])), torch.arange(10))[0, -1]
    assert relative(got, want) <= 1e-4

