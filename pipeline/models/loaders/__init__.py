"""Checkpoints: what a file or directory implies for the config, and its weights under our names.

``model.checkpoint`` is a Hugging Face directory (``config.json`` + safetensors, ``hf.py``) or a
GGUF file (``gguf.py``). Reading the config touches only metadata (no torch); the weights are
read in the export stage and checked tensor by tensor against the built module.
"""

import hashlib
from pathlib import Path

from pipeline.errors import ConfigError


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
    from pipeline.models.loaders import gguf_config

    return gguf_config.read_config(path)


def read_weights(path: str, args, family) -> dict:
    """The checkpoint's tensors under our parameter names, as float32 torch tensors."""
    path = Path(path)
    if _kind(path) == "hf":
        from pipeline.models.loaders import hf

        return hf.read_weights(path, args, family.name)
    from pipeline.models.loaders import gguf

    return gguf.read_weights(path, args, family)


def load_into(model, path: str, family) -> None:
    """Fill ``model`` from the checkpoint; a missing, extra or mis-shaped tensor fails naming it."""
    import torch

    from pipeline.errors import BuildError

    weights = read_weights(path, model.args, family)
    want = model.state_dict()
    problems = [_listed("missing tensor", sorted(set(want) - set(weights)), want),
                _listed("unexpected tensor", sorted(set(weights) - set(want)), weights)]
    if any(problems):
        raise BuildError(f"model.checkpoint={path}: " + "; ".join(p for p in problems if p))
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(want[name].shape):
            settings = ", ".join(f"model.{k}={getattr(model.args, k)}" for k in _shape_settings(name))
            raise BuildError(f"model.checkpoint={path}: tensor {name} has shape {tuple(tensor.shape)}, the model expects "
                             f"{tuple(want[name].shape)} from {settings} (the checkpoint's config says so; the two disagree)")
    with torch.no_grad():
        for name, tensor in weights.items():
            want[name].copy_(tensor)


# the settings a parameter's shape follows from (by a piece of its name)
SHAPES = (("feed_forward", ("dim", "hidden_dim")), ("attention.wq", ("dim", "n_heads", "head_dim")),
          ("attention.wk", ("dim", "n_kv_heads", "head_dim")), ("attention.wv", ("dim", "n_kv_heads", "head_dim")),
          ("attention.wo", ("dim", "n_heads", "head_dim")), ("attention.wg", ("dim", "n_heads", "head_dim")),
          ("_norm.", ("head_dim",)), ("tok_embeddings", ("vocab_size", "dim")), ("output", ("vocab_size", "dim")))


def _shape_settings(name: str) -> tuple[str, ...]:
    for piece, settings in SHAPES:
        if piece in name and not (piece == "_norm." and "attention" not in name):
            return settings
    return ("dim",)


def _listed(what: str, names: list[str], tensors: dict) -> str:
    """'missing tensor a (shape (2, 3)) and 4 more', or '' for none."""
    if not names:
        return ""
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return f"{what} {names[0]} (shape {tuple(tensors[names[0]].shape)}){more}"


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
