"""Tiny Muse Glimmer checkpoints in the GGUF layouts ExecuTorch's loaders read
(``executorch.examples.models.muse_glimmer.loaders``), written with gguf's ``GGUFWriter``.

- the target (``checkpoint_loader.load_gguf_model``): ``general.architecture`` muse_glimmer, llama.cpp's
  tensor names; ExecuTorch reads no metadata (its ``MuseGlimmerConfig`` says the rest), so the
  llama.cpp keys are optional here (``metadata=False``: none). Q4_K projections, attn_v / ffn_down /
  attn_output in Q6_K on odd layers (a per-layer bit width), Q4_K embeddings, a Q6_K head, F32 norms,
  the weightless q/k norms as F32 ones: the types ExecuTorch's own test file has.
- the mmproj (``checkpoint_loader.load_mmproj_vision_model``): architecture clip, ``v.*`` / ``mm.*``
  names, Q4_K / Q6_K linears, F32 biases and norms, BF16 patch and position embeddings; no metadata.
- the DFlash draft (``dflash_loader.load_dflash_gguf``): its ``dflash.*`` metadata and names.

K-quant rows are whole super-blocks of 256 values, so every K-quant tensor's input width here is a
multiple of 256. ExecuTorch's GGUF reader takes F32, F16, BF16, Q4_K, Q5_K and Q6_K (not Q8_0).
"""

from pathlib import Path

import gguf
import numpy as np
import torch

from conftest import gguf_metadata
from test_loaders import quantize_k  # Q4_K / Q6_K from floats (the gguf package dequantizes them only)

Q4, Q6 = "Q4_K", "Q6_K"


def tensor_data(values: torch.Tensor | np.ndarray, qtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """``values`` (out, in) as ``qtype``'s bytes (or elements) and the type to pass to ``add_tensor``."""
    kind = gguf.GGMLQuantizationType[qtype]
    values = np.ascontiguousarray(values.detach().float().numpy() if isinstance(values, torch.Tensor) else values, dtype=np.float32)
    if qtype in (Q4, Q6, "Q5_K"):
        return quantize_k(values, qtype), kind
    return gguf.quants.quantize(values, kind), kind


def add(writer: gguf.GGUFWriter, name: str, values, qtype: str = "F32") -> None:
    data, kind = tensor_data(values, qtype)
    writer.add_tensor(name, data, raw_shape=data.shape if kind == gguf.GGMLQuantizationType.F32 else None, raw_dtype=kind)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- the target ---


def target_type(name: str) -> str:
    """The tensor type of a target tensor (GGUF name), as in ExecuTorch's own tiny GGUF."""
    if name == "output.weight":
        return Q6
    if name == "token_embd.weight":
        return Q4
    if "norm" in name:
        return "F32"
    layer, leaf = int(name.split(".")[1]), name.split(".")[2]
    return Q6 if leaf in ("attn_v", "ffn_down", "attn_output") and layer % 2 else Q4


def target_names(n_layers: int) -> list[str]:
    roles = ["attn_q", "attn_k", "attn_v", "attn_output", "attn_output_gate", "attn_norm", "ffn_norm",
             "post_attention_norm", "post_ffw_norm", "ffn_gate", "ffn_up", "ffn_down"]
    return ["token_embd.weight", "output.weight", "output_norm.weight",
            *(f"blk.{i}.{r}.weight" for i in range(n_layers) for r in roles)]


def write_target(path: Path, weights: dict[str, torch.Tensor], config, *, metadata: bool = True,
                 leave_out: tuple[str, ...] = (), change: dict | None = None) -> Path:
    """ExecuTorch's model's ``weights`` (its atomic names: ``MuseGlimmerModel`` unfused) as a GGUF under
    the names its loader maps (``gguf_to_model_key``); ``config`` (a ``MuseGlimmerConfig``) as llama.cpp's
    metadata when ``metadata``. ``leave_out``: GGUF names not written; ``change``: {GGUF name: fn(values)}."""
    from executorch.examples.models.muse_glimmer.loaders.checkpoint_loader import gguf_to_model_key

    to_gguf = {gguf_to_model_key(n): n for n in target_names(config.n_layers) if gguf_to_model_key(n) in weights}
    assert set(to_gguf) == set(weights), f"ExecuTorch's loader names every weight: {sorted(set(weights) - set(to_gguf))}"
    c = config
    w = gguf.GGUFWriter(str(path), "muse_glimmer")
    if metadata:
        windows = [c.layer_window_size(i) for i in range(c.n_layers)]
        w.add_block_count(c.n_layers)
        w.add_embedding_length(c.dim)
        w.add_feed_forward_length(c.ffn_dim)
        w.add_head_count(c.n_heads)
        w.add_head_count_kv(c.n_kv_heads)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_layer_norm_rms_eps(c.norm_eps)
        w.add_rope_freq_base(c.rope_theta)
        w.add_vocab_size(c.vocab_size)
        w.add_sliding_window(max(windows))
        w.add_array("muse_glimmer.attention.sliding_window_pattern", [bool(x) for x in windows])
    for fqn, name in to_gguf.items():
        if name not in leave_out:
            values = weights[fqn].detach().float()
            add(w, name, (change or {}).get(name, lambda v: v)(values), target_type(name))
    if c.use_qk_norm:  # ExecuTorch's q/k norms are weightless; its GGUFs carry them as ones
        for i in range(c.n_layers):
            for n in ("attn_q_norm", "attn_k_norm"):
                add(w, f"blk.{i}.{n}.weight", np.ones(c.head_dim, dtype=np.float32))
    finish(w)
    return path


def glimmer_reference(config, seed: int = 0):
    """ExecuTorch's MuseGlimmerModel (unfused projections) with random weights: linears ~ N(0, 0.05),
    norms around 1, so that a dropped or transposed one shows."""
    from executorch.examples.models.muse_glimmer.model.model import MuseGlimmerModel

    torch.manual_seed(seed)
    ref = MuseGlimmerModel(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return ref


# --- the mmproj (vision tower) ---


def vision_type(name: str) -> str:
    if name.endswith(".bias") or "ln" in name:
        return "F32"
    if name in ("v.patch_embd.weight", "v.position_embd.weight"):
        return "BF16"
    return Q6 if any(leaf in name for leaf in (".attn_v.", ".ffn_down.")) else Q4


def write_mmproj(path: Path, weights: dict[str, torch.Tensor], *, numeric_projector: bool = False,
                 folded_patches: tuple[int, int] | None = None, leave_out: tuple[str, ...] = (),
                 change: dict | None = None, metadata: dict[str, int] | None = None) -> Path:
    """Our Muse Glimmer tower's ``weights`` (``GlimmerImageEncoder``'s names) as an mmproj GGUF under the
    names of our loader's table (``loaders/glimmer_vision.py``; ExecuTorch's loader reading the same
    file checks them). ``numeric_projector``: the 30B file's ``mm.0/1/2`` names; ``folded_patches``:
    (channels, patch_size): the patch embedding as the 30B file's 4-D conv weight, the first temporal
    slot's columns (the loader pads the other slots with zeros); ``metadata``: llama.cpp's clip.vision.*
    integers (ExecuTorch's loader reads none)."""
    from pipeline.models.loaders.glimmer_vision import gguf_names

    w = gguf.GGUFWriter(str(path), "clip")
    for key, value in (metadata or {}).items():
        w.add_uint32(key, value)
    for ours, name in gguf_names(weights, numeric_projector).items():
        if name in leave_out:
            continue
        values = weights[ours].detach().float()
        if folded_patches and name == "v.patch_embd.weight":
            channels, size = folded_patches
            values = values[:, : channels * size * size].reshape(-1, channels, size, size)
        values = (change or {}).get(name, lambda v: v)(values)
        if values.ndim == 4:  # GGUFWriter takes the array as it is; F32 keeps any rank
            add(w, name, values.numpy(), "F32")
        else:
            add(w, name, values, vision_type(name))
    finish(w)
    return path


# --- the DFlash draft ---


def dflash_names(n_layers: int) -> list[str]:
    roles = ["attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm",
             "ffn_gate", "ffn_up", "ffn_down"]
    return ["fc.weight", "enc.output_norm.weight", "output_norm.weight",
            *(f"blk.{i}.{r}.weight" for i in range(n_layers) for r in roles)]


def write_dflash(path: Path, weights: dict[str, torch.Tensor], config, *, metadata: dict | None = None,
                 leave_out: tuple[str, ...] = (), change: dict | None = None) -> Path:
    """ExecuTorch's DFlash draft's ``weights`` (``DFlashDraftModel``'s names) as a GGUF under the names its
    loader maps (``dflash_gguf_to_model_key``), its ``config`` (a ``DFlashConfig``) as the ``dflash.*``
    metadata ``DFlashConfig.from_gguf_metadata`` reads (``metadata``: keys replaced or, None, dropped)."""
    from executorch.examples.models.muse_glimmer.loaders.dflash_loader import dflash_gguf_to_model_key

    c = config
    to_gguf = {dflash_gguf_to_model_key(n): n for n in dflash_names(c.n_layers)}
    assert set(to_gguf) == set(weights), "ExecuTorch's loader names every weight"
    keys = {"dflash.embedding_length": c.dim, "dflash.block_count": c.n_layers, "dflash.attention.head_count": c.n_heads,
            "dflash.attention.head_count_kv": c.n_kv_heads, "dflash.attention.key_length": c.head_dim,
            "dflash.feed_forward_length": c.ffn_dim, "dflash.block_size": c.block_size,
            "dflash.target_layers": list(c.target_layers), "dflash.rope.freq_base": c.rope_theta,
            "dflash.attention.layer_norm_rms_epsilon": c.norm_eps, "tokenizer.ggml.mask_token_id": c.mask_token_id,
            "dflash.context_length": c.max_seq_len} | (metadata or {})
    w = gguf.GGUFWriter(str(path), "dflash")
    gguf_metadata(w, keys)
    for fqn, name in to_gguf.items():
        if name not in leave_out:
            values = (change or {}).get(name, lambda v: v)(weights[fqn].detach().float())
            add(w, name, values, "F32" if "norm" in name else Q4)
    finish(w)
    return path
