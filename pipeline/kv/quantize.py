"""The 8-bit KV cache (``kv.dtype=int8``): each token's key and value vectors stored as 8-bit integers,
one float32 scale per token and KV head (llama.cpp's ``-ctk q8_0 -ctv q8_0`` keeps one per 32 values).

    scale = max(|x|, over the head's D values) * (1/127)  (at least TINY / 127: an all-zero vector)
    q     = clamp(round_half_even(x / scale), -127, 127)   int8, symmetric: no zero point
    x'    = q * scale                                       what attention reads

One function (``quantize``) writes the rounding for both sides: ``lower_offgraph_kv`` calls it with
``graph.call_function`` to put the store's quantization into the program, and the eager oracle's
``ReferenceCache`` with ``EAGER`` to round what it keeps the same way (``rounding``), so the oracle
models the cache op for op. The attention folds the scales in where they are cheapest
(``kernels/reference._attend_group``): the keys' into the scores, the values' into the softmax
weights, so a decode multiplies ``G * N`` numbers per KV head instead of ``N * D``.
"""

from collections.abc import Callable

QMAX = 127
TINY = 1e-30  # the smallest max |x| a scale is taken from: an all-zero vector stores zeros, not NaN
QUANTIZED_DTYPES = {"int8"}  # the kv.dtype values stored as integers with scales (DTYPE_BYTES has their bytes)


def _eager(op, args, kwargs=None):
    return op(*args, **(kwargs or {}))


EAGER = _eager  # ``call`` for ``quantize`` outside a graph


def quantize(call, x):
    """``(q, scale)``: ``x`` (float32, [..., D]) rounded to int8 along its last axis, ``scale`` [..., 1]
    float32. ``call(op, args, kwargs)`` applies an ATen op: ``graph.call_function`` or ``EAGER``."""
    import torch

    aten = torch.ops.aten
    amax = call(aten.amax.default, (call(aten.abs.default, (x,)), [-1], True))
    # times 1/127, not divided by 127: XNNPACK divides by a constant as a multiply by its reciprocal
    scale = call(aten.mul.Scalar, (call(aten.clamp_min.default, (amax, TINY)), 1.0 / QMAX))
    q = call(aten.clamp.default, (call(aten.round.default, (call(aten.div.Tensor, (x, scale)),)), -QMAX, QMAX))
    return call(aten._to_copy.default, (q,), {"dtype": torch.int8}), scale


def dequantize(q, scale):
    import torch

    return q.to(torch.float32) * scale


def rounding(dtype: str) -> Callable | None:
    """What a store of ``dtype`` does to the values it keeps, as the oracle applies it (None: float stores
    keep them; the oracle computes in float32 either way)."""
    if dtype not in QUANTIZED_DTYPES:
        return None
    return lambda x: dequantize(*quantize(EAGER, x.float())).to(x.dtype)
