"""``quant=from_checkpoint``: a GGUF's quantized blocks kept as the backend's formats, no float round
trip where the formats allow.

llama.cpp's blocks are 32 columns of one row:

- **Q4_0**: a float16 scale ``d`` and 32 unsigned nibbles ``q``; the weight is ``(q - 8) * d``. That is
  a symmetric 4-bit group of 32 (its scale rounded to bfloat16, below): ``q - 8`` in [-8, 7] with scale ``d`` (torchao's
  ``IntxUnpackedToInt8Tensor``, which lowers to XNNPACK's qb4w).
- **Q4_1**: ``d``, an offset ``m`` (float16) and 32 nibbles; the weight is ``q * d + m``. XNNPACK's
  4-bit kernels are symmetric (no per-group zero point), so the block becomes the symmetric group
  ``(q - 8, d)`` plus a correction: ``x . w = sum_b d_b (x_b . (q_b - 8)) + (m_b + 8 d_b) sum(x_b)``,
  the second term a float linear of the 32-column sums of ``x`` (``OffsetLinear``). The integers are
  exact; ``m + 8 d`` is one float32 rounding (an ulp at most), and ``d`` is rounded to bfloat16
  as below, so a weight differs from llama.cpp's by up to ``|q - 8| |d - bf16(d)|`` (the report
  records it per tensor).
- **Q8_0**: ``d`` and 32 int8 ``q``; the weight is ``q * d``. ExecuTorch's 8-bit embedding takes
  groups of 32 exactly. XNNPACK has no 8-bit groups for linears, so a Q8_0 *linear* (a head tied to a
  Q8_0 embedding, as in SmolLM2's GGUF) is requantized to 8 bits per output channel from
  llama.cpp's dequantized values: a float round trip, recorded as such.

Where the runtime differs: XNNPACK stores a 4-bit group's scale as bfloat16 (ExecuTorch's XNNPACK
serialiser casts it), so a float16 ``d`` loses its 3 lowest mantissa bits inside the ``.pte``. The
oracle computes with the same bfloat16 scales (``round_scales_as_xnnpack``), so a Q4 linear's
integers are llama.cpp's and its scales llama.cpp's rounded to bfloat16, recorded per tensor as
the error against llama.cpp's dequantization; a Q8_0 embedding is bit for bit (its kernel takes
float32 scales). Float tensors (F32 / F16 / BF16) stay float.
"""

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from pipeline.errors import BuildError
from pipeline.quant.formats import BLOCK, FLOAT, weights_2d


def blocks(tensor) -> dict:
    """A GGUF tensor's blocks as arrays: ``q`` [rows, cols] (int8: Q8_0's values, Q4's nibbles 0..15),
    ``d`` and (Q4_1) ``m`` [rows, cols / 32] as float32 (float16 in the file: exact)."""
    kind = tensor.tensor_type.name
    rows, cols = (int(n) for n in reversed(tensor.shape))
    size = {"Q8_0": 2 + BLOCK, "Q4_0": 2 + BLOCK // 2, "Q4_1": 4 + BLOCK // 2}[kind]
    raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1, size)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // BLOCK)
    out = {"kind": kind, "d": d}
    if kind == "Q8_0":
        out["q"] = raw[:, 2:].copy().view(np.int8).reshape(rows, cols)
        return out
    start = 2 if kind == "Q4_0" else 4
    if kind == "Q4_1":
        out["m"] = raw[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, cols // BLOCK)
    packed = raw[:, start:start + BLOCK // 2]
    # llama.cpp's order: byte j holds column j (low nibble) and column j + 16 (high nibble)
    out["q"] = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.int8).reshape(rows, cols)
    return out


def _permuted(b: dict, heads: int) -> dict:
    from pipeline.models.loaders.gguf import _unpermute

    return {k: (_unpermute(v, heads) if k != "kind" else v) for k, v in b.items()}


def int4_weight(q, d):
    """Symmetric 4-bit groups of 32 (``q`` in [-8, 7]) as torchao's tensor for XNNPACK's qb4w."""
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
        IntxUnpackedToInt8Tensor,
        IntxUnpackedToInt8TensorActivationQuantization,
    )

    q, d = torch.as_tensor(q, dtype=torch.int8), torch.as_tensor(d, dtype=torch.float32)
    return IntxUnpackedToInt8Tensor(q, d, torch.zeros(d.shape, dtype=torch.int8), torch.int4, (1, BLOCK),
                                    torch.float32, IntxUnpackedToInt8TensorActivationQuantization.INT8_ASYM_PER_TOKEN)


class OffsetLinear(nn.Module):
    """A Q4_1 linear: the symmetric 4-bit groups ``(q - 8, d)`` plus ``offsets`` (``m + 8 d``, one per
    group) times each 32-column sum of the input."""

    def __init__(self, q: np.ndarray, d: np.ndarray, m: np.ndarray):
        super().__init__()
        rows, cols = q.shape
        self.inner = nn.Linear(cols, rows, bias=False)
        self.inner.weight = nn.Parameter(int4_weight(q - 8, d), requires_grad=False)
        self.register_buffer("offsets", torch.as_tensor(m + 8 * d, dtype=torch.float32))

    @classmethod
    def of(cls, inner: nn.Module, offsets: torch.Tensor) -> "OffsetLinear":
        """An ``OffsetLinear`` of a ready ``inner`` linear and its ``offsets`` (``models/fuse.py``)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.inner = inner
        module.register_buffer("offsets", offsets)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sums = x.unflatten(-1, (-1, BLOCK)).sum(-1)
        return self.inner(x) + F.linear(sums, self.offsets)

    def dequantize(self) -> torch.Tensor:
        return self.inner.weight.dequantize() + self.offsets.repeat_interleave(BLOCK, dim=1)


def apply_blocks(model, model_cfg, quant_cfg) -> dict[str, str]:
    """Replace the target's linears (and, with ``quant.embedding``, its embedding) by the GGUF's blocks;
    ``model`` holds the file's dequantized weights already (the loader's), and keeps them where a
    tensor is float or has no exact route. Returns each module's format."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerAxis, quantize_

    from pipeline.models.families import family
    from pipeline.models.loaders.gguf import _reader, fused_parts, our_name
    from pipeline.quant.embedding import QuantEmbedding

    checkpoint, fam, args = model_cfg.checkpoint, family(model_cfg.family), model.args
    reader = _reader(Path(checkpoint))
    formats, requantize = {}, []
    tensors = {}  # our name -> (the GGUF tensor, its rows): a fused one (Phi-3's attn_qkv, ffn_up) gives several
    for t in weights_2d(reader):
        for name, start, stop in fused_parts(t.name, args, fam) or [(our_name(t.name), None, None)]:
            tensors[name] = (t, slice(start, stop))
    if "output.weight" not in tensors and "tok_embeddings.weight" in tensors:
        tensors["output.weight"] = tensors["tok_embeddings.weight"]  # a tied head: the embedding's blocks
    for name, (tensor, rows) in tensors.items():
        module_name = name.removesuffix(".weight")
        kind = tensor.tensor_type.name
        if kind in FLOAT:
            formats[module_name] = f"{kind} (kept float)"
            continue
        # a block is 32 columns of one row: a fused tensor's rows split whole blocks
        b = {k: v if k == "kind" else v[rows] for k, v in blocks(tensor).items()}
        if name.endswith(("wq.weight", "wk.weight")) and fam.gguf_permutes_qk:
            b = _permuted(b, args.n_heads if name.endswith("wq.weight") else args.n_kv_heads)
        if module_name == "tok_embeddings":
            if not quant_cfg.embedding or kind == "Q4_1":
                formats[module_name] = (f"{kind} dequantized (float: ExecuTorch's 4-bit embedding has no per-group "
                                        "offset)" if kind == "Q4_1" else f"{kind} dequantized (quant.embedding=false)")
                continue
            q = torch.as_tensor(b["q"]) - (8 if kind == "Q4_0" else 0)
            model.tok_embeddings = QuantEmbedding(q, torch.as_tensor(b["d"]), 8 if kind == "Q8_0" else 4)
            formats[module_name] = f"{kind} blocks kept (embedding_{'byte' if kind == 'Q8_0' else '4bit'}, groups of 32)"
            continue
        parent, _, leaf = module_name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if kind == "Q4_0":
            getattr(owner, leaf).weight = nn.Parameter(int4_weight(b["q"] - 8, b["d"]), requires_grad=False)
            formats[module_name] = "Q4_0 blocks kept (int4 g32, scales as bf16, 8da4w)"
        elif kind == "Q4_1":
            setattr(owner, leaf, OffsetLinear(b["q"], b["d"], b["m"]))
            formats[module_name] = "Q4_1 blocks kept (int4 g32, scales as bf16, + offsets x 32-column sums, 8da4w)"
        else:  # Q8_0 linear: XNNPACK has no 8-bit groups
            requantize.append(module_name)
            formats[module_name] = "Q8_0 requantized to int8 per channel (8da8w; a float round trip)"
    if requantize:
        quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
                  filter_fn=lambda m, fqn: fqn in requantize)
    if not any("kept (" in f for f in formats.values()):
        raise BuildError(f"quant=from_checkpoint: no tensor of model.checkpoint={checkpoint} was kept")
    return formats
