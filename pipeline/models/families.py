"""Model families: one table of options each over the one decoder of ``models/transformer.py``.

A family names the checkpoints it reads (Hugging Face ``architectures``, GGUF
``general.architecture``) and the decoder options it fixes; everything else (widths, heads,
layers, RoPE base, norm eps, tying) comes from the checkpoint or the preset.
"""

from dataclasses import dataclass, field

from pipeline.errors import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    gguf_architecture: str
    options: dict = field(default_factory=dict)  # ModelArgs values every model of the family has
    # llama.cpp's converter reorders the rows of q and k for these (interleaved RoPE pairs)
    gguf_permutes_qk: bool = False


FAMILIES = {f.name: f for f in (
    Family("llama", ("LlamaForCausalLM",), "llama", {"qkv_bias": False, "qk_norm": False}, gguf_permutes_qk=True),
    Family("qwen2", ("Qwen2ForCausalLM",), "qwen2", {"qkv_bias": True, "qk_norm": False}),
    Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", {"qkv_bias": False, "qk_norm": True}),
    # the model of the system this project grew from (executorch.examples.models.muse_glimmer):
    # weightless q/k norms, sandwich norms, normalised embeddings, interleaved RoPE, no RoPE on its
    # global (flat) layers; whether it has q/k norms and the output gate, and its scales, are the preset's
    Family("muse_glimmer", (), "muse_glimmer", {
        "qkv_bias": False, "qk_norm_weight": False, "post_norms": True, "embed_norm": True,
        "rope_interleaved": True, "flat_layers_nope": True}),
)}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"model.family={name} is not a model family; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(kind: str, architecture: str, where: str) -> Family:
    """The family whose checkpoints say ``architecture`` (kind: "hf" or "gguf")."""
    for f in FAMILIES.values():
        if architecture in (f.hf_architectures if kind == "hf" else (f.gguf_architecture,)):
            return f
    known = sorted(a for f in FAMILIES.values() for a in (f.hf_architectures if kind == "hf" else (f.gguf_architecture,)))
    raise ConfigError(f"{where}: architecture {architecture!r} is not supported; supported: {', '.join(known)}")
