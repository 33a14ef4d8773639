"""Model families: one table of options each over the one decoder of ``models/transformer.py``.

A family names the checkpoints it reads (Hugging Face ``architectures``, GGUF
``general.architecture``) and the decoder options it fixes; everything else (widths, heads,
layers, RoPE base, norm eps, tying) comes from the checkpoint or the preset.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.errors import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    options: dict = field(default_factory=dict)  # ModelArgs values every model of the family has
    # llama.cpp's converter reorders the rows of q and k for these (interleaved RoPE pairs)
    gguf_permutes_qk: bool = False
    # the model config -> {setting: value} for the settings the family derives from others where the
    # config leaves them 0 (an explicit value wins); applied after the options (roles/target.py)
    derive: Callable[..., dict] | None = None


# ExecuTorch's MuseGlimmerModel folds its q/k-norm query scale, this over sqrt(head_dim), into SDPA's
# 1 / sqrt(head_dim); its FFN width is int(ffn_dim_multiplier * dim) (MuseGlimmerConfig.ffn_dim)
GLIMMER_QUERY_SCALE = 43.7840518911


def glimmer_derived(model) -> dict:
    """Muse Glimmer's settings as ExecuTorch's model derives them: ``attn_scale`` from the head dim,
    ``hidden_dim`` from ``dim`` and ``ffn_dim_multiplier``, each where the config has 0."""
    derived = {}
    if not model["attn_scale"]:
        head_dim = model["head_dim"] or model["dim"] // model["n_heads"]
        derived["attn_scale"] = GLIMMER_QUERY_SCALE / math.sqrt(head_dim) / math.sqrt(head_dim)
    if not model["hidden_dim"]:
        if model["ffn_dim_multiplier"] <= 0:
            raise ConfigError(f"model.hidden_dim=0 (derived) needs model.ffn_dim_multiplier > 0, not "
                              f"{model['ffn_dim_multiplier']}: Muse Glimmer's FFN width is int(ffn_dim_multiplier * dim)")
        derived["hidden_dim"] = int(model["ffn_dim_multiplier"] * model["dim"])
    return derived


FAMILIES = {f.name: f for f in (
    # Llama 2/3.x (RoPE scaling llama3 and the rest: models/rope.py); SmolLM2 is one
    Family("llama", ("LlamaForCausalLM",), ("llama",), {"qkv_bias": False, "qk_norm": False}, gguf_permutes_qk=True),
    # Llama with an optional sliding window on every layer; llama.cpp writes Mistral 7B as "llama"
    Family("mistral", ("MistralForCausalLM",), (), {"qkv_bias": False, "qk_norm": False}),
    # Qwen2 / Qwen2.5: q/k/v biases; use_sliding_window slides the layers from max_window_layers on
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), {"qkv_bias": True, "qk_norm": False}),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), {"qkv_bias": False, "qk_norm": True}),
    # Gemma 3 (text): GeGLU, embeddings times sqrt(dim), (1 + w) norms (folded into the weights at load),
    # sandwich norms, q/k norms, 5 local : 1 global layers, each kind with its RoPE base
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3",), {
        "qkv_bias": False, "qk_norm": True, "post_norms": True, "mlp_act": "gelu_tanh", "embed_scale": True}),
    # Phi-3 / Phi-4-mini: fused qkv and gate_up projections (split at load), partial rotary, longrope
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), {"qkv_bias": False, "qk_norm": False}),
    # SmolLM3: Llama with no RoPE on every no_rope_layer_interval-th layer
    Family("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), {"qkv_bias": False, "qk_norm": False},
           gguf_permutes_qk=True),
    # the model of the system this project grew from (executorch.examples.models.muse_glimmer):
    # weightless q/k norms, sandwich norms, normalised embeddings, interleaved RoPE, no RoPE on its
    # global (flat) layers; whether it has q/k norms and the output gate, and its logit scales, are the
    # preset's; its attention scale and FFN width derived as ExecuTorch's model derives them
    Family("muse_glimmer", (), ("muse_glimmer",), {
        "qkv_bias": False, "qk_norm_weight": False, "post_norms": True, "embed_norm": True,
        "rope_interleaved": True, "flat_layers_nope": True}, derive=glimmer_derived),
)}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"model.family={name} is not a model family; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(kind: str, architecture: str, where: str) -> Family:
    """The family whose checkpoints say ``architecture`` (kind: "hf" or "gguf")."""
    for f in FAMILIES.values():
        if architecture in (f.hf_architectures if kind == "hf" else f.gguf_architectures):
            return f
    known = sorted(a for f in FAMILIES.values() for a in (f.hf_architectures if kind == "hf" else f.gguf_architectures))
    raise ConfigError(f"{where}: architecture {architecture!r} is not supported; supported: {', '.join(known)}")
