"""GGUF files (llama.cpp's format), read with the ``gguf`` package: metadata -> config,
tensors dequantized by the package's own dequantizers, llama.cpp's q/k row order undone."""

import functools
import re
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
    # Muse Glimmer (the names of executorch.examples.models.muse_glimmer.loaders.checkpoint_loader)
    (r"blk\.(\d+)\.attn_(?:output_gate|gate)\.weight", "layers.{}.attention.wg.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", "layers.{}.post_attn_norm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", "layers.{}.post_ffn_norm.weight"),
]

# Tensors some converters write for parameters our model does not have because they are constant:
# llama.cpp's RoPE frequency factors, and the q/k norms of a model with qk_norm_weight=False
# (Muse Glimmer's GGUFs carry its weightless norms as ones). Read, checked to be ones, dropped.
ONES = re.compile(r"rope_freqs\.weight|blk\.\d+\.attn_[qk]_norm\.weight")

# metadata beyond llama's, where the architecture has it (llama.cpp's key names; the last is ours)
#   {arch}.attention.sliding_window          window of the sliding-window layers
#   {arch}.attention.sliding_window_pattern  per layer, true = sliding window (else every layer slides)
#   {arch}.attention.scale                   the attention's score scale (default 1/sqrt(head_dim))
#   {arch}.final_logit_softcapping           logit soft cap (Gemma 2 style)
#   {arch}.logit_multiplier                  factor on the logits (Muse Glimmer's output_multiplier)


def our_name(name: str) -> str | None:
    return rename(NAMES, name)


def _reader(path: Path):
    """The file's ``GGUFReader``, opened once per process while the file is unchanged: parsing the
    metadata (SmolLM2's 49152-token vocabulary) takes ~3.7 s on 2 cores, and a build reads the
    config, the weights and their quant types in several stages.  The reader is read-only (a memory
    map of the file)."""
    try:
        stat = Path(path).stat()
        return _open_reader(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    except (ValueError, OSError, IndexError) as err:  # missing, truncated or foreign
        raise ConfigError(f"model.checkpoint={path} is not a readable GGUF file ({err})") from None


@functools.lru_cache(maxsize=2)  # keyed by size and mtime too: a rewritten file is read again
def _open_reader(path: str, size: int, mtime_ns: int):
    import gguf

    return gguf.GGUFReader(path)


def _field(reader, key: str, where: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ConfigError(f"{where}: the GGUF metadata has no {key}")
        return default
    return field.contents()


def token_count(path: Path) -> int:
    """The size of the file's tokenizer vocabulary (``tokenizer.ggml.tokens``)."""
    return len(_reader(path).fields["tokenizer.ggml.tokens"].data)


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
        "tie_embeddings": "output.weight" not in names,
        **_windows(reader, arch, int(_field(reader, f"{arch}.block_count", where))),
        "attn_scale": float(_field(reader, f"{arch}.attention.scale", where, default=0.0)),
        "logit_soft_cap": float(_field(reader, f"{arch}.final_logit_softcapping", where, default=0.0)),
        "logit_multiplier": float(_field(reader, f"{arch}.logit_multiplier", where, default=1.0)),
        # options a family leaves to the checkpoint: present when their tensors are
        "qk_norm": "blk.0.attn_q_norm.weight" in names,
        "attn_gate": bool(names & {"blk.0.attn_output_gate.weight", "blk.0.attn_gate.weight"}),
        **fam.options,
    }
    scaling = reader.fields.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling.contents() != "none":
        raise ConfigError(f"{where}: RoPE scaling {scaling.contents()!r} is not supported yet")
    return fam.name, settings


def _windows(reader, arch: str, n_layers: int) -> dict:
    window = int(_field(reader, f"{arch}.attention.sliding_window", "", default=0) or 0)
    if window == 0:
        return {"sliding_window": 0, "layer_pattern": "F"}
    pattern = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
    sliding = [bool(x) for x in pattern.contents()] if pattern is not None else [True] * n_layers
    return {"sliding_window": window, "layer_pattern": "".join("R" if s else "F" for s in sliding)}


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
        if ONES.fullmatch(tensor.name) and (tensor.name == "rope_freqs.weight" or not args.qk_norm_weight):
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            if not np.all(values == 1):
                raise BuildError(f"{where}: tensor {tensor.name} is not all ones, and our model has no such parameter")
            continue
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
