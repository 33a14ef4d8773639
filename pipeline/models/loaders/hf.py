"""Hugging Face checkpoints: ``config.json`` and safetensors (one file, or shards listed by
``model.safetensors.index.json``), read with the ``safetensors`` library."""

import json
from pathlib import Path

from pipeline.errors import BuildError, ConfigError
from pipeline.models.families import family_of
from pipeline.models.loaders.names import rename

# Hugging Face tensor name -> ours ({i}: layer)
NAMES = [
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{}.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{}.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "layers.{}.attention.wq.{}"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "layers.{}.attention.wk.{}"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "layers.{}.attention.wv.{}"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers.{}.attention.wo.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "layers.{}.attention.q_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "layers.{}.attention.k_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "layers.{}.feed_forward.w1.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "layers.{}.feed_forward.w3.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers.{}.feed_forward.w2.weight"),
]


def our_name(name: str) -> str | None:
    return rename(NAMES, name)


def read_config(path: Path) -> tuple[str, dict]:
    where = f"model.checkpoint={path}"
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as err:
        raise ConfigError(f"{where}: config.json is not valid JSON ({err})") from None
    archs = config.get("architectures") or ["(none)"]
    fam = family_of("hf", archs[0], where)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"{where}: RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not supported yet")
    if config.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported yet")
    heads = config["num_attention_heads"]
    settings = {
        "vocab_size": config["vocab_size"], "dim": config["hidden_size"], "n_layers": config["num_hidden_layers"],
        "n_heads": heads, "n_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads, "hidden_dim": config["intermediate_size"],
        "norm_eps": float(config["rms_norm_eps"]), "rope_base": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)), "sliding_window": 0, "layer_pattern": "F",
        **fam.options,
    }
    if config.get("attention_bias") and not settings["qkv_bias"]:
        raise ConfigError(f"{where}: attention_bias=true on a {fam.name} model is not supported")
    return fam.name, settings


def safetensor_files(path: Path, setting: str = "model.checkpoint") -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise BuildError(f"{setting}={path}: no *.safetensors file")
    return files


def read_weights(path: Path, args) -> dict:
    from safetensors import SafetensorError, safe_open

    weights = {}
    for file in safetensor_files(path):
        if not file.is_file():
            raise BuildError(f"model.checkpoint={path}: shard {file.name} listed in the index is missing")
        print(f"  read {file.name}", flush=True)
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    ours = our_name(name)
                    if ours is None:
                        raise BuildError(f"model.checkpoint={path}: {file.name} has tensor {name}, which no model of ours has")
                    if ours == "output.weight" and args.tie_embeddings:
                        continue  # tied: the head is the embedding (some writers save it anyway)
                    weights[ours] = f.get_tensor(name).float()
        except SafetensorError as err:
            raise BuildError(f"model.checkpoint={path}: {file.name} cannot be read ({err})") from None
    return weights
