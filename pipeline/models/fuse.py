"""The target's linears that read the same input, as one: q, k and v of each attention, the gate and
up projections of each feed-forward (issue 49). One linear of the stacked output rows reads (and, with
8-bit dynamic activations, quantizes) the input once instead of two or three times: a SmolLM2 Q4_1
decode step measured 0.8 ms faster on a stack of its linears (docs/benchmarks.md "decode_profile").

Each output row's arithmetic is the part's own (the same weights, scales and offsets; a row's dot
product does not depend on the rows beside it), so fusing changes no value the eager model computes.
Fused after quantization (``roles/target.py``), so the quantization report and the loaders keep the
checkpoint's names. Parts that are not alike (a float linear beside a quantized one, 4-bit groups
beside 8-bit channels, a bias on some only) stay as they are."""

import torch
from torch import nn


class Projections(nn.Module):
    """``linear`` (the parts' output rows stacked) cut back into the parts' outputs by ``narrow``: a
    ``split`` becomes ``split_with_sizes_copy``, whose outputs ExecuTorch plans at the export's
    example size, so XNNPACK refused another token count (docs/benchmarks.md "decode_profile")."""

    def __init__(self, linear: nn.Module, widths: list[int]):
        super().__init__()
        self.linear, self.widths = linear, list(widths)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        y, start, out = self.linear(x), 0, []
        for width in self.widths:
            out.append(y.narrow(-1, start, width))
            start += width
        return out


def stacked(parts: list[nn.Module]) -> nn.Module | None:
    """One module computing ``parts``' outputs side by side, or None where they are not alike."""
    from pipeline.quant.gguf import OffsetLinear

    if all(type(p) is OffsetLinear for p in parts):
        inner = stacked([p.inner for p in parts])
        return None if inner is None else OffsetLinear.of(inner, torch.cat([p.offsets for p in parts]))
    if not all(type(p) is nn.Linear for p in parts) or len({p.in_features for p in parts}) != 1:
        return None
    if len({p.bias is None for p in parts}) != 1:
        return None
    weight = _stacked_weights([p.weight for p in parts])
    if weight is None:
        return None
    out = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None,
                    device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if parts[0].bias is not None:
        out.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return out


def _stacked_weights(weights: list[torch.Tensor]) -> torch.Tensor | None:
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor

    if all(type(w) is nn.Parameter and type(w.data) is torch.Tensor for w in weights):
        return torch.cat([w.detach() for w in weights])
    if not all(isinstance(w, IntxUnpackedToInt8Tensor) for w in weights):
        return None
    keys = {(w.target_dtype, tuple(w.block_size), w.dtype, w.activation_quantization) for w in weights}
    if len(keys) != 1:
        return None
    first = weights[0]
    return IntxUnpackedToInt8Tensor(torch.cat([w.qdata for w in weights]), torch.cat([w.scale for w in weights]),
                                    torch.cat([w.zero_point for w in weights]), first.target_dtype, tuple(first.block_size),
                                    first.dtype, first.activation_quantization)


def fuse_projections(model) -> int:
    """Fuse each attention's q, k, v and each feed-forward's gate and up projections of ``model`` (the
    target) in place; the count fused."""
    from pipeline.models.transformer import Attention, FeedForward

    fused = 0
    for module in model.modules():
        names = ("wq", "wk", "wv") if isinstance(module, Attention) else ("w1", "w3") if isinstance(module, FeedForward) else ()
        if not names or any(not hasattr(module, n) for n in names):
            continue
        parts = [getattr(module, n) for n in names]
        one = stacked(parts)
        if one is None:
            continue
        module.fused = Projections(one, [_out_features(p) for p in parts])
        for n in names:
            delattr(module, n)
        fused += 1
    return fused


def _out_features(linear: nn.Module) -> int:
    return linear.offsets.shape[0] if hasattr(linear, "offsets") else linear.out_features
