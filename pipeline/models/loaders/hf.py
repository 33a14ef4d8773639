"""Hugging Face checkpoints: ``config.json`` and safetensors (one file, or shards listed by
``model.safetensors.index.json``), read with the ``safetensors`` library.

``config.json`` is read by the field names ``transformers`` uses (``hf_config.py``); a field the reader
does not understand is refused, naming it. Tensors are renamed by a table per family; Phi-3's fused
projections are split and Gemma's ``(1 + w)`` norms folded into their weights on the way in.
"""

import json
from pathlib import Path

from pipeline.errors import BuildError, ConfigError
from pipeline.models.families import family_of
from pipeline.models.loaders.hf_config import settings_of
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
# Gemma 3 norms around both branches: its post_attention_layernorm is the attention's output norm
GEMMA3_NAMES = [
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{}.post_attn_norm.weight"),
    (r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.weight", "layers.{}.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight", "layers.{}.post_ffn_norm.weight"),
] + NAMES
# Phi-3: q, k, v in one projection and the MLP's gate and up in another, split in `_split`
PHI3_NAMES = [
    (r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight", "layers.{}.attention.wqkv.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight", "layers.{}.feed_forward.w13.weight"),
] + NAMES


def our_name(name: str, family: str = "llama") -> str | None:
    return rename({"gemma3": GEMMA3_NAMES, "phi3": PHI3_NAMES}.get(family, NAMES), name)


def read_config(path: Path) -> tuple[str, dict]:
    where = f"model.checkpoint={path}"
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as err:
        raise ConfigError(f"{where}: config.json is not valid JSON ({err})") from None
    archs = config.get("architectures") or ["(none)"]
    fam = family_of("hf", archs[0], where)
    return fam.name, {**settings_of(config, fam.name, f"{where}: config.json"), **fam.options}


def safetensor_files(path: Path, setting: str = "model.checkpoint") -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise BuildError(f"{setting}={path}: no *.safetensors file")
    return files


def read_weights(path: Path, args, family: str = "llama") -> dict:
    from safetensors import SafetensorError, safe_open

    weights = {}
    for file in safetensor_files(path):
        if not file.is_file():
            raise BuildError(f"model.checkpoint={path}: shard {file.name} listed in the index is missing")
        print(f"  read {file.name}", flush=True)
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    ours = our_name(name, family)
                    if ours is None:
                        raise BuildError(f"model.checkpoint={path}: {file.name} has tensor {name}, which no model of ours has")
                    if ours == "output.weight" and args.tie_embeddings:
                        continue  # tied: the head is the embedding (some writers save it anyway)
                    weights.update(_split(ours, f.get_tensor(name).float(), args, family, f"model.checkpoint={path}"))
        except SafetensorError as err:
            raise BuildError(f"model.checkpoint={path}: {file.name} cannot be read ({err})") from None
    return weights


def _split(ours: str, tensor, args, family: str, where: str) -> dict:
    """{our name: tensor} for one checkpoint tensor: fused projections split, Gemma's norms as 1 + w."""
    fused = {"wqkv.weight": args.n_heads * args.head_dim + 2 * args.n_kv_heads * args.head_dim,
             "w13.weight": 2 * args.hidden_dim}
    for suffix, rows in fused.items():
        if ours.endswith(suffix) and tensor.shape[0] != rows:
            raise BuildError(f"{where}: tensor {ours.removesuffix(suffix)}{suffix} (fused) has {tensor.shape[0]} rows, the model "
                             f"expects {rows}")
    if ours.endswith("wqkv.weight"):
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        stem = ours.removesuffix("wqkv.weight")
        return dict(zip((f"{stem}wq.weight", f"{stem}wk.weight", f"{stem}wv.weight"), tensor.split([q, kv, kv]), strict=True))
    if ours.endswith("w13.weight"):
        stem = ours.removesuffix("w13.weight")
        return dict(zip((f"{stem}w1.weight", f"{stem}w3.weight"), tensor.split([args.hidden_dim, args.hidden_dim]), strict=True))
    if family == "gemma3" and "norm" in ours:  # Gemma's RMSNorm scales by (1 + w), computed in float32 as here
        return {ours: 1.0 + tensor}
    return {ours: tensor}
