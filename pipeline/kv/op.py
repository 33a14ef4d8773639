"""The backend-neutral KV op and the eager reference cache behind it (the oracle).

    kvcache::update_and_attend(q, k, v, position, layer_id, scale) -> out
      q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv], position [T, 1] int64
      out [B, Hq, T, Dv]

To the tracer it is a pure function: export leaves one opaque node per
attention layer, which ``passes/lower_offgraph_kv.py`` rewrites into an
explicit store. Eagerly it appends K/V to the installed ``ReferenceCache`` and
attends over that sequence's whole contiguous history, so the un-lowered model
is the oracle: one independent cache per sequence, B = 1.
"""

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

_active: "ReferenceCache | None" = None


@dataclass(frozen=True)
class LayerKV:
    window: int  # 0: flat (global) layer; > 0: sliding-window (ring) layer


class ReferenceCache:
    """One sequence's contiguous K/V history per layer, grown by concatenation."""

    def __init__(self, layers: list[LayerKV], causal: bool = True):
        self.layers = layers
        self.causal = causal
        self.k: list[Tensor | None] = [None] * len(layers)
        self.v: list[Tensor | None] = [None] * len(layers)
        self.pos: list[Tensor | None] = [None] * len(layers)

    @property
    def length(self) -> int:
        return 0 if self.pos[0] is None else int(self.pos[0].numel())

    def update_and_attend(self, q: Tensor, k: Tensor, v: Tensor, position: Tensor, layer_id: int, scale: float) -> Tensor:
        if q.shape[0] != 1:
            raise ValueError(f"the reference cache holds one sequence: got batch {q.shape[0]}")
        pos = position.reshape(-1)
        if self.k[layer_id] is None:
            self.k[layer_id], self.v[layer_id], self.pos[layer_id] = k, v, pos
        else:
            self.k[layer_id] = torch.cat([self.k[layer_id], k], dim=2)
            self.v[layer_id] = torch.cat([self.v[layer_id], v], dim=2)
            self.pos[layer_id] = torch.cat([self.pos[layer_id], pos])
        keys, values, key_pos = self.k[layer_id], self.v[layer_id], self.pos[layer_id]
        # keys: [1, Hkv, L, D] -> repeat to Hq heads
        group = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        visible = torch.ones(pos.numel(), key_pos.numel(), dtype=torch.bool)
        if self.causal:
            visible &= key_pos[None, :] <= pos[:, None]
        window = self.layers[layer_id].window
        if window > 0:
            visible &= pos[:, None] - key_pos[None, :] < window
        scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale  # [1, Hq, T, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(q.dtype)


@contextlib.contextmanager
def reference_cache(cache: ReferenceCache):
    """Route eager calls of the neutral op to ``cache`` for the duration."""
    global _active
    previous, _active = _active, cache
    try:
        yield cache
    finally:
        _active = previous


@torch.library.custom_op("kvcache::update_and_attend", mutates_args=())
def update_and_attend(q: Tensor, k: Tensor, v: Tensor, position: Tensor, layer_id: int, scale: float) -> Tensor:
    if _active is None:
        raise RuntimeError(
            "kvcache::update_and_attend ran eagerly with no reference cache installed; "
            "wrap the call in `with reference_cache(ReferenceCache(...)):`"
        )
    return _active.update_and_attend(q, k, v, position, layer_id, scale)


@update_and_attend.register_fake
def _(q, k, v, position, layer_id, scale):
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
