"""DFlash draft checkpoints: a directory with ``config.json`` (a Qwen3 config with a
``dflash_config``: ``block_size``, ``target_layer_ids``, ``mask_token_id``) and safetensors, as
``dflash``'s ``DFlashDraftModel.save_pretrained`` writes them. No embeddings or head: the target's."""

import json
from pathlib import Path

from pipeline.errors import BuildError, ConfigError
from pipeline.models.loaders import hf
from pipeline.models.loaders.names import rename

NAMES = [
    (r"fc\.weight", "fc.weight"),
    (r"hidden_norm\.weight", "hidden_norm.weight"),
    (r"norm\.weight", "norm.weight"),
    (r"layers\.(\d+)\.input_layernorm\.weight", "layers.{}.attention_norm.weight"),
    (r"layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{}.ffn_norm.weight"),
    (r"layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight", "layers.{}.attention.w{}.weight"),
    (r"layers\.(\d+)\.self_attn\.([qk])_norm\.weight", "layers.{}.attention.{}_norm.weight"),
    (r"layers\.(\d+)\.mlp\.gate_proj\.weight", "layers.{}.feed_forward.w1.weight"),
    (r"layers\.(\d+)\.mlp\.up_proj\.weight", "layers.{}.feed_forward.w3.weight"),
    (r"layers\.(\d+)\.mlp\.down_proj\.weight", "layers.{}.feed_forward.w2.weight"),
]


def _check(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ConfigError(f"draft.checkpoint={path} is not a DFlash checkpoint directory (no config.json)")


def read_config(path: str) -> dict:
    """The ``draft`` settings the checkpoint implies, plus ``hidden_size`` and ``vocab_size`` (the
    target must have them)."""
    path = Path(path)
    _check(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as err:
        raise ConfigError(f"draft.checkpoint={path}: config.json is not valid JSON ({err})") from None
    dflash = config.get("dflash_config") or {}
    heads = config["num_attention_heads"]
    settings = {
        "num_hidden_layers": config["num_hidden_layers"], "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads, "hidden_dim": config["intermediate_size"],
        "norm_eps": float(config["rms_norm_eps"]), "rope_base": float(config.get("rope_theta", 10000.0)),
        "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"],
    }
    for key in ("block_size", "target_layer_ids", "mask_token_id"):
        if dflash.get(key) is not None:
            settings[key] = dflash[key]
    return settings


def load_draft(draft, path: str) -> None:
    """Fill ``draft`` from the checkpoint's tensors, each checked against the module."""
    import torch
    from safetensors import safe_open

    path = Path(path)
    _check(path)
    weights = {}
    for file in hf.safetensor_files(path, "draft.checkpoint"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                ours = rename(NAMES, name)
                if ours is None:
                    raise BuildError(f"draft.checkpoint={path}: {file.name} has tensor {name}, which the draft has not")
                weights[ours] = f.get_tensor(name).float()
    want = draft.state_dict()
    if missing := sorted(set(want) - set(weights)):
        raise BuildError(f"draft.checkpoint={path}: missing tensor {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    with torch.no_grad():
        for name, tensor in weights.items():
            if tuple(tensor.shape) != tuple(want[name].shape):
                raise BuildError(f"draft.checkpoint={path}: tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"the draft expects {tuple(want[name].shape)}")
            want[name].copy_(tensor)
