"""GGUF files (llama.cpp's format), read with the ``gguf`` package: metadata -> config,
tensors dequantized by the package's own dequantizers, llama.cpp's q/k row order undone."""

from pathlib import Path

from pipeline.errors import BuildError, ConfigError
from pipeline.models.families import family_of
from pipeline.models.loaders.names import rename

# tensor types read (the gguf package dequantizes each of them)
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_K")

NAMES = [
    (r"token_embd\.weight", "tok_embeddings.weight"),
    (r"output_norm\.weight", "norm.weight"),
    (r"output\.weight", "output.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "layers.{}.attention_norm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "layers.{}.ffn_norm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", "layers.{}.attention.wq.{}"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", "layers.{}.attention.wk.{}"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", "layers.{}.attention.wv.{}"),
    (r"blk\.(\d+)\.attn_output\.weight", "layers.{}.attention.wo.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", "layers.{}.attention.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", "layers.{}.attention.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", "layers.{}.feed_forward.w1.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", "layers.{}.feed_forward.w3.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", "layers.{}.feed_forward.w2.weight"),
]


def our_name(name: str) -> str | None:
    return rename(NAMES, name)


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as err:  # a truncated or foreign file
        raise ConfigError(f"model.checkpoint={path} is not a readable GGUF file ({err})") from None


def _field(reader, key: str, where: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ConfigError(f"{where}: the GGUF metadata has no {key}")
        return default
    return field.contents()


def read_config(path: Path) -> tuple[str, dict]:
    where = f"model.checkpoint={path}"
    reader = _reader(path)
    arch = _field(reader, "general.architecture", where)
    fam = family_of("gguf", arch, where)
    heads = _field(reader, f"{arch}.attention.head_count", where)
    dim = _field(reader, f"{arch}.embedding_length", where)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size", where, default=len(tokens.data) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    settings = {
        "vocab_size": int(vocab), "dim": int(dim), "n_layers": int(_field(reader, f"{arch}.block_count", where)),
        "n_heads": int(heads), "n_kv_heads": int(_field(reader, f"{arch}.attention.head_count_kv", where, default=heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", where, default=dim // heads)),
        "hidden_dim": int(_field(reader, f"{arch}.feed_forward_length", where)),
        "norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", where)),
        "rope_base": float(_field(reader, f"{arch}.rope.freq_base", where, default=10000.0)),
        "tie_embeddings": "output.weight" not in names, "sliding_window": 0, "layer_pattern": "F",
        **fam.options,
    }
    scaling = reader.fields.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling.contents() != "none":
        raise ConfigError(f"{where}: RoPE scaling {scaling.contents()!r} is not supported yet")
    return fam.name, settings


def _unpermute(w, n_heads: int):
    """llama.cpp stores q/k rows so that RoPE pairs are adjacent (interleaved); ours rotate halves,
    as Hugging Face's do: rows [h, pair, 2] -> [h, 2, pair]."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_weights(path: Path, args, family) -> dict:
    import gguf
    import numpy as np
    import torch

    where = f"model.checkpoint={path}"
    reader = _reader(path)
    weights = {}
    for i, tensor in enumerate(reader.tensors):
        ours = our_name(tensor.name)
        if ours is None:
            raise BuildError(f"{where}: tensor {tensor.name}, which no model of ours has")
        kind = tensor.tensor_type.name
        if kind not in TYPES:
            raise BuildError(f"{where}: tensor {tensor.name} is of type {kind}, which is not read; supported: {', '.join(TYPES)}")
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dimension first
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        except ValueError as err:
            raise BuildError(f"{where}: tensor {tensor.name} ({kind}, {shape}) cannot be read: {err}") from None
        if family.gguf_permutes_qk and ours.endswith(("wq.weight", "wk.weight")):
            values = _unpermute(values, args.n_heads if ours.endswith("wq.weight") else args.n_kv_heads)
        weights[ours] = torch.from_numpy(np.ascontiguousarray(values))
        if (i + 1) % 50 == 0 or i + 1 == len(reader.tensors):
            print(f"  dequantized {i + 1}/{len(reader.tensors)} tensors", flush=True)
    return weights
