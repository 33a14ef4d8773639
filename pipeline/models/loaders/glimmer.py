"""Muse Glimmer's target GGUFs (``general.architecture`` muse_glimmer) as ExecuTorch's loader reads them.

ExecuTorch's ``muse_glimmer.loaders.checkpoint_loader.load_gguf_model`` reads the tensors only: its
``MuseGlimmerConfig`` (the caller's, or its defaults) says everything else. Ours takes what the tensors
fix (vocabulary, width, layers, FFN width, a tied head, q/k norms, the output gate) and llama.cpp's
metadata where the file has it (heads, head dim, norm eps, RoPE base, windows, scales); what neither
says stays the preset's (``model=muse_glimmer_tiny``: ExecuTorch's defaults where they are not sizes).
Metadata that contradicts the tensors is an error naming both. The weights are read by ``gguf.py``.
"""

import re

from pipeline.errors import ConfigError

ARCHITECTURE = "muse_glimmer"

# setting -> (llama.cpp metadata key under the architecture, type), read where present
METADATA = {
    "n_heads": ("attention.head_count", int),
    "n_kv_heads": ("attention.head_count_kv", int),
    "head_dim": ("attention.key_length", int),
    "norm_eps": ("attention.layer_norm_rms_epsilon", float),
    "rope_base": ("rope.freq_base", float),
    "attn_scale": ("attention.scale", float),
    "logit_soft_cap": ("final_logit_softcapping", float),
    "logit_multiplier": ("logit_multiplier", float),
}
# metadata the tensors also say: setting -> key
SIZES = {"vocab_size": "vocab_size", "dim": "embedding_length", "n_layers": "block_count", "hidden_dim": "feed_forward_length"}


def target_settings(reader, where: str) -> dict:
    """{ModelArgs field: value} a Muse Glimmer GGUF implies (``where``: 'model.checkpoint=FILE')."""
    from pipeline.models.loaders.gguf import windows

    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}  # GGUF lists the fastest dim first

    def shape(name: str) -> tuple:
        if name not in shapes:
            raise ConfigError(f"{where}: tensor {name} is missing (a Muse Glimmer GGUF has it)")
        return shapes[name]

    vocab, dim = shape("token_embd.weight")
    layers = {int(m.group(1)) for name in shapes if (m := re.match(r"blk\.(\d+)\.", name))}
    settings = {
        "vocab_size": vocab, "dim": dim, "n_layers": max(layers, default=-1) + 1,
        "hidden_dim": shape("blk.0.ffn_gate.weight")[0], "tie_embeddings": "output.weight" not in shapes,
        "qk_norm": "blk.0.attn_q_norm.weight" in shapes,
        "attn_gate": bool(shapes.keys() & {"blk.0.attn_output_gate.weight", "blk.0.attn_gate.weight"}),
    }
    if settings["n_layers"] == 0:
        raise ConfigError(f"{where}: no blk.<i>.* tensors: the file has no layers")
    for setting, key in SIZES.items():
        field = reader.fields.get(f"{ARCHITECTURE}.{key}")
        if field is not None and int(field.contents()) != settings[setting]:
            raise ConfigError(f"{where}: metadata {ARCHITECTURE}.{key}={field.contents()} contradicts its tensors, "
                              f"which have {setting}={settings[setting]}")
    for setting, (key, kind) in METADATA.items():
        field = reader.fields.get(f"{ARCHITECTURE}.{key}")
        if field is not None:
            settings[setting] = kind(field.contents())
    if reader.fields.get(f"{ARCHITECTURE}.attention.sliding_window") is not None:
        settings |= windows(reader, ARCHITECTURE, settings["n_layers"], where=where)
    return settings
