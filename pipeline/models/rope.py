"""RoPE's frequencies for a layer kind: the base, then the checkpoint's scaling (transformers' ``rope_type``s).

    inv_freq[i] = base ** (-2i / rotary_dim)                        i < rotary_dim / 2
    linear:   inv_freq / factor
    llama3:   wavelengths 2*pi/inv_freq above original_context/low_freq_factor divided by factor, below
              original_context/high_freq_factor kept, between them blended linearly in original_context/wavelength
    yarn:     per dim, interpolated (inv_freq / factor) and extrapolated (inv_freq) blended by a ramp between the
              dims that turn beta_fast and beta_slow times over original_context; cos, sin times attention_factor
              (0.1 ln(factor) + 1 unless given)
    longrope: inv_freq / short_factor[i]; cos, sin times attention_factor (sqrt(1 + ln(factor) / ln(original_context))
              unless given)
    dynamic:  the base frequencies (transformers rescales only beyond original_context)

Static: the artifact computes angles = position * inv_freq in the graph; nothing depends on a sequence's
length, so ``dynamic`` and ``longrope`` are refused for contexts beyond ``original_context``
(``build/feasibility.check_rope``).
"""

import math

import torch
from torch import Tensor

from pipeline.errors import ConfigError
from pipeline.models.args import ROPE_TYPES, RopeScaling


def base_frequencies(base: float, rotary_dim: int) -> Tensor:
    return 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)


def frequencies(base: float, rotary_dim: int, scaling: RopeScaling) -> tuple[Tensor, float]:
    """(inv_freq [rotary_dim / 2], the factor on cos and sin) of one layer kind."""
    inv_freq, kind = base_frequencies(base, rotary_dim), scaling.type
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, base, rotary_dim, scaling)
    if kind == "longrope":
        return _longrope(base, rotary_dim, scaling)
    raise ConfigError(f"model.rope_scaling.type={kind} is not a RoPE scaling; choose one of {', '.join(ROPE_TYPES)}")


def _llama3(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    wavelength = 2 * math.pi / inv_freq
    low_wavelength, high_wavelength = s.original_context / s.low_freq_factor, s.original_context / s.high_freq_factor
    scaled = torch.where(wavelength > low_wavelength, inv_freq / s.factor, inv_freq)
    smooth = (s.original_context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    between = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return torch.where(between, blended, scaled)


def _yarn(inv_freq: Tensor, base: float, rotary_dim: int, s: RopeScaling) -> tuple[Tensor, float]:
    def dim_turning(turns: float) -> float:  # the dim whose wavelength fits `turns` times in the original context
        return rotary_dim * math.log(s.original_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(s.beta_fast), dim_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # 1: the dim keeps its frequency
    mixed = inv_freq / s.factor * (1 - extrapolated) + inv_freq * extrapolated
    factor = s.attention_factor or (0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0)
    return mixed, factor


def _longrope(base: float, rotary_dim: int, s: RopeScaling) -> tuple[Tensor, float]:
    short = torch.tensor(s.short_factor, dtype=torch.float32)
    inv_freq = 1.0 / (short * base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    factor = s.attention_factor or (math.sqrt(1 + math.log(s.factor) / math.log(s.original_context)) if s.factor > 1 else 1.0)
    return inv_freq, factor

