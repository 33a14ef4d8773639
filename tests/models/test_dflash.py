"""The DFlash draft against the published one (dflash==0.1.0's DFlashDraftModel), weights copied
across: block after block, with the draft's history rolled back to the context between blocks."""

import pytest
import torch

from pipeline.kv.op import ReferenceCache, reference_cache
from pipeline.models.args import DraftArgs, default_target_layer_ids
from pipeline.models.dflash import build_draft

dflash = pytest.importorskip("dflash.model")


@pytest.mark.parametrize("n_target,n_draft", [(8, 1), (8, 2), (28, 5), (36, 5), (61, 3)])
def test_default_tapped_layers_are_the_references(n_target, n_draft):
    assert default_target_layer_ids(n_target, n_draft) == dflash.build_target_layer_ids(n_target, n_draft)


def reference_and_ours(n_layers: int = 2, vocab_size: int = 512):
    from transformers import Qwen3Config

    taps = [1, 5]
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=176,
                         num_hidden_layers=n_layers, rms_norm_eps=1e-6, vocab_size=vocab_size, num_target_layers=8,
                         rope_theta=10000.0, dflash_config={"block_size": 4, "target_layer_ids": taps, "mask_token_id": 3})
    torch.manual_seed(0)
    ref = dflash.DFlashDraftModel(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():  # the init leaves norms at 1 and may leave weights at 0
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    args = DraftArgs(block_size=4, num_hidden_layers=n_layers, target_layer_ids=tuple(taps), mask_token_id=3, dim=64,
                     n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=176, norm_eps=1e-6, rope_base=10000.0)
    ours = build_draft(args, 1)
    copy_weights(ref, ours, n_layers)
    return ref, ours


def copy_weights(ref, ours, n_layers: int) -> None:
    """The reference's parameters into ours (dflash's and ExecuTorch's drafts use the same names)."""
    names = {"fc.weight": "fc.weight", "hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
    for i in range(n_layers):
        r, o = f"layers.{i}.", f"layers.{i}."
        names |= {r + "input_layernorm.weight": o + "attention_norm.weight",
                  r + "post_attention_layernorm.weight": o + "ffn_norm.weight",
                  r + "self_attn.q_norm.weight": o + "attention.q_norm.weight",
                  r + "self_attn.k_norm.weight": o + "attention.k_norm.weight",
                  r + "mlp.gate_proj.weight": o + "feed_forward.w1.weight", r + "mlp.up_proj.weight": o + "feed_forward.w3.weight",
                  r + "mlp.down_proj.weight": o + "feed_forward.w2.weight"}
        names |= {r + f"self_attn.{p}_proj.weight": o + f"attention.w{p}.weight" for p in "qkvo"}
    theirs, mine = dict(ref.named_parameters()), dict(ours.named_parameters())
    assert set(names) == set(theirs) and set(names.values()) == set(mine), "every weight has a counterpart"
    with torch.no_grad():
        for r_name, o_name in names.items():
            mine[o_name].copy_(theirs[r_name])


def run_blocks(ref, ours, causal=False, roll_back=True):
    """Three blocks of 4 after contexts of 6, 3 and 1 new positions; the worst relative difference."""
    gen = torch.Generator().manual_seed(2)
    ref_cache = dflash._make_cache(ref.config)
    ours_cache = ReferenceCache(ours.layer_kv(), causal=causal)
    start, worst = 0, 0.0
    for n_ctx in (6, 3, 1):
        features = torch.randn(1, n_ctx, 2 * 64, generator=gen)
        block = torch.randn(1, 4, 64, generator=gen)
        with torch.no_grad():
            want = ref(target_hidden=features, noise_embedding=block, position_ids=torch.arange(start, start + n_ctx + 4)[None],
                       past_key_values=ref_cache, use_cache=True)
            with reference_cache(ours_cache):
                got = ours(features, block, torch.arange(start, start + n_ctx), torch.arange(start + n_ctx, start + n_ctx + 4))
        start += n_ctx
        dflash._crop_to(ref_cache, start)  # the block's rows are scratch
        if roll_back:
            ours_cache.truncate(start)
        worst = max(worst, float((got - want).abs().max() / (want.max() - want.min())))
    return worst


def test_draft_matches_the_published_model():
    ref, ours = reference_and_ours()
    assert run_blocks(ref, ours) <= 1e-5


def test_comparison_can_fail():
    """The same comparison sees a causal draft, and a draft that keeps its scratch block."""
    ref, ours = reference_and_ours()
    assert run_blocks(ref, ours, causal=True) > 1e-3
    assert run_blocks(ref, ours, roll_back=False) > 1e-3


def test_draft_matches_executorchs_muse_glimmer_draft():
    """The same draft is the Muse Glimmer one (ExecuTorch's DFlashDraftModel: context cached per
    layer, the block's K/V never cached, half-split RoPE), block after block."""
    from executorch.examples.models.muse_glimmer.model.dflash_model import DFlashConfig, DFlashDraftModel

    config = DFlashConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=176, vocab_size=512,
                          block_size=4, target_layers=[1, 5], rope_theta=500000.0, norm_eps=1e-5, mask_token_id=3,
                          max_seq_len=128)
    torch.manual_seed(0)
    ref = DFlashDraftModel(config, max_context_length=128).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    ours = build_draft(DraftArgs(block_size=4, num_hidden_layers=2, target_layer_ids=(1, 5), mask_token_id=3, dim=64,
                                 n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=176, norm_eps=1e-5, rope_base=500000.0), 1)
    copy_weights(ref, ours, 2)
    gen = torch.Generator().manual_seed(2)
    cache, start = ReferenceCache(ours.layer_kv(), causal=False), 0
    for n_ctx in (6, 3, 1):
        features, block = torch.randn(1, n_ctx, 128, generator=gen), torch.randn(1, 4, 64, generator=gen)
        with torch.no_grad():
            want = ref(block, features, torch.tensor([start]))
            with reference_cache(cache):
                got = ours(features, block, torch.arange(start, start + n_ctx), torch.arange(start + n_ctx, start + n_ctx + 4))
        start += n_ctx
        cache.truncate(start)
        assert float((got - want).abs().max() / (want.max() - want.min())) <= 1e-5, n_ctx


def _saved_reference(tmp_path, taps):
    """A DFlash checkpoint as the reference writes it (config.json + safetensors), over a 4-layer target."""
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=176,
                         num_hidden_layers=2, rms_norm_eps=1e-6, vocab_size=512, num_target_layers=4, rope_theta=10000.0,
                         dflash_config={"block_size": 4, "target_layer_ids": taps, "mask_token_id": 3})
    torch.manual_seed(0)
    ref = dflash.DFlashDraftModel(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    ref.save_pretrained(tmp_path)
    return ref


def test_a_dflash_checkpoint_loads_through_the_config(tmp_path):
    """draft.checkpoint: its settings replace the preset's, its weights fill the draft, which then
    equals the reference block after block."""
    from conftest import compose_config
    from pipeline.build.plan import resolve, resolve_model
    from pipeline.models.args import model_args
    from pipeline.models.methods import build_draft_model

    ref = _saved_reference(tmp_path, [1, 3])
    cfg = resolve_model(compose_config("draft=dflash", f"draft.checkpoint={tmp_path}"), [])
    resolve(cfg)
    assert (cfg.draft.num_hidden_layers, cfg.draft.block_size, list(cfg.draft.target_layer_ids)) == (2, 4, [1, 3])
    ours = build_draft_model(cfg.draft, model_args(cfg.model))
    assert run_blocks(ref, ours) <= 1e-5


def test_a_dflash_checkpoint_that_does_not_fit_is_refused(tmp_path):
    from conftest import compose_config
    from pipeline.build.plan import resolve, resolve_model
    from pipeline.errors import ConfigError

    _saved_reference(tmp_path, [1, 5])
    with pytest.raises(ConfigError, match=r"draft.target_layer_ids=\[1, 5\] names layer 5, but the target has model.n_layers=4"):
        resolve(resolve_model(compose_config("draft=dflash", f"draft.checkpoint={tmp_path}"), []))
    with pytest.raises(ConfigError, match="has hidden_size=64, but the target has model.dim=96"):
        resolve_model(compose_config("draft=dflash", f"draft.checkpoint={tmp_path}", "model.dim=96"), [])
    with pytest.raises(ConfigError, match="has vocab_size=512, but the target has model.vocab_size=1024"):
        resolve_model(compose_config("draft=dflash", f"draft.checkpoint={tmp_path}", "model.vocab_size=1024"), [])
    with pytest.raises(ConfigError, match="draft.block_size=8 contradicts"):
        resolve_model(compose_config("draft=dflash", f"draft.checkpoint={tmp_path}", "draft.block_size=8"),
                      ["draft.block_size=8"])
