"""The SmolVLM-style vision encoder against transformers' SmolVLM vision tower and connector,
weights copied across, on random pixels."""

import pytest
import torch

from pipeline.models.args import VisionArgs
from pipeline.models.vision import build_vision

transformers = pytest.importorskip("transformers")


def reference_and_ours():
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMVisionTransformer

    config = transformers.SmolVLMConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, layer_norm_eps=1e-6),
        text_config=dict(model_type="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128),
        scale_factor=2)
    torch.manual_seed(0)
    tower, connector = SmolVLMVisionTransformer(config.vision_config).eval(), SmolVLMConnector(config).eval()
    with torch.no_grad():
        for name, p in [*tower.named_parameters(), *connector.named_parameters()]:
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name and "weight" in name else 0.1 * torch.randn_like(p))
    ours = build_vision(VisionArgs(image_size=32, patch_size=8, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                   norm_eps=1e-6, scale_factor=2, out_dim=48), 1)
    names = {"embeddings.patch_embedding.weight": "patch_embedding.weight", "embeddings.patch_embedding.bias": "patch_embedding.bias",
             "embeddings.position_embedding.weight": "position_embedding.weight",
             "post_layernorm.weight": "post_layernorm.weight", "post_layernorm.bias": "post_layernorm.bias"}
    for i in range(2):
        r, o = f"encoder.layers.{i}.", f"layers.{i}."
        for part in ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.out_proj"):
            mine = part.replace("mlp.", "").replace("self_attn.", "attention.")
            names |= {f"{r}{part}.{w}": f"{o}{mine}.{w}" for w in ("weight", "bias")}
    theirs = dict(tower.named_parameters())
    mine = dict(ours.named_parameters())
    assert set(names) == set(theirs) and set(names.values()) | {"projection.weight"} == set(mine)
    with torch.no_grad():
        for r_name, o_name in names.items():
            mine[o_name].copy_(theirs[r_name])
        mine["projection.weight"].copy_(connector.modality_projection.proj.weight)
    return tower, connector, ours


def test_vision_features_match_smolvlm():
    tower, connector, ours = reference_and_ours()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = connector(tower(pixels).last_hidden_state)
        got = ours(pixels)
    assert got.shape == want.shape == (2, ours.args.n_image_tokens, 48)
    assert float((got - want).abs().max() / (want.max() - want.min())) <= 1e-5


def test_comparison_can_fail():
    """A pixel shuffle that orders each square's patches column-first is seen."""
    from pipeline.models import vision

    tower, connector, ours = reference_and_ours()
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))

    def column_first(x, scale):
        b, n, c = x.shape
        side = int(n**0.5)
        x = x.view(b, side // scale, scale, side // scale, scale, c)
        return x.permute(0, 1, 3, 4, 2, 5).reshape(b, n // scale**2, c * scale**2)

    with torch.no_grad():
        want = connector(tower(pixels).last_hidden_state)
        real, vision.pixel_shuffle = vision.pixel_shuffle, column_first
        try:
            got = ours(pixels)
        finally:
            vision.pixel_shuffle = real
    assert float((got - want).abs().max() / (want.max() - want.min())) > 1e-3


def test_wrong_image_size_is_refused():
    _, _, ours = reference_and_ours()
    with pytest.raises(ValueError, match=r"takes \[B, 3, 32, 32\]"):
        ours(torch.zeros(1, 3, 64, 64))


def test_muse_glimmer_tower_matches_executorchs():
    """Muse Glimmer's tower against ExecuTorch's MuseGlimmerVisionEncoder, weights copied, fp32, on a
    single-tile and a multi-tile image (host inputs from ExecuTorch's precompute)."""
    from executorch.examples.models.muse_glimmer.model.vision_tower import MuseGlimmerVisionEncoder
    from executorch.examples.models.muse_glimmer.vision.precompute import MuseGlimmerVisionConfig, precompute_vision_inputs

    from pipeline.models.args import GlimmerVisionArgs
    from pipeline.models.vision import GlimmerVisionEncoder

    shape = dict(patch_size=14, patch_temporal=2, downsample_factor=2, sparse_attention_factor=4, latent_dim=32,
                 n_heads=4, n_layers=6, mlp_hidden=64, adapter_dim=48, hidden_size=40, rms_norm_eps=1e-5)
    config = MuseGlimmerVisionConfig(**shape, pos_emb_grid_h=8, pos_emb_grid_w=8, rope_theta=10000.0, encoder_output_dim=128)
    torch.manual_seed(0)
    ref = MuseGlimmerVisionEncoder(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "ln_" in name and name.endswith("weight") else 0.05 * torch.randn_like(p))
    ours = GlimmerVisionEncoder(GlimmerVisionArgs(**shape)).eval()
    renames = {".attn.": ".", ".mlp.": "."}
    theirs = dict(ref.named_parameters())
    mine = dict(ours.named_parameters())
    mapped = {}
    for name in theirs:
        new = name
        for a, b in renames.items():
            new = new.replace(a, b)
        mapped[name] = new
    assert set(mapped.values()) == set(mine), "every weight has a counterpart"
    with torch.no_grad():
        for r_name, o_name in mapped.items():
            mine[o_name].copy_(theirs[r_name])
    table = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    for h, w in ((56, 56), (56, 112 * 5)):  # 4x4 patch grid: one tile; 4x40: several tiles
        image = torch.rand(3, h, w, generator=torch.Generator().manual_seed(h + w)) * 2 - 1
        inputs = precompute_vision_inputs(image, table, config).as_args()
        tiled = not torch.equal(inputs[4], torch.arange(len(inputs[4])))
        assert tiled == (w > 56), "the wide image spans several tiles: the permutation is exercised"
        with torch.no_grad():
            want, got = ref(*inputs).float(), ours(*inputs)
        assert got.shape == want.shape
        assert float((got - want).abs().max() / (want.max() - want.min())) <= 1e-5, (h, w)
    # the same comparison sees the wrong layers attending per tile (on the multi-tile image)
    import dataclasses

    ours.args = dataclasses.replace(ours.args, sparse_attention_factor=3)
    with torch.no_grad():
        want, got = ref(*inputs).float(), ours(*inputs)
    assert float((got - want).abs().max() / (want.max() - want.min())) > 1e-3


def test_muse_glimmer_artifact_method_matches_executorchs_tower():
    """The artifact's method (patches in; positions, RoPE, tilings and masks computed once for the
    exported size) equals ExecuTorch's tower fed the full host precompute of the same image."""
    from executorch.examples.models.muse_glimmer.model.vision_tower import MuseGlimmerVisionEncoder
    from executorch.examples.models.muse_glimmer.vision.precompute import patchify_image, precompute_vision_inputs

    from pipeline.models.args import GlimmerVisionArgs
    from pipeline.models.vision import build_vision, glimmer_config

    args = GlimmerVisionArgs(latent_dim=32, n_heads=4, n_layers=6, mlp_hidden=64, adapter_dim=48, hidden_size=40,
                             image_size=56 * 3, pos_grid=8)  # a 12x12 grid: several tiles
    ours = build_vision(args, 2)
    config = glimmer_config(args)
    ref = MuseGlimmerVisionEncoder(config).eval()
    mine = dict(ours.encoder.named_parameters())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(mine[name.replace(".attn.", ".").replace(".mlp.", ".")])
    image = torch.rand(3, 168, 168, generator=torch.Generator().manual_seed(5)) * 2 - 1
    with torch.no_grad():
        want = ref(*precompute_vision_inputs(image, ours.pos_embed_table.data, config).as_args()).float()
        got = ours(patchify_image(image, config)[0])
    assert got.shape == (1, args.n_image_tokens, 40)
    assert float((got - want).abs().max() / (want.max() - want.min())) <= 1e-5
    identity = torch.arange(args.n_patches)  # the comparison sees a tiling left out of the kept buffers
    ours.sparse_perm.copy_(identity)
    ours.inv_perm.copy_(identity)
    with torch.no_grad():
        wrong = ours(patchify_image(image, config)[0])
    assert float((wrong - want).abs().max() / (want.max() - want.min())) > 1e-3
