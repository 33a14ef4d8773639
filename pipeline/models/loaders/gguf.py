"""GGUF files (llama.cpp's format), read with the ``gguf`` package: the reader, and the tensors under our
names, dequantized by the package's own dequantizers, llama.cpp's q/k row order undone (the metadata -> config:
``gguf_config.py``).

Architectures (``general.architecture``; each a family's ``gguf_architectures``): llama (Llama 2/3.x, and
Mistral, which llama.cpp writes as llama), qwen2, qwen3, gemma3, phi3, smollm3, muse_glimmer (``glimmer.py``).
What llama.cpp's converter writes for each, as read here: RoPE scaling as ``{arch}.rope.scaling.*`` (linear,
yarn) or as tensors (Llama 3's ``rope_freqs``: a divisor per frequency; Phi-3's ``rope_factors_short/long``
for longrope), partial rotary as ``rope.dimension_count``, windows as ``attention.sliding_window`` (+ its
pattern), Gemma 3's norms stored as 1 + w (our RMSNorm multiplies by the stored weight), Phi-3's fused
``attn_qkv`` and gate+up ``ffn_up`` (split by rows). What llama.cpp fixes in code rather than in the file is
this reader's too (``SWA_PERIOD``, ``LOCAL_BASE``, ``ROPE_LAYERS``, ``_attn_scale``); a metadata key it does
not know under the architecture is refused, naming the file and the key (``KNOWN_KEYS``)."""

import functools
import re
from pathlib import Path

from pipeline.errors import BuildError, ConfigError
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

# Tensors some converters write for parameters our model does not have because they are constant: the q/k
# norms of a model with qk_norm_weight=False (Muse Glimmer's GGUFs carry its weightless norms as ones). Read,
# checked to be ones, dropped. (llama.cpp's RoPE factor tensors: ROPE_FACTORS.)
ONES = re.compile(r"rope_freqs\.weight|blk\.\d+\.attn_[qk]_norm\.weight")

# metadata beyond llama's, where the architecture has it (llama.cpp's key names; the last is ours)
#   {arch}.attention.sliding_window          window of the sliding-window layers
#   {arch}.attention.sliding_window_pattern  per layer, true = sliding window; or llama.cpp's period p
#                                            (layer i slides when i % p < p - 1); none: every layer slides
#                                            (Gemma 3: llama.cpp's period 6)
#   {arch}.rope.freq_base_swa                RoPE base of the sliding layers (Gemma 3: 10000 when absent)
#   {arch}.rope.dimension_count              rotated dims per head (partial rotary: Phi-3)
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


def windows(reader, arch: str, n_layers: int, period: int = 0, where: str = "") -> dict:
    """``sliding_window`` and ``layer_pattern`` (R: sliding, F: flat) from attention.sliding_window and
    attention.sliding_window_pattern: per layer (true = sliding), or llama.cpp's period p (layer i slides when
    i % p < p - 1; 0: every layer); without a pattern, ``period`` (the architecture's own, 0: every layer)."""
    window = int(_field(reader, f"{arch}.attention.sliding_window", where, default=0) or 0)
    if window == 0:
        return {"sliding_window": 0, "layer_pattern": "F"}
    pattern = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
    value = pattern.contents() if pattern is not None else period
    if isinstance(value, list):
        if len(value) != n_layers:
            raise ConfigError(f"{where}: {arch}.attention.sliding_window_pattern has {len(value)} entries for "
                              f"{n_layers} layers")
        sliding = [bool(x) for x in value]
    else:
        sliding = [int(value) == 0 or i % int(value) < int(value) - 1 for i in range(n_layers)]
    return {"sliding_window": window, "layer_pattern": "".join("R" if s else "F" for s in sliding)}


def token_count(path: Path) -> int:
    """The size of the file's tokenizer vocabulary (``tokenizer.ggml.tokens``)."""
    return len(_reader(path).fields["tokenizer.ggml.tokens"].data)


def _unpermute(w, n_heads: int):
    """llama.cpp stores q/k rows so that RoPE pairs are adjacent (interleaved); ours rotate halves,
    as Hugging Face's do: rows [h, pair, 2] -> [h, 2, pair]."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


# RoPE factors llama.cpp writes beside the weights (Llama 3's divisors; Phi-3's longrope factors): not
# parameters; read_config took the scaling from them, read_weights checks them against the model's
# Phi-3's ffn_up holds the gate's rows then the up projection's (Hugging Face's gate_up_proj as it is)
FUSED_GATE_UP = ("phi3",)
ROPE_FACTORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
# Phi-3's fused projections, split by rows: q, k, v (their head counts) and, for FUSED_GATE_UP, gate then up
FUSED_QKV = re.compile(r"blk\.(\d+)\.attn_qkv\.(weight|bias)")
FUSED_UP = re.compile(r"blk\.(\d+)\.ffn_up\.weight")


def read_weights(path: Path, args, family) -> dict:
    import numpy as np
    import torch

    where = f"model.checkpoint={path}"
    reader = _reader(path)
    weights = {}
    for i, tensor in enumerate(reader.tensors):
        if tensor.name in ROPE_FACTORS:
            _check_rope_factors(tensor.name, _dequantized(tensor, where).reshape(-1), args, where)
            continue
        if ONES.fullmatch(tensor.name) and not args.qk_norm_weight:
            if not np.all(_dequantized(tensor, where) == 1):
                raise BuildError(f"{where}: tensor {tensor.name} is not all ones, and our model has no such parameter")
            continue
        for ours, values in _ours(tensor.name, _dequantized(tensor, where), args, family, where):
            if family.gguf_permutes_qk and ours.endswith(("wq.weight", "wk.weight", "wq.bias", "wk.bias")):
                heads = args.n_heads if ".wq." in ours else args.n_kv_heads
                values = _unpermute(values, heads) if values.ndim == 2 else _unpermute(values[:, None], heads)[:, 0]
            weights[ours] = torch.from_numpy(np.ascontiguousarray(values))
        if (i + 1) % 50 == 0 or i + 1 == len(reader.tensors):
            print(f"  dequantized {i + 1}/{len(reader.tensors)} tensors", flush=True)
    missing = [name for name in expected_names(args) if name not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise BuildError(f"{where}: tensor {gguf_name(missing[0], family)} is missing{more}; the model's "
                         f"{missing[0]} has no weights")
    return weights


def _dequantized(tensor, where: str):
    """A tensor's values as float32, in our dimension order (GGUF lists the fastest dimension first)."""
    import gguf
    import numpy as np

    kind = tensor.tensor_type.name
    if kind not in TYPES:
        raise BuildError(f"{where}: tensor {tensor.name} is of type {kind}, which is not read; supported: {', '.join(TYPES)}")
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
    except ValueError as err:
        raise BuildError(f"{where}: tensor {tensor.name} ({kind}, {shape}) cannot be read: {err}") from None


def _ours(name: str, values, args, family, where: str) -> list[tuple[str, object]]:
    """(our parameter, its values) for a GGUF tensor: one, or the parts of a fused one."""
    parts = fused_parts(name, args, family)
    if parts is None:
        ours = our_name(name)
        if ours is None:
            raise BuildError(f"{where}: tensor {name}, which no model of ours has")
        return [(ours, values)]
    rows = parts[-1][2]
    if values.shape[0] != rows:
        raise BuildError(f"{where}: tensor {name} has {values.shape[0]} rows; its parts {', '.join(p[0] for p in parts)} "
                         f"have {' + '.join(str(stop - start) for _, start, stop in parts)}")
    return [(ours, values[start:stop]) for ours, start, stop in parts]


def fused_parts(name: str, args, family) -> list[tuple[str, int, int]] | None:
    """Our parameters a fused GGUF tensor holds, each as its rows [start, stop) of the tensor (Phi-3's attn_qkv:
    q, k, v; its ffn_up: gate, then up); None for a tensor that is not fused. Rows split whole quantized blocks
    (a block is 32 columns of one row), so a block format's rows split the same way."""
    if m := FUSED_QKV.fullmatch(name):
        layer, kind = m.groups()
        sizes = [("wq", args.n_heads * args.head_dim), ("wk", args.n_kv_heads * args.head_dim),
                 ("wv", args.n_kv_heads * args.head_dim)]
        names = [f"layers.{layer}.attention.{k}.{kind}" for k, _ in sizes]
    elif family.name in FUSED_GATE_UP and (m := FUSED_UP.fullmatch(name)):
        sizes = [("w1", args.hidden_dim), ("w3", args.hidden_dim)]
        names = [f"layers.{m.group(1)}.feed_forward.{k}.weight" for k, _ in sizes]
    else:
        return None
    out, start = [], 0
    for ours, (_, rows) in zip(names, sizes, strict=True):
        out.append((ours, start, start + rows))
        start += rows
    return out


def _check_rope_factors(name: str, values, args, where: str) -> None:
    """The file's RoPE factors equal the ones the model computes with (``models/rope.py``, from the
    config read_config took from this file, or an override of it)."""
    import numpy as np

    s = args.rope_scaling
    if name == "rope_freqs.weight":
        if s.type == "llama3":
            from pipeline.models.rope import base_frequencies, frequencies

            scaled, _ = frequencies(args.rope_base, args.rotary_dim, s)
            want = (base_frequencies(args.rope_base, args.rotary_dim) / scaled).double().numpy()
        else:
            want = np.ones(args.rotary_dim // 2)
        what = f"model.rope_scaling (type {s.type})"
    else:
        want = (s.short_factor if "short" in name else s.long_factor) if s.type == "longrope" else None
        what = f"model.rope_scaling.{'short' if 'short' in name else 'long'}_factor (type {s.type})"
    if want is None or len(want) != values.size or not np.allclose(values, want, rtol=1e-5, atol=0):
        raise BuildError(f"{where}: tensor {name} holds RoPE factors {np.round(values, 4).tolist()} that are not "
                         f"{what}'s {None if want is None else np.round(np.asarray(want), 4).tolist()}")


def expected_names(args) -> list[str]:
    """Our Transformer's parameters for ``args`` (``models/transformer.py``), in file order."""
    names = ["tok_embeddings.weight"]
    for i in range(args.n_layers):
        layer = f"layers.{i}."
        names += [layer + "attention_norm.weight"]
        names += [f"{layer}attention.w{p}.{k}" for p in "qkv" for k in ("weight", "bias")[:1 + args.qkv_bias]]
        names += [layer + "attention.wo.weight"]
        names += [f"{layer}attention.{p}_norm.weight" for p in "qk" if args.qk_norm and args.qk_norm_weight]
        names += [layer + "attention.wg.weight"] * bool(args.attn_gate)
        names += [layer + "post_attn_norm.weight"] * bool(args.post_norms)
        names += [layer + "ffn_norm.weight"] + [f"{layer}feed_forward.w{j}.weight" for j in (1, 3, 2)]
        names += [layer + "post_ffn_norm.weight"] * bool(args.post_norms)
    return names + ["norm.weight"] + ["output.weight"] * (not args.tie_embeddings)


def gguf_name(ours: str, family) -> str:
    """The GGUF tensor llama.cpp's layout holds our parameter ``ours`` in (a fused one for Phi-3)."""
    if m := re.fullmatch(r"layers\.(\d+)\.attention\.w[qkv]\.(weight|bias)", ours):
        if family.name in FUSED_GATE_UP:
            return f"blk.{m.group(1)}.attn_qkv.{m.group(2)}"
    if family.name in FUSED_GATE_UP and (m := re.fullmatch(r"layers\.(\d+)\.feed_forward\.w[13]\.weight", ours)):
        return f"blk.{m.group(1)}.ffn_up.weight"
    for pattern, template in NAMES:
        if m := re.fullmatch(re.escape(template).replace(r"\{\}", "([^.]+)"), ours):
            groups = iter(m.groups())
            filled = re.sub(r"\((\?:)?([^()]*)\)", lambda g: g.group(2).split("|")[0] if g.group(1) else next(groups),
                            pattern)
            return filled.replace("\\", "")
    return ours
