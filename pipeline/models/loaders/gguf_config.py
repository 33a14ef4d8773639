"""A GGUF file's metadata as our decoder's settings (``read_config``), read with the ``gguf`` package.

What llama.cpp's converter writes for each architecture, as read here: RoPE scaling as ``{arch}.rope.scaling.*``
(linear, yarn) or as tensors (Llama 3's ``rope_freqs``: a divisor per frequency; Phi-3's ``rope_factors_short/long``
for longrope), partial rotary as ``rope.dimension_count``, windows as ``attention.sliding_window`` (+ its pattern).
What llama.cpp fixes in code rather than in the file is this reader's too (``SWA_PERIOD``, ``LOCAL_BASE``,
``ROPE_LAYERS``, ``_attn_scale``); a metadata key it does not know under the architecture is refused, naming the
file and the key (``KNOWN_KEYS``). The tensors are ``gguf.py``'s."""

from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.models.families import family_of
from pipeline.models.loaders.gguf import _field, _reader, windows


def read_config(path: Path) -> tuple[str, dict]:
    where = f"model.checkpoint={path}"
    reader = _reader(path)
    arch = _field(reader, "general.architecture", where)
    fam = family_of("gguf", arch, where)
    if fam.name == "muse_glimmer":  # ExecuTorch's layout: the tensors say the sizes, the metadata is optional
        from pipeline.models.loaders.glimmer import target_settings

        return fam.name, {**target_settings(reader, where), "context_length": _context_length(reader, arch, where),
                          **fam.options}
    heads = int(_field(reader, f"{arch}.attention.head_count", where))
    dim = int(_field(reader, f"{arch}.embedding_length", where))
    n_layers = int(_field(reader, f"{arch}.block_count", where))
    _refuse_unknown(reader, arch, fam.name, where)
    # the vocabulary: the metadata's, else the tokenizer's, else the embedding's rows (GGUF lists the fastest dim first)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    rows = int(embedding.shape[-1]) if embedding is not None else None
    vocab = _field(reader, f"{arch}.vocab_size", where, default=len(tokens.data) if tokens is not None else rows)
    names = {t.name for t in reader.tensors}
    head_dim = int(_field(reader, f"{arch}.attention.key_length", where, default=dim // heads))
    value_dim = int(_field(reader, f"{arch}.attention.value_length", where, default=head_dim))
    if value_dim != head_dim:
        raise ConfigError(f"{where}: {arch}.attention.value_length={value_dim} differs from attention.key_length="
                          f"{head_dim}; our attention has one head dim for keys and values")
    rotary = int(_field(reader, f"{arch}.rope.dimension_count", where, default=head_dim))
    if rotary > head_dim or rotary % 2:
        raise ConfigError(f"{where}: {arch}.rope.dimension_count={rotary} must be even and at most the head dim {head_dim}")
    norm_eps = _float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", where))
    rope_base = _float(_field(reader, f"{arch}.rope.freq_base", where, default=10000.0))
    local_base = _float(_field(reader, f"{arch}.rope.freq_base_swa", where, default=LOCAL_BASE.get(fam.name, 0.0)))
    settings = {
        "vocab_size": int(vocab), "dim": dim, "n_layers": n_layers, "context_length": _context_length(reader, arch, where),
        "n_heads": heads, "n_kv_heads": int(_field(reader, f"{arch}.attention.head_count_kv", where, default=heads)),
        "head_dim": head_dim, "hidden_dim": int(_field(reader, f"{arch}.feed_forward_length", where)),
        "norm_eps": norm_eps, "rope_base": rope_base,
        "tie_embeddings": "output.weight" not in names,
        **windows(reader, arch, n_layers, SWA_PERIOD.get(fam.name, 0), where),
        "attn_scale": (_float(_field(reader, f"{arch}.attention.scale", where)) if f"{arch}.attention.scale" in reader.fields
                       else _attn_scale(fam.name, dim, heads, head_dim, n_layers)),
        "logit_soft_cap": _float(_field(reader, f"{arch}.final_logit_softcapping", where, default=0.0)),
        "logit_multiplier": _float(_field(reader, f"{arch}.logit_multiplier", where, default=1.0)),
        "mlp_act": "silu",
        "rope_scaling": (scaling := _rope_scaling(reader, arch, rope_base, rotary, where)),
        "rope_dim": 0 if rotary == head_dim else rotary,
        # the sliding layers' own base (unscaled, as llama.cpp runs them), unless it is the flat layers' unscaled one
        "rope_local_base": 0.0 if local_base == rope_base and scaling["type"] == "default" else local_base,
        "rope_layers": ROPE_LAYERS.get(fam.name, ""),
        # options a family leaves to the checkpoint: present when their tensors are
        "qk_norm": "blk.0.attn_q_norm.weight" in names,
        "attn_gate": bool(names & {"blk.0.attn_output_gate.weight", "blk.0.attn_gate.weight"}),
        **({"post_norm_eps": norm_eps} if fam.name in POST_NORM_EPS_IS_NORM_EPS else {}),
        **fam.options,
    }
    if settings["sliding_window"] == 0:
        settings["rope_local_base"] = 0.0  # no ring layers: one base
    return fam.name, settings


# --- llama.cpp's metadata, per architecture -----------------------------------------------------------------
#
# What llama.cpp fixes in code for an architecture, not in the file (src/llama-model.cpp): Gemma 3's 5:1
# local:global pattern (a period of 6: the last layer of each 6 is global) and local RoPE base 10000 unless
# the file says them (attention.sliding_window_pattern, rope.freq_base_swa), its attention scale
# (1/sqrt(dim/heads) for the 27B model, 62 layers; 1/sqrt(head_dim) otherwise); SmolLM3's RoPE on every
# layer but each 4th ((i + 1) % 4 == 0: none). Gemma 3's sandwich norms use the model's norm eps.
SWA_PERIOD = {"gemma3": 6}
LOCAL_BASE = {"gemma3": 10000.0}
ROPE_LAYERS = {"smollm3": "1110"}
POST_NORM_EPS_IS_NORM_EPS = ("gemma3",)

# metadata under "{arch}." that is read (or changes nothing at inference); anything else there is refused:
# a key we do not know may change the model (llama.cpp's converters add keys as models need them)
KNOWN_KEYS = {
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window", "attention.sliding_window_pattern",
    "attention.scale", "final_logit_softcapping", "logit_multiplier",
    "rope.freq_base", "rope.freq_base_swa", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.finetuned",
    "rope.scaling.attn_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_log_multiplier",
    "attention.causal", "expert_count", "expert_used_count",
}
# known keys whose other values our decoder does not compute: key -> (the value it computes, in words)
NEUTRAL = {"rope.scaling.yarn_ext_factor": (1.0, "1 (YaRN's ramp as transformers computes it)"),
           "rope.scaling.yarn_log_multiplier": (0.0, "0 (no DeepSeek-style mscale)"),
           "attention.causal": (True, "true (a causal decoder)"),
           "expert_count": (0, "0 (a dense model)"), "expert_used_count": (0, "0 (a dense model)")}


def _refuse_unknown(reader, arch: str, family: str, where: str) -> None:
    """One line naming the first metadata key under ``arch`` that is not known, or known at a value our decoder
    does not compute."""
    prefix = f"{arch}."
    for key, field in reader.fields.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        if name not in KNOWN_KEYS:
            raise ConfigError(f"{where}: metadata {key} is not understood by the {family} reader (it may change the "
                              f"model); the keys read are {arch}.{{{', '.join(sorted(KNOWN_KEYS))}}}")
        if name in NEUTRAL and field.contents() != NEUTRAL[name][0]:
            raise ConfigError(f"{where}: metadata {key}={field.contents()} is not supported; only {NEUTRAL[name][1]}")


def _context_length(reader, arch: str, where: str) -> int:
    """The positions the model was trained for (``{arch}.context_length``, which llama.cpp's converters write);
    0 where the file does not say (``kv.capacity: null`` then keeps the layout's fixed default)."""
    return int(_field(reader, f"{arch}.context_length", where, default=0))


def _attn_scale(family: str, dim: int, heads: int, head_dim: int, n_layers: int) -> float:
    """The softmax scale llama.cpp uses where the file has no attention.scale (0: 1 / sqrt(head_dim)); Gemma 3's
    query_pre_attn_scalar is dim / heads for its 27B model (62 layers), the head dim for the others."""
    if family == "gemma3":
        return (dim / heads if n_layers == 62 else head_dim) ** -0.5
    return 0.0


def _float(value) -> float:
    """A float32 of the metadata as the shortest decimal that is it (1e-06, not 9.99999997e-07): the value
    the checkpoint's config had."""
    import numpy as np

    return float(str(np.float32(value)))


def _rope_scaling(reader, arch: str, base: float, rotary: int, where: str) -> dict:
    """``ModelArgs.rope_scaling`` (every field) from ``{arch}.rope.scaling.*`` and llama.cpp's factor tensors:
    ``rope_freqs.weight`` (Llama 3's per-frequency divisors; llama.cpp writes no keys for them) and Phi-3's
    ``rope_factors_short/long.weight`` (longrope)."""
    from dataclasses import asdict

    from pipeline.models.args import RopeScaling

    def key(name: str, default=None):
        return _field(reader, f"{arch}.rope.scaling.{name}", where, default=default)

    kind = key("type", "none")
    tensors = {t.name: t for t in reader.tensors}
    original = int(key("original_context_length", 0))
    if "rope_freqs.weight" in tensors:
        if kind != "none":
            raise ConfigError(f"{where}: tensor rope_freqs.weight (llama.cpp's per-frequency RoPE factors) with "
                              f"{arch}.rope.scaling.type={kind}: the two scalings together are not supported")
        return _llama3(_vector(tensors["rope_freqs.weight"], rotary // 2, where), base, rotary, original, where)
    if "rope_factors_short.weight" in tensors or "rope_factors_long.weight" in tensors or kind == "longrope":
        if kind not in ("none", "longrope"):
            raise ConfigError(f"{where}: longrope factor tensors with {arch}.rope.scaling.type={kind} are not supported")
        if not original:
            raise ConfigError(f"{where}: longrope needs {arch}.rope.scaling.original_context_length; the file has none")
        short, long = (_vector(tensors.get(f"rope_factors_{n}.weight"), rotary // 2, where, f"rope_factors_{n}.weight")
                       for n in ("short", "long"))
        context = int(_field(reader, f"{arch}.context_length", where, default=original))
        return asdict(RopeScaling(type="longrope", factor=context / original, original_context=original,
                                  attention_factor=_float(key("attn_factor", 0.0)), short_factor=short, long_factor=long))
    if kind == "none":
        return asdict(RopeScaling())
    factor = _float(key("factor", 0.0))
    if factor <= 0:
        raise ConfigError(f"{where}: {arch}.rope.scaling.type={kind} needs {arch}.rope.scaling.factor > 0")
    if kind == "linear":
        return asdict(RopeScaling(type="linear", factor=factor))
    if kind == "yarn":
        if not original:
            raise ConfigError(f"{where}: yarn needs {arch}.rope.scaling.original_context_length; the file has none")
        factors = {_float(key(n)) for n in ("yarn_attn_factor", "attn_factor") if key(n, "") != ""}
        if len(factors) > 1:
            raise ConfigError(f"{where}: {arch}.rope.scaling.yarn_attn_factor and .attn_factor disagree ({sorted(factors)})")
        return asdict(RopeScaling(type="yarn", factor=factor, original_context=original,
                                  beta_fast=_float(key("yarn_beta_fast", 32.0)), beta_slow=_float(key("yarn_beta_slow", 1.0)),
                                  attention_factor=factors.pop() if factors else 0.0))
    raise ConfigError(f"{where}: {arch}.rope.scaling.type={kind!r} is not supported; supported: none, linear, yarn, "
                      "longrope, and Llama 3's rope_freqs tensor")


def _vector(tensor, length: int, where: str, name: str = "rope_freqs.weight") -> list[float]:
    """A small float tensor (RoPE factors) as a list, checked to hold one value per rotated pair."""
    import gguf
    import numpy as np

    if tensor is None:
        raise ConfigError(f"{where}: tensor {name} is missing (longrope needs both rope_factors_short and _long)")
    values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
    if values.size != length:
        raise ConfigError(f"{where}: tensor {name} has {values.size} values; the model rotates {length} pairs per head")
    return [_float(v) for v in values]


# Llama 3's llama3 RoPE as written by its releases: low_freq_factor 1, high_freq_factor 4, pretrained on 8192
LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context": 8192}


def llama3_divisors(base: float, rotary: int, factor: float, low: float, high: float, original: float) -> list[float]:
    """llama.cpp's ``rope_freqs`` for Llama 3's scaling: per frequency the divisor of the base frequency (numpy-free
    arithmetic, as the config stage reads it before torch)."""
    import math

    out = []
    for i in range(0, rotary, 2):
        wavelength = 2 * math.pi * base ** (i / rotary)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            s = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return out


def _llama3(divisors: list[float], base: float, rotary: int, original: int, where: str) -> dict:
    """``rope_scaling`` llama3 whose divisors are the file's ``rope_freqs``: Llama 3's constants (the original
    context from rope.scaling.original_context_length where given), else the constants fitted to the blended
    band; refused when none reproduces the tensor. (Only original/low and original/high matter, so low is
    kept at 1 when fitting.)"""
    import math
    from dataclasses import asdict

    from pipeline.models.args import RopeScaling

    factor = max(divisors)
    if all(abs(d - 1) < 1e-7 for d in divisors):
        return asdict(RopeScaling())
    candidates = [(LLAMA3["low_freq_factor"], LLAMA3["high_freq_factor"], original or LLAMA3["original_context"])]
    # in the blended band s = (original / wavelength - low) / (high - low), with s from the divisor
    band = [(i, d) for i, d in enumerate(divisors) if 1 + 1e-6 < d < factor - 1e-6]
    if len(band) >= 2:  # s = (original / wavelength - 1) / (high - 1) = a / wavelength + b: two points fix a, b
        (i0, d0), (i1, d1) = band[0], band[-1]
        x0, x1 = (1 / (2 * math.pi * base ** (2 * i / rotary)) for i in (i0, i1))
        s0, s1 = ((1 / d - 1 / factor) / (1 - 1 / factor) for d in (d0, d1))
        a = (s1 - s0) / (x1 - x0)
        b = s0 - a * x0
        if b < 0 < a:
            high = 1 - 1 / b
            candidates.append((1.0, high, a * (high - 1)))
    for low, high, orig in candidates:
        orig = int(round(orig))
        want = llama3_divisors(base, rotary, factor, low, high, orig)
        if all(abs(w - d) <= 1e-5 * d for w, d in zip(want, divisors, strict=True)):
            return asdict(RopeScaling(type="llama3", factor=factor, original_context=orig,
                                      low_freq_factor=low, high_freq_factor=high))
    raise ConfigError(f"{where}: tensor rope_freqs.weight holds RoPE factors that are not Llama 3's scaling (factor "
                      f"{factor:g}, low_freq_factor 1, high_freq_factor 4, original context {candidates[0][2]}, nor a "
                      "fit of its blended band); not supported")
