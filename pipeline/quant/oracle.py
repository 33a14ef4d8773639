"""validate's quantized oracle, made cheap: torchao's linear on an ``IntxUnpackedToInt8Tensor``
weight quantizes and dequantizes the activation (per token, 8-bit asymmetric), then runs
``F.linear`` on ``weight.dequantize()``, dequantizing every weight on every call, and ExecuTorch's
``embedding_4bit`` / ``embedding_byte`` ops dequantize the whole table for every lookup (together
~0.6 s a step for SmolLM2-135M on one core). ``with_dequantized_weights`` copies the model with
those weights and tables dequantized once; the arithmetic and its order are the same, so the logits
are equal bit for bit (tests/test_quant.py)."""

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
    IntxUnpackedToInt8Tensor,
    IntxUnpackedToInt8TensorActivationQuantization,
    _apply_int8_act_asym_per_token_quant_dequant,
)

from pipeline.quant.embedding import QuantEmbedding


class DequantizedLinear(nn.Module):
    """torchao's linear on ``IntxUnpackedToInt8Tensor`` weights, the weight dequantized once."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight
        act = weight.activation_quantization
        if act not in (None, IntxUnpackedToInt8TensorActivationQuantization.INT8_ASYM_PER_TOKEN):
            raise NotImplementedError(f"with_dequantized_weights: activation quantization {act} (torchao has only "
                                      "INT8_ASYM_PER_TOKEN or none)")
        self.per_token = act is not None
        self.register_buffer("weight", weight.dequantize().detach())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_token:
            x = _apply_int8_act_asym_per_token_quant_dequant(x)
        return F.linear(x, self.weight, self.bias)


class DequantizedEmbedding(nn.Module):
    """A ``QuantEmbedding``'s rows, dequantized once (its ``dequantize()``: the op on every token)."""

    def __init__(self, embedding: QuantEmbedding):
        super().__init__()
        self.register_buffer("weight", embedding.dequantize().detach())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


def with_dequantized_weights(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every torchao-quantized linear a ``DequantizedLinear`` and every
    ``QuantEmbedding`` a ``DequantizedEmbedding`` (the rest, GGUF offsets included, as they are)."""
    fast = copy.deepcopy(model)
    swaps = [(name, DequantizedLinear if isinstance(m, nn.Linear) else DequantizedEmbedding)
             for name, m in fast.named_modules()
             if (isinstance(m, nn.Linear) and isinstance(m.weight, IntxUnpackedToInt8Tensor)) or isinstance(m, QuantEmbedding)]
    for name, kind in swaps:
        parent, _, attr = name.rpartition(".")
        owner = fast.get_submodule(parent) if parent else fast
        setattr(owner, attr, kind(getattr(owner, attr)))
    return fast
