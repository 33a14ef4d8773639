"""Checkpoints: what a file or directory implies for the config, and its weights under our names.

``model.checkpoint`` is a Hugging Face directory (``config.json`` + safetensors, ``hf.py``) or a
GGUF file (``gguf.py``). Reading the config touches only metadata (no torch); the weights are
read in the export stage and checked tensor by tensor against the built module.
"""

import hashlib
from pathlib import Path

from pipeline.errors import ConfigError

# the ModelArgs fields a checkpoint decides (anything else comes from the preset)
IMPLIED = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "norm_eps",
           "rope_base", "tie_embeddings", "qkv_bias", "qk_norm", "sliding_window", "layer_pattern")


def _kind(path: Path) -> str:
    if not path.exists():
        raise ConfigError(f"model.checkpoint={path} does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.checkpoint={path} is a directory with no config.json (a Hugging Face checkpoint has one)")
        return "hf"
    if path.suffix == ".gguf":
        return "gguf"
    raise ConfigError(f"model.checkpoint={path} is neither a Hugging Face directory nor a .gguf file")


def checkpoint_config(path: str) -> tuple[str, dict]:
    """(family, {ModelArgs field: value}) that the checkpoint implies."""
    path = Path(path)
    if _kind(path) == "hf":
        from pipeline.models.loaders import hf

        return hf.read_config(path)
    from pipeline.models.loaders import gguf

    return gguf.read_config(path)


def read_weights(path: str, args, family) -> dict:
    """The checkpoint's tensors under our parameter names, as float32 torch tensors."""
    path = Path(path)
    if _kind(path) == "hf":
        from pipeline.models.loaders import hf

        return hf.read_weights(path, args)
    from pipeline.models.loaders import gguf

    return gguf.read_weights(path, args, family)


def load_into(model, path: str, family) -> None:
    """Fill ``model`` from the checkpoint; a missing, extra or mis-shaped tensor fails naming it."""
    import torch

    from pipeline.errors import BuildError

    weights = read_weights(path, model.args, family)
    want = model.state_dict()
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    if missing or extra:
        raise BuildError(f"model.checkpoint={path}: " + "; ".join(
            ([f"missing tensor {missing[0]} (shape {tuple(want[missing[0]].shape)})" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")]
             if missing else []) +
            ([f"unexpected tensor {extra[0]} (shape {tuple(weights[extra[0]].shape)})" + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")]
             if extra else [])))
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(want[name].shape):
            raise BuildError(f"model.checkpoint={path}: tensor {name} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(want[name].shape)}")
    with torch.no_grad():
        for name, tensor in weights.items():
            want[name].copy_(tensor)


def content_hash(path: str) -> str:
    """sha256 over the checkpoint's files (names and bytes): a changed file is a different build."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()
