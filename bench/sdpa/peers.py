"""Peers timed on the same workloads as ours: padded SDPA, varlen_attn, FlexAttention and
ExecuTorch's Triton decode SDPA.  Each peer's inputs are made once (``*_parts``: its own layout,
K/V rotated over copies, and the per-step setup a model would run once per step: a key-padding mask,
cu_seqlens, a block mask); ``run_*`` times one layer's call per copy (setup outside the graph,
``(µs or None, note)``), ``bench/sdpa/step.py`` L calls per step (setup inside)."""

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .timing import DEV, DT, MAX_KV_PEER, n_rot, time_fn

try:  # ExecuTorch's Triton SDPA (imports triton + torch only)
    # the kernels package re-exports the ops under the module's name: import the op itself
    from executorch.backends.cuda.triton.kernels.sdpa import sdpa_decode_splitk as et_decode  # type: ignore
except Exception:  # noqa: BLE001  (not installed: the column says n/a)
    et_decode = None

try:
    from torch.nn.attention.varlen import varlen_attn
    VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters)
except Exception:  # noqa: BLE001
    varlen_attn = None
    VARLEN_PARAMS = set()

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    _flex = torch.compile(flex_attention, dynamic=False)
except Exception:  # noqa: BLE001
    _flex = None


@dataclasses.dataclass
class Parts:
    """A peer's inputs on one workload.  ``setup()``: what a model computes once per step (a mask,
    cu_seqlens, a block mask; None where nothing); ``layer(ctx, i)``: one layer's call along it on
    K/V copy i (of ``copies``); ``note``: what the table says of the peer's call."""
    setup: Callable[[], Any]
    layer: Callable[[Any, int], Any]
    copies: int
    note: str = ""


def _nothing() -> None:
    return None


def _padded(w, r, rep=False):
    lmax = max(n for n, _, _ in w.seqs)
    lq = max(nq for _, nq, _ in w.seqs)
    hk = w.hq if rep else w.hkv
    q = torch.randn(w.B, w.hq, lq, w.d, device=DEV, dtype=DT)
    kvs = [(torch.randn(w.B, hk, lmax, w.d, device=DEV, dtype=DT),
            torch.randn(w.B, hk, lmax, w.d, device=DEV, dtype=DT)) for _ in range(r)]
    return q, kvs, lq, lmax


def _mixed_sdpa_parts(w) -> Parts:
    """Two calls per layer: the decodes (enable_gqa) + the prefill chunk (is_causal)."""
    dec = [(n, nq) for n, nq, _ in w.seqs if nq == 1]
    pre = [(n, nq) for n, nq, _ in w.seqs if nq > 1]
    n_dec, l_dec = len(dec), dec[0][0]
    l_pre = pre[0][0]
    r = n_rot(w.kv_read)
    qd = torch.randn(n_dec, w.hq, 1, w.d, device=DEV, dtype=DT)
    qp = torch.randn(1, w.hq, l_pre, w.d, device=DEV, dtype=DT)
    kvs = [(torch.randn(n_dec, w.hkv, l_dec, w.d, device=DEV, dtype=DT),
            torch.randn(n_dec, w.hkv, l_dec, w.d, device=DEV, dtype=DT),
            torch.randn(1, w.hkv, l_pre, w.d, device=DEV, dtype=DT),
            torch.randn(1, w.hkv, l_pre, w.d, device=DEV, dtype=DT)) for _ in range(r)]

    def layer(_, i):
        kd, vd, kp, vp = kvs[i]
        F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
        F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
    return Parts(_nothing, layer, r, "2 calls")


def sdpa_parts(w) -> Parts | str:
    """Padded SDPA as a user would call it: enable_gqa; key-padding mask (per step, from a lengths
    tensor) when the lengths differ; lower-right causal mask (repeated heads) when Lq != Lk; a mixed
    step in two calls.  A str: why it is not run."""
    lens = [n for n, _, _ in w.seqs]
    uniform = len(set(lens)) == 1 and len(set(nq for _, nq, _ in w.seqs)) == 1
    lq = w.seqs[0][1]
    if not uniform and w.name.startswith("mixed"):
        return _mixed_sdpa_parts(w)
    if not uniform:
        if max(nq for _, nq, _ in w.seqs) > 1:
            return "—"
        bytes_ = w.B * max(lens) * w.hkv * w.d * 4
        if bytes_ > MAX_KV_PEER:
            return "mem"
        r = n_rot(bytes_)
        q, kvs, lq, lmax = _padded(w, r)
        lens_t = torch.tensor(lens, device=DEV)

        def mask():
            return (torch.arange(lmax, device=DEV)[None, :] < lens_t[:, None])[:, None, None, :]

        def masked(m, i):
            return F.scaled_dot_product_attention(q, kvs[i][0], kvs[i][1], attn_mask=m, enable_gqa=True)
        return Parts(mask, masked, r)
    lk = lens[0]
    causal_needed = w.causal and lq > 1
    rep = causal_needed and lq != lk
    bytes_ = w.B * lk * (w.hq if rep else w.hkv) * w.d * 4
    if bytes_ > MAX_KV_PEER:
        return "mem"
    r = n_rot(bytes_)
    q, kvs, _, _ = _padded(w, r, rep=rep)
    if rep:
        from torch.nn.attention.bias import causal_lower_right

        def bias():
            return causal_lower_right(lq, lk)

        def biased(b, i):
            return F.scaled_dot_product_attention(q, kvs[i][0], kvs[i][1], attn_mask=b)
        return Parts(bias, biased, r, "heads repeated, causal_lower_right")

    def plain(_, i):
        return F.scaled_dot_product_attention(q, kvs[i][0], kvs[i][1], is_causal=causal_needed, enable_gqa=True)
    return Parts(_nothing, plain, r)


def varlen_parts(w) -> Parts | str:
    """varlen_attn on packed K/V (KV heads repeated without enable_gqa); cu_seqlens per step, the
    cumulative sums of lengths tensors."""
    if varlen_attn is None:
        return "n/a"
    gqa = "enable_gqa" in VARLEN_PARAMS
    hk = w.hkv if gqa else w.hq
    tk = sum(n for n, _, _ in w.seqs)
    bytes_ = tk * hk * w.d * 4
    if bytes_ > MAX_KV_PEER:
        return "mem"
    r = n_rot(bytes_)
    q = torch.randn(w.T, w.hq, w.d, device=DEV, dtype=DT)
    kvs = [(torch.randn(tk, hk, w.d, device=DEV, dtype=DT), torch.randn(tk, hk, w.d, device=DEV, dtype=DT))
           for _ in range(r)]
    nq_t = torch.tensor([nq for _, nq, _ in w.seqs], device=DEV, dtype=torch.int32)
    nk_t = torch.tensor([n for n, _, _ in w.seqs], device=DEV, dtype=torch.int32)
    zero = torch.zeros(1, device=DEV, dtype=torch.int32)
    mq = max(nq for _, nq, _ in w.seqs)
    mk = max(n for n, _, _ in w.seqs)
    kw = {}
    if "is_causal" in VARLEN_PARAMS:
        kw["is_causal"] = w.causal
    elif w.causal:
        kw["window_size"] = (-1, 0)
    if gqa:
        kw["enable_gqa"] = True

    def cu_seqlens():
        return torch.cat([zero, nq_t.cumsum(0, dtype=torch.int32)]), torch.cat([zero, nk_t.cumsum(0, dtype=torch.int32)])

    def layer(cu, i):
        return varlen_attn(q, kvs[i][0], kvs[i][1], cu[0], cu[1], mq, mk, **kw)
    return Parts(cu_seqlens, layer, r, "" if gqa else "KV heads repeated")


def flex_parts(w) -> Parts | str:
    """FlexAttention (compiled) on padded K/V; the block mask (key padding, causal) per step."""
    if _flex is None:
        return "n/a"
    lens = [n for n, _, _ in w.seqs]
    lmax = max(lens)
    bytes_ = w.B * lmax * w.hkv * w.d * 4
    if bytes_ > MAX_KV_PEER:
        return "mem"
    r = n_rot(bytes_)
    q, kvs, lq, lmax = _padded(w, r)
    lens_t = torch.tensor(lens, device=DEV)
    nq_t = torch.tensor([nq for _, nq, _ in w.seqs], device=DEV)
    causal = w.causal

    def mask_mod(b, h, qi, ki):
        ok = ki < lens_t[b]
        if causal:
            ok = ok & (ki <= lens_t[b] - nq_t[b] + qi)
        return ok

    def block_mask():
        return create_block_mask(mask_mod, w.B, None, lq, lmax, device=DEV)

    def layer(bm, i):
        return _flex(q, kvs[i][0], kvs[i][1], block_mask=bm, enable_gqa=True)
    return Parts(block_mask, layer, r)


def et_parts(w) -> Parts | str:
    """ExecuTorch's Triton decode SDPA on padded K/V: uniform decodes only; no per-step setup."""
    if et_decode is None:
        return "n/a"
    lens = [n for n, _, _ in w.seqs]
    if len(set(lens)) != 1 or any(nq != 1 for _, nq, _ in w.seqs):  # uniform decode only
        return "n/a"
    if w.B * lens[0] * w.hkv * w.d > 2 ** 31:
        # its int32 offsets overflow: an illegal address on the H200 at B=64 L=128k (2^33 elements)
        return "n/a: > 2^31 elements"
    r = n_rot(w.kv_read)
    q, kvs, _, _ = _padded(w, r)

    def layer(_, i):
        return et_decode(q, kvs[i][0], kvs[i][1], enable_gqa=True)
    return Parts(_nothing, layer, r)


def per_call(parts: Parts | str) -> tuple[float | None, str]:
    """One layer's call per K/V copy in one graph, the per-step setup made once outside it."""
    if isinstance(parts, str):
        return None, parts
    ctx = parts.setup()
    return time_fn([lambda i=i: parts.layer(ctx, i) for i in range(parts.copies)]), parts.note


def run_sdpa(w) -> tuple[float | None, str]:
    return per_call(sdpa_parts(w))


def run_varlen(w) -> tuple[float | None, str]:
    return per_call(varlen_parts(w))


def run_flex(w) -> tuple[float | None, str]:
    return per_call(flex_parts(w))


def run_et(w) -> tuple[float | None, str]:
    return per_call(et_parts(w))
