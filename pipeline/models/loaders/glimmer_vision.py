"""Muse Glimmer's vision tower from an mmproj GGUF, in the layout ExecuTorch's
``muse_glimmer.loaders.checkpoint_loader.load_mmproj_vision_model`` reads (``vision.checkpoint``).

The names: ``v.patch_embd`` (the patch linear [latent, patch_dim], or the 30B file's 4-D conv weight
[latent, 3, p, p] of one temporal slot: the other slots' columns are zeros), ``v.position_embd`` (the
position table [grid^2, latent]), ``v.pre_ln`` / ``v.post_ln``, ``v.blk.<i>.{attn_q, attn_k, attn_v,
attn_out, ffn_up, ffn_down, ln1, ln2}`` (weights and biases), ``mm.adapter_fc`` / ``mm.adapter_proj`` /
``mm.vision_proj`` (or the 30B file's ``mm.0`` / ``mm.1`` / ``mm.2``). ExecuTorch reads no metadata
(its ``MuseGlimmerVisionConfig`` says the rest); ours takes the sizes the tensors fix and llama.cpp's
``clip.vision.attention.head_count`` / ``clip.vision.patch_size`` where the file has them. Tensors no
part of the tower are skipped, as ExecuTorch skips them. Read with the ``gguf`` package.
"""

import math
import re
from pathlib import Path

from pipeline.errors import BuildError, ConfigError

LAYER = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_out": "o_proj", "ffn_up": "c_fc",
         "ffn_down": "c_proj", "ln1": "ln_1", "ln2": "ln_2"}
TOP = {
    "v.patch_embd.weight": "encoder.conv1_linear.weight",
    "v.position_embd.weight": "pos_embed_table",
    "v.pre_ln.weight": "encoder.ln_pre.weight", "v.pre_ln.bias": "encoder.ln_pre.bias",
    "v.post_ln.weight": "encoder.ln_post.weight", "v.post_ln.bias": "encoder.ln_post.bias",
    "mm.adapter_fc.weight": "encoder.adapter_fc.weight",
    "mm.adapter_proj.weight": "encoder.adapter_proj.weight",
    "mm.vision_proj.weight": "encoder.vision_proj.weight",
}
NUMERIC = {"mm.0.weight": "mm.adapter_fc.weight", "mm.1.weight": "mm.adapter_proj.weight", "mm.2.weight": "mm.vision_proj.weight"}
PATCHES, POSITIONS = "v.patch_embd.weight", "v.position_embd.weight"
HEAD_COUNT, PATCH_SIZE = "clip.vision.attention.head_count", "clip.vision.patch_size"


def our_name(name: str) -> str | None:
    """Our parameter name (``GlimmerImageEncoder``'s) for an mmproj tensor, or None for one the tower has not."""
    name = NUMERIC.get(name, name)
    if name in TOP:
        return TOP[name]
    m = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in LAYER:
        return f"encoder.blocks.{m.group(1)}.{LAYER[m.group(2)]}.{m.group(3)}"
    return None


def gguf_names(ours, numeric_projector: bool = False) -> dict[str, str]:
    """{our name: mmproj name} for our parameter names ``ours`` (the inverse of ``our_name``)."""
    inverse = {v: k for k, v in TOP.items()}
    if numeric_projector:
        inverse |= {TOP[full]: short for short, full in NUMERIC.items()}
    out = {}
    for name in ours:
        if name in inverse:
            out[name] = inverse[name]
            continue
        m = re.fullmatch(r"encoder\.blocks\.(\d+)\.(\w+)\.(weight|bias)", name)
        leaf = {v: k for k, v in LAYER.items()}.get(m.group(2)) if m else None
        if leaf is None:
            raise ValueError(f"{name} is not a parameter of Muse Glimmer's tower")
        out[name] = f"v.blk.{m.group(1)}.{leaf}.{m.group(3)}"
    return out


def _reader(path: str):
    import gguf

    where = f"vision.checkpoint={path}"
    if not Path(path).is_file():
        raise ConfigError(f"{where} does not exist (an mmproj .gguf file)")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as err:  # truncated or foreign
        raise ConfigError(f"{where} is not a readable GGUF file ({err})") from None


def _shapes(reader) -> dict[str, tuple[int, ...]]:
    names = [NUMERIC.get(t.name, t.name) for t in reader.tensors]
    return {name: tuple(int(d) for d in reversed(t.shape)) for name, t in zip(names, reader.tensors, strict=True)}


def read_config(path: str) -> tuple[dict, int]:
    """(the ``vision`` settings the mmproj implies, in the config's names; its output width, which the
    target's must be)."""
    where = f"vision.checkpoint={path}"
    reader = _reader(path)
    shapes = _shapes(reader)

    def shape(name: str) -> tuple:
        if name not in shapes:
            raise ConfigError(f"{where}: tensor {name} is missing (Muse Glimmer's mmproj has it)")
        return shapes[name]

    grid_tokens, latent = shape(POSITIONS)
    grid = math.isqrt(grid_tokens)
    if grid * grid != grid_tokens:
        raise ConfigError(f"{where}: {POSITIONS} has {grid_tokens} rows, not a square grid; the tower's position "
                          "table is pos_grid x pos_grid")
    adapter, folded = shape("mm.adapter_fc.weight")
    factor = math.isqrt(folded // latent)
    if factor * factor * latent != folded:
        raise ConfigError(f"{where}: mm.adapter_fc.weight takes {folded} features, not latent {latent} x a square "
                          "downsample factor")
    layers = {int(m.group(1)) for name in shapes if (m := re.match(r"v\.blk\.(\d+)\.", name))}
    settings = {"family": "muse_glimmer", "dim": latent, "n_layers": max(layers, default=-1) + 1, "pos_grid": grid,
                "hidden_dim": shape("v.blk.0.ffn_up.weight")[0], "adapter_dim": adapter, "scale_factor": factor}
    if len(shape(PATCHES)) == 4:  # [latent, channels, p, p]: the patch size is the file's
        settings["patch_size"] = shape(PATCHES)[-1]
    for setting, key in (("n_heads", HEAD_COUNT), ("patch_size", PATCH_SIZE)):
        if (field := reader.fields.get(key)) is not None:
            settings[setting] = int(field.contents())
    return settings, shape("mm.vision_proj.weight")[0]


def check_patches(vision_cfg, path: str) -> None:
    """The file's patch embedding against the config's patch (temporal slots x 3 x patch_size^2)."""
    reader = _reader(path)
    got = _shapes(reader)[PATCHES]
    want = vision_cfg.patch_temporal * vision_cfg.num_channels * vision_cfg.patch_size**2
    width = math.prod(got[1:])
    if (len(got) == 2 and width != want) or (len(got) == 4 and width > want):
        raise ConfigError(f"vision.checkpoint={path}: {PATCHES} has shape {got}, but vision.patch_temporal="
                          f"{vision_cfg.patch_temporal} x {vision_cfg.num_channels} channels x vision.patch_size="
                          f"{vision_cfg.patch_size}^2 = {want} inputs per patch; set the file's patch size and slots")


def load_vision(model, path: str) -> None:
    """Fill a ``GlimmerImageEncoder`` from the mmproj: every parameter from its tensor (dequantized by
    the gguf package), checked for shape; a missing one is an error naming the file and the tensor."""
    import gguf
    import numpy as np
    import torch

    where = f"vision.checkpoint={path}"
    reader = _reader(path)
    want = dict(model.named_parameters())
    weights, skipped = {}, []
    for tensor in reader.tensors:
        ours = our_name(tensor.name)
        if ours is None:
            skipped.append(tensor.name)
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        except (ValueError, NotImplementedError) as err:
            raise BuildError(f"{where}: tensor {tensor.name} ({tensor.tensor_type.name}, {shape}) cannot be read: {err}") from None
        values = torch.from_numpy(np.ascontiguousarray(values))
        if tensor.name == PATCHES and values.ndim == 4:  # one temporal slot; the others' columns are zeros
            values = values.flatten(1)
            values = torch.nn.functional.pad(values, (0, want[ours].shape[1] - values.shape[1]))
        if tuple(values.shape) != tuple(want[ours].shape):
            raise BuildError(f"{where}: tensor {tensor.name} has shape {tuple(values.shape)}, the tower expects "
                             f"{tuple(want[ours].shape)} ({ours})")
        weights[ours] = values
    if missing := sorted(set(want) - set(weights)):
        names = gguf_names(missing)
        raise BuildError(f"{where}: missing tensor {names[missing[0]]} ({missing[0]})"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    if skipped:
        print(f"  skipped {len(skipped)} mmproj tensors no part of the tower: {', '.join(skipped[:4])}", flush=True)
    with torch.no_grad():
        for name, values in weights.items():
            if name != "pos_embed_table":
                want[name].copy_(values)
    model.set_position_table(weights["pos_embed_table"])
