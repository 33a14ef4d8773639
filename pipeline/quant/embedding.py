"""A token embedding of quantized rows, through ExecuTorch's quantized embedding ops
(``quantized_decomposed::embedding_byte`` / ``embedding_4bit``: the route of ExecuTorch's own LLM
export; the portable runtime's quantized kernels run them from the ``.pte``)."""

import torch
from torch import Tensor, nn

# the ops' Python definitions (for export and the eager oracle) and their out variants (to_executorch)
import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401  isort: skip
import executorch.kernels.quantized  # noqa: F401  isort: skip


class QuantEmbedding(nn.Module):
    """Rows of ``bits``-bit integers in groups of ``group`` columns, one float scale per group, no
    zero point: row ``i`` is ``values[i] * scales[i]`` broadcast over each group."""

    def __init__(self, values: Tensor, scales: Tensor, bits: int):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"QuantEmbedding: {bits}-bit rows; ExecuTorch has kernels for 8 and 4")
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        if values.dtype != torch.int8 or values.min() < lo or values.max() > hi:
            raise ValueError(f"QuantEmbedding: values must be int8 in [{lo}, {hi}]")
        self.bits, self.group = bits, values.shape[1] // scales.shape[1]
        if bits == 4:  # two per byte, offset to unsigned: the first column in the high nibble
            u = (values + 8).to(torch.uint8)
            values = u[:, 0::2] << 4 | u[:, 1::2]
        self.register_buffer("values", values.contiguous())
        self.register_buffer("scales", scales.float().contiguous())

    @classmethod
    def quantize(cls, weight: Tensor, bits: int, group: int) -> "QuantEmbedding":
        """Symmetric round-to-nearest of a float ``weight`` [vocab, dim] in groups of ``group`` columns."""
        rows, dim = weight.shape
        g = weight.float().reshape(rows, dim // group, group)
        hi = 2 ** (bits - 1) - 1
        scales = (g.abs().amax(-1) / hi).clamp_min(torch.finfo(torch.float32).tiny)
        values = torch.clamp(torch.round(g / scales[..., None]), -hi - 1, hi).to(torch.int8).reshape(rows, dim)
        return cls(values, scales, bits)

    def forward(self, tokens: Tensor) -> Tensor:
        if self.bits == 8:
            return torch.ops.quantized_decomposed.embedding_byte.dtype(
                self.values, self.scales, None, -128, 127, tokens, dtype=torch.float32)
        return torch.ops.quantized_decomposed.embedding_4bit.dtype(
            self.values, self.scales, None, -8, 7, tokens, dtype=torch.float32)

    def dequantize(self) -> Tensor:
        """Every row as floats, [vocab, dim] (the forward of every token)."""
        return self.forward(torch.arange(self.values.shape[0]))

    def extra_repr(self) -> str:
        return f"{self.values.shape[0]}, {self.scales.shape[1] * self.group}, bits={self.bits}, group={self.group}"
