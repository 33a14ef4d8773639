"""DFlash draft checkpoints, either layout (``draft.checkpoint``):

- a directory with ``config.json`` (a Qwen3 config with a ``dflash_config``: ``block_size``,
  ``target_layer_ids``, ``mask_token_id``) and safetensors, as ``dflash``'s
  ``DFlashDraftModel.save_pretrained`` writes them;
- a ``.gguf`` in the layout of ExecuTorch's Muse Glimmer draft (``muse_glimmer.loaders.dflash_loader``):
  ``dflash.*`` metadata (``DFlashConfig.from_gguf_metadata``'s keys; one absent leaves the preset's
  setting), llama.cpp-style tensor names (``fc``, ``enc.output_norm``, ``output_norm``, ``blk.<i>.*``),
  any tensor type the gguf package dequantizes. Tensors no part of the draft are skipped, as
  ExecuTorch skips them; sliding-window layers are refused (ours attend to the whole context).

No embeddings or head: the target's."""

import json
import re
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


# ExecuTorch's DFlash GGUF names <-> ours ({}: the layer)
GGUF_NAMES = {
    "fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight", "output_norm.weight": "norm.weight",
    "blk.{}.attn_norm.weight": "layers.{}.attention_norm.weight", "blk.{}.ffn_norm.weight": "layers.{}.ffn_norm.weight",
    "blk.{}.attn_q.weight": "layers.{}.attention.wq.weight", "blk.{}.attn_k.weight": "layers.{}.attention.wk.weight",
    "blk.{}.attn_v.weight": "layers.{}.attention.wv.weight", "blk.{}.attn_output.weight": "layers.{}.attention.wo.weight",
    "blk.{}.attn_q_norm.weight": "layers.{}.attention.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "layers.{}.attention.k_norm.weight",
    "blk.{}.ffn_gate.weight": "layers.{}.feed_forward.w1.weight", "blk.{}.ffn_up.weight": "layers.{}.feed_forward.w3.weight",
    "blk.{}.ffn_down.weight": "layers.{}.feed_forward.w2.weight",
}


def _translate(name: str, table: dict[str, str]) -> str | None:
    """``name`` through a table of templates ({}: a layer number), or None."""
    for source, target in table.items():
        if m := re.fullmatch(re.escape(source).replace(r"\{\}", r"(\d+)"), name):
            return target.format(*m.groups())
    return None


# draft setting (or hidden_size: the target's width) -> the dflash.* key ExecuTorch reads
GGUF_KEYS = {
    "hidden_size": "dflash.embedding_length", "num_hidden_layers": "dflash.block_count",
    "n_heads": "dflash.attention.head_count", "n_kv_heads": "dflash.attention.head_count_kv",
    "head_dim": "dflash.attention.key_length", "hidden_dim": "dflash.feed_forward_length",
    "block_size": "dflash.block_size", "target_layer_ids": "dflash.target_layers", "rope_base": "dflash.rope.freq_base",
    "norm_eps": "dflash.attention.layer_norm_rms_epsilon", "mask_token_id": "tokenizer.ggml.mask_token_id",
}


def _is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf"


def _check(path: Path) -> None:
    if _is_gguf(path):
        if not path.is_file():
            raise ConfigError(f"draft.checkpoint={path} does not exist (a DFlash .gguf file)")
        return
    if not (path / "config.json").is_file():
        raise ConfigError(f"draft.checkpoint={path} is not a DFlash checkpoint directory (no config.json)")


def read_config(path: str) -> dict:
    """The ``draft`` settings the checkpoint implies, plus ``hidden_size`` and ``vocab_size`` (the
    target must have them)."""
    path = Path(path)
    _check(path)
    if _is_gguf(path):
        return _gguf_config(path)
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


def _gguf_reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as err:  # truncated or foreign
        raise ConfigError(f"draft.checkpoint={path} is not a readable GGUF file ({err})") from None


def _gguf_config(path: Path) -> dict:
    """The ``draft`` settings a DFlash GGUF's metadata gives (plus ``hidden_size``); its layers must all
    be flat."""
    where = f"draft.checkpoint={path}"
    reader = _gguf_reader(path)
    if "fc.weight" not in {t.name for t in reader.tensors}:
        raise ConfigError(f"{where} has no tensor fc.weight: it is not a DFlash draft")
    settings = {}
    for setting, key in GGUF_KEYS.items():
        if (field := reader.fields.get(key)) is not None:
            value = field.contents()
            settings[setting] = [int(v) for v in value] if setting == "target_layer_ids" else value
    window = reader.fields.get("dflash.attention.sliding_window")
    pattern = reader.fields.get("dflash.attention.sliding_window_pattern")
    if window is not None and pattern is not None and any(pattern.contents()):
        raise ConfigError(f"{where} has sliding-window layers (dflash.attention.sliding_window={window.contents()}, "
                          f"sliding_window_pattern={pattern.contents()}); the draft's layers attend to the whole context")
    return settings


def _gguf_weights(path: Path) -> tuple[dict, dict]:
    """({our name: float32 tensor}, {our name: GGUF name}) of a DFlash GGUF."""
    import gguf
    import numpy as np
    import torch

    where = f"draft.checkpoint={path}"
    weights, names, skipped = {}, {}, []
    for tensor in _gguf_reader(path).tensors:
        ours = _translate(tensor.name, GGUF_NAMES)
        if ours is None:
            if tensor.name == "rope_freqs.weight":  # ExecuTorch ignores it; ours rotates by the RoPE base alone
                if not np.all(gguf.quants.dequantize(tensor.data, tensor.tensor_type) == 1):
                    raise BuildError(f"{where}: tensor rope_freqs.weight is not all ones, and the draft has no such parameter")
                continue
            skipped.append(tensor.name)
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dimension first
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        except (ValueError, NotImplementedError) as err:
            raise BuildError(f"{where}: tensor {tensor.name} ({tensor.tensor_type.name}, {shape}) cannot be read: {err}") from None
        weights[ours], names[ours] = torch.from_numpy(np.ascontiguousarray(values)), tensor.name
    if skipped:
        print(f"  skipped {len(skipped)} tensors no part of the draft: {', '.join(skipped[:4])}", flush=True)
    return weights, names


def load_draft(draft, path: str) -> None:
    """Fill ``draft`` from the checkpoint's tensors, each checked against the module; a missing one is
    an error naming the file and the tensor."""
    import torch

    path = Path(path)
    _check(path)
    names = {}
    if _is_gguf(path):
        weights, names = _gguf_weights(path)
    else:
        weights = _hf_weights(path)
    want = draft.state_dict()
    if missing := sorted(set(want) - set(weights)):
        inverse = {v: k for k, v in GGUF_NAMES.items()}
        first = f"{_translate(missing[0], inverse)} ({missing[0]})" if _is_gguf(path) else missing[0]
        raise BuildError(f"draft.checkpoint={path}: missing tensor {first}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    with torch.no_grad():
        for name, tensor in weights.items():
            if tuple(tensor.shape) != tuple(want[name].shape):
                raise BuildError(f"draft.checkpoint={path}: tensor {names.get(name, name)} has shape {tuple(tensor.shape)}, "
                                 f"the draft expects {tuple(want[name].shape)}" + (f" ({name})" if name in names else ""))
            want[name].copy_(tensor)


def _hf_weights(path: Path) -> dict:
    from safetensors import safe_open

    weights = {}
    for file in hf.safetensor_files(path, "draft.checkpoint"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                ours = rename(NAMES, name)
                if ours is None:
                    raise BuildError(f"draft.checkpoint={path}: {file.name} has tensor {name}, which the draft has not")
                weights[ours] = f.get_tensor(name).float()
    return weights
