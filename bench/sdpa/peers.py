"""Peers timed on the same workloads as ours: padded SDPA, varlen_attn, FlexAttention and
ExecuTorch's Triton decode SDPA, each returning (µs or None, note)."""

import inspect

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


def _padded(w, r, rep=False):
    lmax = max(n for n, _, _ in w.seqs)
    lq = max(nq for _, nq, _ in w.seqs)
    hk = w.hq if rep else w.hkv
    q = torch.randn(w.B, w.hq, lq, w.d, device=DEV, dtype=DT)
    kvs = [(torch.randn(w.B, hk, lmax, w.d, device=DEV, dtype=DT),
            torch.randn(w.B, hk, lmax, w.d, device=DEV, dtype=DT)) for _ in range(r)]
    return q, kvs, lq, lmax


def run_sdpa(w):
    """Padded SDPA as a user would call it: enable_gqa; key-padding mask when the
    lengths differ; lower-right causal mask (repeated heads) when Lq != Lk."""
    lens = [n for n, _, _ in w.seqs]
    uniform = len(set(lens)) == 1 and len(set(nq for _, nq, _ in w.seqs)) == 1
    lq = w.seqs[0][1]
    if not uniform and w.name.startswith("mixed"):
        # two calls: the decodes (enable_gqa) + the prefill chunk (is_causal)
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

        def two(kd, vd, kp, vp):
            F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
            F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        return time_fn([lambda t=t: two(*t) for t in kvs]), "2 calls"
    if not uniform:
        if max(nq for _, nq, _ in w.seqs) > 1:
            return None, "—"
        bytes_ = w.B * max(lens) * w.hkv * w.d * 4
        if bytes_ > MAX_KV_PEER:
            return None, "mem"
        r = n_rot(bytes_)
        q, kvs, lq, lmax = _padded(w, r)
        mask = (torch.arange(lmax, device=DEV)[None, :] < torch.tensor(lens, device=DEV)[:, None])[:, None, None, :]
        fns = [lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True) for k, v in kvs]
        return time_fn(fns), ""
    lk = lens[0]
    causal_needed = w.causal and lq > 1
    rep = causal_needed and lq != lk
    bytes_ = w.B * lk * (w.hq if rep else w.hkv) * w.d * 4
    if bytes_ > MAX_KV_PEER:
        return None, "mem"
    r = n_rot(bytes_)
    q, kvs, _, _ = _padded(w, r, rep=rep)
    if rep:
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(lq, lk)
        fns = [lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias) for k, v in kvs]
        note = "heads repeated, causal_lower_right"
    else:
        fns = [lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=causal_needed, enable_gqa=True)
               for k, v in kvs]
        note = ""
    return time_fn(fns), note


def run_varlen(w):
    if varlen_attn is None:
        return None, "n/a"
    gqa = "enable_gqa" in VARLEN_PARAMS
    hk = w.hkv if gqa else w.hq
    tk = sum(n for n, _, _ in w.seqs)
    bytes_ = tk * hk * w.d * 4
    if bytes_ > MAX_KV_PEER:
        return None, "mem"
    r = n_rot(bytes_)
    q = torch.randn(w.T, w.hq, w.d, device=DEV, dtype=DT)
    kvs = [(torch.randn(tk, hk, w.d, device=DEV, dtype=DT), torch.randn(tk, hk, w.d, device=DEV, dtype=DT))
           for _ in range(r)]
    cq = torch.tensor([0] + list(torch.tensor([nq for _, nq, _ in w.seqs]).cumsum(0)), device=DEV, dtype=torch.int32)
    ck = torch.tensor([0] + list(torch.tensor([n for n, _, _ in w.seqs]).cumsum(0)), device=DEV, dtype=torch.int32)
    mq = max(nq for _, nq, _ in w.seqs)
    mk = max(n for n, _, _ in w.seqs)
    kw = {}
    if "is_causal" in VARLEN_PARAMS:
        kw["is_causal"] = w.causal
    elif w.causal:
        kw["window_size"] = (-1, 0)
    if gqa:
        kw["enable_gqa"] = True
    fns = [lambda k=k, v=v: varlen_attn(q, k, v, cq, ck, mq, mk, **kw) for k, v in kvs]
    return time_fn(fns), ("" if gqa else "KV heads repeated")


def run_flex(w):
    if _flex is None:
        return None, "n/a"
    lens = [n for n, _, _ in w.seqs]
    lq = max(nq for _, nq, _ in w.seqs)
    lmax = max(lens)
    bytes_ = w.B * lmax * w.hkv * w.d * 4
    if bytes_ > MAX_KV_PEER:
        return None, "mem"
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

    bm = create_block_mask(mask_mod, w.B, None, lq, lmax, device=DEV)
    fns = [lambda k=k, v=v: _flex(q, k, v, block_mask=bm, enable_gqa=True) for k, v in kvs]
    return time_fn(fns), ""


def run_et(w):
    if et_decode is None:
        return None, "n/a"
    lens = [n for n, _, _ in w.seqs]
    if len(set(lens)) != 1 or any(nq != 1 for _, nq, _ in w.seqs):  # uniform decode only
        return None, "n/a"
    if w.B * lens[0] * w.hkv * w.d > 2 ** 31:
        # its int32 offsets overflow: an illegal address on the H200 at B=64 L=128k (2^33 elements)
        return None, "n/a: > 2^31 elements"
    r = n_rot(w.kv_read)
    q, kvs, _, _ = _padded(w, r)
    fns = [lambda k=k, v=v: et_decode(q, k, v, enable_gqa=True) for k, v in kvs]
    return time_fn(fns), ""
