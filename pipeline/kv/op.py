"""The backend-neutral KV op (ExecuTorch's) and the eager reference cache behind it (the oracle).

    kvcache::update_and_attend(q, k, v, position, layer_id, scale, out_dtype) -> out
      q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv], position [T, 1] int64
      out [B, Hq, T, Dv] in out_dtype (the model passes q.dtype)

The op is the one ExecuTorch ships (``executorch.extension.llm.cache``); this
project registers none of its own. To the tracer it is a pure function: export
leaves one opaque node per attention layer, which ``passes/lower_offgraph_kv.py``
rewrites into an explicit store. Eagerly ExecuTorch's kernel asks the active
cache of its ``REGISTRY`` for the history and a mask (``update_and_fetch``) and
attends. ``ReferenceCache`` is that cache for one sequence: it keeps every
token's position, so the causal, sliding-window and non-causal rules are an
explicit mask over positions (ExecuTorch's contiguous cache ignores positions
and has no non-causal mode). One independent cache per sequence, B = 1, is
the oracle.
"""

import contextlib
import itertools
import math

import torch
from executorch.extension.llm.cache.reference_cache import AttendSpec, MaskKind
from executorch.extension.llm.cache.update_and_attend import REGISTRY
from torch import Tensor

from pipeline.models.args import LayerKV

NEUTRAL_OP = torch.ops.kvcache.update_and_attend.default
_keys = itertools.count()


class ReferenceCache:
    """One sequence's contiguous K/V history per layer, grown by concatenation."""

    def __init__(self, layers: list[LayerKV], causal: bool = True, rounding=None):
        self.layers = layers
        self.causal = causal
        # what the artifact's store does to the keys and values it keeps (``kv.quantize.rounding``: an 8-bit
        # cache's per token and head rounding); None: they are kept as computed
        self.rounding = rounding
        self.k: list[Tensor | None] = [None] * len(layers)
        self.v: list[Tensor | None] = [None] * len(layers)
        self.pos: list[Tensor | None] = [None] * len(layers)

    @property
    def length(self) -> int:
        return 0 if self.pos[0] is None else int(self.pos[0].numel())

    def truncate(self, length: int) -> None:
        """Forget every position >= ``length`` (a draft's scratch block, rejected proposals)."""
        for i, pos in enumerate(self.pos):
            if pos is not None:
                keep = pos < length
                self.k[i], self.v[i], self.pos[i] = self.k[i][:, :, keep], self.v[i][:, :, keep], pos[keep]

    def update_and_fetch(self, layer_id: int, k: Tensor, v: Tensor, position: Tensor) -> tuple[Tensor, Tensor, AttendSpec]:
        """ExecuTorch's cache protocol: append this step, return the history and who sees what."""
        if k.shape[0] != 1:
            raise ValueError(f"the reference cache holds one sequence: got batch {k.shape[0]}")
        pos = position.reshape(-1)
        if self.rounding is not None:
            k, v = self.rounding(k), self.rounding(v)
        if self.k[layer_id] is None:
            self.k[layer_id], self.v[layer_id], self.pos[layer_id] = k, v, pos
        else:
            self.k[layer_id] = torch.cat([self.k[layer_id], k], dim=2)
            self.v[layer_id] = torch.cat([self.v[layer_id], v], dim=2)
            self.pos[layer_id] = torch.cat([self.pos[layer_id], pos])
        key_pos = self.pos[layer_id]
        # visible: [T, L], true = attend
        visible = torch.ones(pos.numel(), key_pos.numel(), dtype=torch.bool)
        if self.causal:
            visible &= key_pos[None, :] <= pos[:, None]
        window = self.layers[layer_id].window
        if window > 0:
            visible &= pos[:, None] - key_pos[None, :] < window
        return self.k[layer_id], self.v[layer_id], AttendSpec(kind=MaskKind.EXPLICIT, mask=visible)


@contextlib.contextmanager
def reference_cache(cache: ReferenceCache):
    """Route eager calls of the neutral op to ``cache`` (installed in ExecuTorch's registry) for the duration."""
    key = f"pipeline-reference-{next(_keys)}"
    REGISTRY.install(key, cache)
    try:
        with REGISTRY.active(key):
            yield cache
    finally:
        REGISTRY.uninstall(key)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
