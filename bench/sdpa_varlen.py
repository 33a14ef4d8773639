"""Benchmark of the Triton ``sdpa_varlen`` kernels (plan + attention) on one CUDA GPU.

    PYTHONUNBUFFERED=1 python bench/sdpa_varlen.py [--quick] [--out PATH] [--compare OLD_MODULE.py]

Times (median over CUDA-graph replays, KV rotated over several buffers so the
working set is far above L2) our kernel on the column store
[rows * columns, Hkv, D] and, on the same workload, PyTorch's
``F.scaled_dot_product_attention`` on padded contiguous [B, H, L, D] tensors,
``torch.nn.attention.varlen.varlen_attn`` on packed K/V (KV heads repeated when
the installed torch has no ``enable_gqa``; packing not timed), FlexAttention
with a block mask (compiled; only on a few shapes: compile time) and
ExecuTorch's Triton SDPA when importable.  Imports neither executorch's
exporter nor hydra; the kernel module is imported directly.  ``--compare`` times
another version of the kernel module (a file: e.g. ``git show REV:pipeline/kernels/
sdpa_varlen.py > old.py``) on the same inputs in the same run, a column beside ours.
"""

import argparse
import datetime
import inspect
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pipeline.kernels import sdpa_varlen as K  # noqa: E402

try:  # ExecuTorch's Triton SDPA (imports triton + torch only)
    # the kernels package re-exports the ops under the module's name: import the op itself
    from executorch.backends.cuda.triton.kernels.sdpa import sdpa_decode_splitk as et_decode  # type: ignore
except Exception:  # noqa: BLE001
    et_decode = None

try:
    from torch.nn.attention.varlen import varlen_attn
    _VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters)
except Exception:  # noqa: BLE001
    varlen_attn = None
    _VARLEN_PARAMS = set()

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    _flex = torch.compile(flex_attention, dynamic=False)
except Exception:  # noqa: BLE001
    _flex = None

DEV = "cuda"
DT = torch.bfloat16
L2_BYTES = 50e6
GB = 1e9
MAX_KV_OURS = 60 * GB
MAX_KV_PEER = 30 * GB


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------- timing
def time_fn(fns, reps=None, target_s=0.12):
    """fns: list of closures, one per rotated buffer.  Captured in one CUDA graph
    (all rotations); median of replays / len(fns) in microseconds."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        run = graph.replay
    except Exception:  # noqa: BLE001  (not capturable: eager, events)
        graph = None
        torch.cuda.synchronize()

        def run():
            for f in fns:
                f()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    st.record()
    run()
    en.record()
    torch.cuda.synchronize()
    est = st.elapsed_time(en) / 1e3
    if reps is None:
        reps = int(max(5, min(40, target_s / max(est, 1e-6))))
    times = []
    for _ in range(reps):
        st.record()
        run()
        en.record()
        torch.cuda.synchronize()
        times.append(st.elapsed_time(en) * 1e3 / len(fns))
    times.sort()
    captured = graph is not None
    del graph
    return times[len(times) // 2], captured


def n_rot(kv_bytes):
    return int(max(1, min(32, math.ceil(3 * L2_BYTES / max(kv_bytes, 1)))))


# ------------------------------------------------------------- workloads
class Work:
    """seqs: list of (n_keys, n_q, start_row); query tokens at the last n_q
    positions of each sequence (prefill chunk / draft block / decode)."""

    def __init__(self, name, hq, hkv, d, seqs, causal, rows=None, window=0):
        self.name, self.hq, self.hkv, self.d = name, hq, hkv, d
        self.seqs, self.causal, self.window = seqs, causal, window
        self.B = len(seqs)
        self.rows = rows or max(n for n, _, _ in seqs)
        self.T = sum(nq for _, nq, _ in seqs)
        vis = 0
        for n, nq, _ in seqs:
            for j in range(nq):
                qp = n - nq + j
                vis += (qp + 1) if causal else n
        self.pairs = vis  # (query, key) pairs per head
        self.kv_read = sum(n for n, _, _ in seqs) * hkv * d * 2 * 2
        self.store_bytes = self.rows * self.B * hkv * d * 2 * 2
        self.bytes = self.kv_read + 2 * self.T * hq * d * 2
        self.flops = 4 * d * hq * self.pairs

    def ours_inputs(self, n_copies):
        cols = self.B
        seg, q_cols, q_pos = [], [], []
        for c, (n, nq, r0) in enumerate(self.seqs):
            first = min(n, self.rows - r0)
            seg.append([c, r0, first, 0])
            seg.append([c, 0, n - first, first] if n - first > 0 else [c, 0, 0, 0])
            q_cols += [c] * nq
            q_pos += list(range(n - nq, n))
        seq_info = torch.tensor(seg, dtype=torch.int64, device=DEV)
        q = torch.randn(self.T, self.hq, self.d, device=DEV, dtype=DT)
        kvs = []
        for _ in range(n_copies):
            k = torch.randn(self.rows * cols, self.hkv, self.d, device=DEV, dtype=DT)
            v = torch.randn(self.rows * cols, self.hkv, self.d, device=DEV, dtype=DT)
            kvs.append((k, v))
        return q, kvs, torch.tensor(q_pos, device=DEV), torch.tensor(q_cols, device=DEV), seq_info, cols


def load_module(path):
    """Another version of the kernel module, its ops registered under ``kvcache_prev::``
    (the names of ours are taken)."""
    import types
    src = open(path).read().replace('"kvcache::', '"kvcache_prev::')
    mod = types.ModuleType("sdpa_varlen_prev")
    mod.__file__ = os.path.abspath(path)
    sys.modules[mod.__name__] = mod  # triton's jit looks its functions' globals up through the module
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


def ours_calls(w, mod=K):
    """A kernel module's calls on w: one layer's attention calls (one per rotated K/V copy)
    along a plan computed once, the plan call itself, and that plan."""
    q, kvs, q_pos, q_cols, seq_info, cols = w.ours_inputs(n_rot(w.kv_read))
    scale = 1 / math.sqrt(w.d)
    geo = mod._geometry_of(q, kvs[0][0], kvs[0][1], cols)

    def plan_call():
        return mod.plan_impl(q_pos, q_cols, seq_info, cols, w.causal, w.window, geo)

    plan = plan_call()
    pre = (q_pos,) if "q_pos" in inspect.signature(mod.attend_impl).parameters else ()  # earlier versions took it
    fns = [lambda k=k, v=v: mod.attend_impl(q, k, v, *pre, plan, cols, scale, w.causal, w.window, geo)
           for k, v in kvs]
    return fns, plan_call, plan


def run_ours(w, mod=K):
    """(µs per layer: attention (and merge) along a plan computed once, µs of the plan alone).
    A lowered model plans once per step and layer kind; every layer of the kind reuses it."""
    fns, plan_call, _ = ours_calls(w, mod)
    layer_us, _ = time_fn(fns)
    plan_us, _ = time_fn([plan_call])
    return layer_us, plan_us


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
        return time_fn([lambda t=t: two(*t) for t in kvs])[0], "2 calls"
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
        return time_fn(fns)[0], ""
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
    return time_fn(fns)[0], note


def run_varlen(w):
    if varlen_attn is None:
        return None, "n/a"
    gqa = "enable_gqa" in _VARLEN_PARAMS
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
    if "is_causal" in _VARLEN_PARAMS:
        kw["is_causal"] = w.causal
    elif w.causal:
        kw["window_size"] = (-1, 0)
    if gqa:
        kw["enable_gqa"] = True
    fns = [lambda k=k, v=v: varlen_attn(q, k, v, cq, ck, mq, mk, **kw) for k, v in kvs]
    return time_fn(fns)[0], ("" if gqa else "KV heads repeated")


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
    return time_fn(fns)[0], ""


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
    return time_fn(fns)[0], ""


# ------------------------------------------------------------------ numerics
def numerics(hq, hkv, d, n_keys, n_q, B):
    """Max abs error vs an fp32 reference (math SDPA on fp32): ours (bf16) and
    PyTorch's bf16 SDPA on the same data."""
    w = Work("num", hq, hkv, d, [(n_keys, n_q, (7 * i) % n_keys) for i in range(B)], causal=True)
    q, kvs, q_pos, q_cols, seq_info, cols = w.ours_inputs(1)
    k, v = kvs[0]
    scale = 1 / math.sqrt(d)
    out = K.sdpa_varlen_triton_impl(q, k, v, q_pos, q_cols, seq_info, cols, scale, True, 0)
    # padded views in key-position order
    kk = k.view(w.rows, cols, hkv, d)
    vv = v.view(w.rows, cols, hkv, d)
    rows_of = []
    for n, _, r0 in w.seqs:
        idx = [(r0 + j) % w.rows for j in range(n)]
        rows_of.append(idx)
    idx = torch.tensor(rows_of, device=DEV)  # [B, n]
    kp = kk[idx, torch.arange(cols, device=DEV)[:, None]].permute(0, 2, 1, 3)  # [B, hkv, n, d]
    vp = vv[idx, torch.arange(cols, device=DEV)[:, None]].permute(0, 2, 1, 3)
    qp = q.view(B, n_q, hq, d).permute(0, 2, 1, 3)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    rep = hq // hkv
    kf, vf = kp.float().repeat_interleave(rep, 1), vp.float().repeat_interleave(rep, 1)
    mask = causal_lower_right(n_q, n_keys) if n_q > 1 else None
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(qp.float(), kf, vf, attn_mask=mask)
    ours = out.view(B, n_q, hq, d).permute(0, 2, 1, 3).float()
    if n_q > 1:
        pt = F.scaled_dot_product_attention(qp, kp.repeat_interleave(rep, 1), vp.repeat_interleave(rep, 1), attn_mask=mask)
    else:
        pt = F.scaled_dot_product_attention(qp, kp, vp, enable_gqa=True)
    return (ours - ref).abs().max().item(), (pt.float() - ref).abs().max().item()


# ------------------------------------------------------------------- cases
HEADS = [(32, 8, 128), (64, 8, 128), (16, 2, 256), (32, 32, 128)]


def lognormal_lengths(B, L, rows_cap, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(B, generator=g))
    lens = (x / x.sum() * B * L).clamp(16, rows_cap).round().long()
    # restore the total after clipping (as close as the cap allows)
    for _ in range(4):
        diff = B * L - int(lens.sum())
        if diff == 0:
            break
        room = (rows_cap - lens) if diff > 0 else (lens - 16)
        share = (room.float() / max(1, int(room.sum())) * diff).round().long()
        lens = (lens + share).clamp(16, rows_cap)
    return lens.tolist()


def build_cases(quick):
    """In priority order (the bench stops adding cases when its time budget is spent)."""
    cases = []
    batches = [1, 4, 16, 64, 256]
    ctxs = [512, 2048, 8192, 32768, 131072]
    hq, hkv, d = HEADS[0]
    per_tok = hkv * d * 4

    def fits(b, c):
        return b * c * per_tok <= MAX_KV_OURS

    def uni(b, c, h=HEADS[0]):
        return ("decode", Work(f"decode uniform B={b} L={c}", h[0], h[1], h[2], [(c, 1, 0)] * b, True))

    def skew(b, c):
        lens = lognormal_lengths(b, c, 4 * c)
        return ("skew", Work(f"decode skewed B={b} L~{c}", hq, hkv, d, [(n, 1, 0) for n in lens], True,
                             rows=max(lens)))

    def wrap(b, c):
        g = torch.Generator().manual_seed(b + c)
        starts = torch.randint(1, c, (b,), generator=g).tolist()
        return ("wrap", Work(f"decode wrapped B={b} L={c}", hq, hkv, d, [(c, 1, s) for s in starts], True))

    def draft(b):
        return ("draft", Work(f"draft 16 non-causal B={b} L=8192", hq, hkv, d, [(8192, 16, 0)] * b, False))

    def prefill(chunk, hist):
        return ("prefill", Work(f"prefill chunk={chunk} hist={hist}", hq, hkv, d, [(hist + chunk, chunk, 0)], True))

    if quick:
        return [uni(1, 32768), uni(1, 8192), uni(4, 2048), uni(16, 8192), uni(64, 8192), skew(16, 8192),
                skew(256, 2048), wrap(16, 8192), draft(4), draft(8), prefill(2048, 8192), prefill(8192, 0)]
    cases += [uni(b, c) for b in batches for c in ctxs if fits(b, c)]
    cases += [skew(b, c) for b in (4, 16, 64, 256) for c in (2048, 8192, 32768) if b * 4 * c * per_tok <= MAX_KV_OURS]
    cases += [wrap(b, c) for b in batches for c in (8192, 32768) if fits(b, c)] + [wrap(1, 131072), wrap(4, 131072)]
    cases += [draft(b) for b in (1, 8, 32)]
    cases += [prefill(c, h) for c in (512, 2048, 8192) for h in (0, 8192)]
    cases.append(("mixed", Work("mixed 128 decodes@2k + 2k chunk", hq, hkv, d,
                                [(2048, 1, 0)] * 128 + [(2048, 2048, 0)], True)))
    for h in HEADS[1:]:
        for b, c in [(1, 32768), (4, 131072), (16, 8192), (64, 2048), (256, 2048)]:
            if b * c * h[1] * h[2] * 4 <= MAX_KV_OURS:
                cases.append(uni(b, c, h))
    return cases


FLEX_CASES = {"32/8 D128 decode uniform B=16 L=8192", "32/8 D128 prefill chunk=2048 hist=0"}


SWEEP_DEC = [dict(DEC_BLOCK_N=bn, TARGET_CTAS=t, MIN_CHUNK=mc)
             for bn, t, mc in [(64, 528, 256), (32, 528, 256), (128, 528, 256), (64, 396, 256), (64, 792, 256),
                               (64, 1056, 512), (64, 528, 512)]]
SWEEP_PRE = [dict(PRE_BLOCK_M=bm, PRE_BLOCK_N=bn, WARPS=w, STAGES=st)
             for bm, bn, w, st in [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (64, 128, 4, 2), (128, 128, 8, 2),
                                   (64, 64, 8, 3)]]
KNOBS = ("DEC_BLOCK_N", "PRE_BLOCK_M", "PRE_BLOCK_N", "WARPS", "STAGES", "TARGET_CTAS", "MIN_CHUNK")


def sweep_cases():
    hq, hkv, d = HEADS[0]
    lens = lognormal_lengths(256, 2048, 4 * 2048)
    lens16 = lognormal_lengths(16, 8192, 4 * 8192)
    dec = [Work("decode B=1 L=32k", hq, hkv, d, [(32768, 1, 0)], True),
           Work("decode B=1 L=128k", hq, hkv, d, [(131072, 1, 0)], True),
           Work("decode B=16 L=8k", hq, hkv, d, [(8192, 1, 0)] * 16, True),
           Work("decode B=256 L=2k", hq, hkv, d, [(2048, 1, 0)] * 256, True),
           Work("skewed B=256 L~2k", hq, hkv, d, [(n, 1, 0) for n in lens], True, rows=max(lens)),
           Work("skewed B=16 L~8k", hq, hkv, d, [(n, 1, 0) for n in lens16], True, rows=max(lens16)),
           Work("decode B=4 L=32k", hq, hkv, d, [(32768, 1, 0)] * 4, True)]
    pre = [Work("draft16 B=4 L=8k", hq, hkv, d, [(8192, 16, 0)] * 4, False),
           Work("draft16 B=8 L=8k", hq, hkv, d, [(8192, 16, 0)] * 8, False),
           Work("prefill 2k hist 8k", hq, hkv, d, [(10240, 2048, 0)], True),
           Work("prefill 8k hist 0", hq, hkv, d, [(8192, 8192, 0)], True)]
    return dec, pre


def sweep():
    """Two groups in turn (decode tiles and splits; prefill tiles, warps and stages: one launch
    serves both, so the second group is timed on every case), each
    variant timed on the group's cases on top of the choices of the groups before; the
    variant with the lowest sum of times relative to the group's first variant wins."""
    defaults = {n: getattr(K, n) for n in KNOBS}
    chosen = dict(defaults)
    dec_cases, pre_cases = sweep_cases()
    report = []
    cases_ref = {}
    for group, variants, cases in (("decode", SWEEP_DEC, dec_cases), ("prefill", SWEEP_PRE, dec_cases + pre_cases)):
        base = dict(chosen)
        best, best_t = None, float("inf")
        for var in variants:
            for n, val in {**base, **var}.items():
                setattr(K, n, val)
            line, tot = [], 0.0
            for w in cases:
                try:
                    us, _ = run_ours(w)
                    tot += us / cases_ref.setdefault((group, w.name), us)
                    line.append(f"{w.name}: {us:8.1f} us {w.bytes / us / 1e6:5.2f} TB/s {w.flops / us / 1e6:6.1f} TF")
                except Exception as e:  # noqa: BLE001
                    tot = float("inf")
                    line.append(f"{w.name}: err {type(e).__name__} {str(e)[:120]}")
                torch.cuda.empty_cache()
            log(f"sweep {group} {var}: sum of ratios {tot:.3f} | " + " | ".join(line))
            report.append(f"| {group} `{var}` | {tot:.3f} | " + "; ".join(x.replace("|", "/") for x in line) + " |")
            if tot < best_t:
                best, best_t = var, tot
        if best is not None:
            chosen.update(best)
    for n in KNOBS:  # the table is timed with the module's defaults, not the sweep's choice
        setattr(K, n, defaults[n])
    log(f"fastest on the sweep cases: {chosen}; module defaults: {defaults}")
    return chosen, report


def profile():
    """Per-launch GPU time of one layer's attention (eager launches under torch.profiler,
    rotated K/V), next to the CUDA-graph time of the whole call: where the time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    dec_cases, pre_cases = sweep_cases()
    lines = []
    for w in dec_cases + pre_cases:
        try:
            fns, _, plan = ours_calls(w)
            graph_us, _ = time_fn(fns)
            for f in fns:
                f()
            torch.cuda.synchronize()
            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    for f in fns:
                        f()
                torch.cuda.synchronize()
            kern = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA]
            period = len(kern) // (3 * len(fns))
            parts = []
            for i in range(period):
                ds = sorted(d for _, d in kern[i::period])
                parts.append(f"{kern[i][0][:24]} {ds[len(ds) // 2]:.1f}")
            hdr = plan[:6].tolist()
            line = (f"{w.name}: graph {graph_us:.1f} us = " + " + ".join(parts)
                    + f" (+ gaps) | plan: blocks {hdr[0]} items {hdr[1]} split blocks {hdr[2]} chunk {hdr[3]}")
        except Exception as e:  # noqa: BLE001
            line = f"{w.name}: profile failed: {type(e).__name__}: {str(e)[:160]}"
        log("profile " + line)
        lines.append(line)
        torch.cuda.empty_cache()
    return lines


def fmt(us):
    return "—" if us is None else f"{us:,.1f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="docs/benchmarks_gpu_sdpa.md")
    ap.add_argument("--sweep", action="store_true",
                    help="time tile/warp/stage/launch variants of our kernel first (reported; the table keeps the defaults)")
    ap.add_argument("--profile", action="store_true", help="per-launch GPU times of our kernel on the sweep cases")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--compare", help="another version of the kernel module (a .py file), timed beside ours")
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting new cases after this many seconds")
    args = ap.parse_args()
    t_start = time.time()
    torch.manual_seed(0)
    prop = torch.cuda.get_device_properties(0)
    log(f"GPU {prop.name}, {prop.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {__import__('triton').__version__}")

    # ceilings
    big = {"x": torch.randn(2 * 1024 ** 3, device=DEV, dtype=DT)}  # 4 GiB
    us, _ = time_fn([lambda: big["x"].sum()], reps=10)
    read_tbs = big["x"].numel() * 2 / us / 1e6
    big = {"a": torch.randn(8192, 8192, device=DEV, dtype=DT), "b": torch.randn(8192, 8192, device=DEV, dtype=DT)}
    us, _ = time_fn([lambda: big["a"] @ big["b"]], reps=10)
    mm_tf = 2 * 8192 ** 3 / us / 1e6
    big.clear()
    torch.cuda.empty_cache()
    log(f"read bandwidth (sum over 4 GiB bf16): {read_tbs:.2f} TB/s; bf16 matmul 8192^3: {mm_tf:.0f} TFLOP/s")

    prev = load_module(args.compare) if args.compare else None
    profile_report = profile() if args.profile else []
    chosen, sweep_report = None, []
    if args.sweep:
        chosen, sweep_report = sweep()
    cases = build_cases(args.quick)
    log(f"{len(cases)} cases")
    rows = []
    skipped = []
    for kind, w in cases:
        t0 = time.time()
        if t0 - t_start > args.budget_s:
            skipped.append(f"{w.hq}/{w.hkv} D{w.d} {w.name}")
            continue
        try:
            ours, plan_us = run_ours(w)
        except Exception as e:  # noqa: BLE001
            log(f"  ours failed on {w.name}: {type(e).__name__}: {e}")
            ours = plan_us = None
        torch.cuda.empty_cache()
        prev_us = None
        if prev is not None:
            try:  # timed twice around a second time of ours: the two versions side by side
                prev_us = run_ours(w, prev)[0]
                ours = min(ours, run_ours(w)[0]) if ours else ours
                prev_us = min(prev_us, run_ours(w, prev)[0])
            except Exception as e:  # noqa: BLE001
                log(f"  --compare failed on {w.name}: {type(e).__name__}: {e}")
            torch.cuda.empty_cache()
        peers = {}
        for pname, fn in (("sdpa", run_sdpa), ("varlen", run_varlen), ("flex", run_flex), ("et", run_et)):
            if pname == "flex" and (f"{w.hq}/{w.hkv} D{w.d} {w.name}" not in FLEX_CASES or args.no_flex):
                peers[pname] = (None, "not run")
                continue
            if kind == "wrap":
                peers[pname] = (None, "= uniform")
                continue
            try:
                peers[pname] = fn(w)
            except Exception as e:  # noqa: BLE001
                peers[pname] = (None, f"err {type(e).__name__}")
                log(f"  {pname} failed on {w.name}: {type(e).__name__}: {str(e)[:200]}")
            torch.cuda.empty_cache()
        tbs = w.bytes / ours / 1e6 if ours else None
        tf = w.flops / ours / 1e6 if ours else None
        row = dict(kind=kind, name=f"{w.hq}/{w.hkv} D{w.d} {w.name}", kv=w.kv_read / GB, ours=ours, plan=plan_us, prev=prev_us,
                   tbs=tbs, tf=tf,
                   peers=peers, bytes=w.bytes, flops=w.flops)
        rows.append(row)
        ps = "  ".join(f"{k}={fmt(v[0])}{'(' + v[1] + ')' if v[1] else ''}" for k, v in peers.items())
        log(f"[{time.time() - t_start:6.1f}s] {row['name']}: KV {row['kv']:.3f} GB  ours {fmt(ours)} us"
            f" (+ plan {fmt(plan_us)} us per step)" + (f" prev {fmt(prev_us)} us" if prev is not None else "") +
            f"  {tbs or 0:.2f} TB/s  {tf or 0:.1f} TFLOP/s | {ps}  ({time.time() - t0:.1f}s)")

    log("numerics ...")
    num = []
    for hq, hkv, d, n, nq, b in [(32, 8, 128, 8192, 1, 4), (32, 8, 128, 2048, 512, 1), (16, 2, 256, 4096, 16, 2)]:
        try:
            eo, ep = numerics(hq, hkv, d, n, nq, b)
            num.append((f"{hq}/{hkv} D{d} B={b} keys={n} q/seq={nq}", eo, ep))
            log(f"  {num[-1]}")
        except Exception as e:  # noqa: BLE001
            log(f"  numerics failed: {type(e).__name__}: {e}")

    # markdown
    cmd = "PYTHONUNBUFFERED=1 python bench/sdpa_varlen.py " + " ".join(sys.argv[1:])
    md = ["# sdpa_varlen (Triton) on GPU", "",
          f"- command: `{cmd}`", f"- date: {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC",
          f"- GPU: {prop.name} ({prop.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}",
          f"- measured ceilings: read {read_tbs:.2f} TB/s (torch.sum over 4 GiB bf16), "
          f"bf16 matmul {mm_tf:.0f} TFLOP/s (8192^3, random data)",
          "- times: µs per call, median over CUDA-graph replays; K/V rotated over several buffers "
          "(≥ 150 MB per replay) so reads come from HBM, not L2",
          "- TB/s = (bytes of K/V actually read + Q + O) / our time; TFLOP/s = 4·D·Hq·(visible query-key pairs) / our time",
          "- ours: K/V in the column store [rows·columns, Hkv, D], seq_info describing the runs. 'ours µs' is "
          "one layer's attention (one launch; split blocks merged in it) along a plan computed beforehand: a lowered model plans once "
          "per step and layer kind (`kvcache::sdpa_varlen_plan`) and every layer of that kind reuses it; "
          "'plan µs' is that plan alone (one launch), to be spread over the layers of a kind",
          "- sdpa: F.scaled_dot_product_attention on padded contiguous [B,H,L,D] (enable_gqa; key-padding mask "
          "for skewed lengths; prefill with history: KV heads repeated + causal_lower_right)",
          "- varlen: torch.nn.attention.varlen.varlen_attn on packed contiguous K/V "
          + ("(enable_gqa)" if "enable_gqa" in _VARLEN_PARAMS else "with KV heads repeated (no enable_gqa in this torch)")
          + "; packing not timed",
          "- flex: FlexAttention (torch.compile, block mask) on the few shapes marked; 'not run' elsewhere "
          "(compile per shape does not fit the time)",
          "- et: ExecuTorch Triton SDPA (sdpa_decode_splitk, uniform decode only) "
          + ("" if et_decode is not None else "— n/a: executorch not importable on this machine"),
          "- mixed step: sdpa = two calls (the decodes, then the chunk) in one graph",
          "- peers skipped ('mem') where their padded/repeated K/V would pass 30 GB"]
    if prev is not None:
        md.append(f"- prev: the kernel module `{args.compare}` on the same inputs; with it, ours and prev are each the "
                  "lower of two medians, timed alternately (ours, prev, ours, prev)")
    md += ["", "| case | KV GB | ours µs | plan µs | ours TB/s | ours TFLOP/s | sdpa µs | varlen µs | flex µs | et µs | ours/sdpa |"
           + (" prev µs | prev/ours |" if prev is not None else ""),
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if prev is not None else "")]
    for r in rows:
        p = r["peers"]

        def cell(k):
            v, note = p.get(k, (None, ""))
            return fmt(v) if v is not None else (note or "—")
        sd = p.get("sdpa", (None, ""))[0]
        ratio = f"{sd / r['ours']:.2f}x" if sd and r["ours"] else "—"
        md.append(f"| {r['name']} | {r['kv']:.3f} | {fmt(r['ours'])} | {fmt(r['plan'])} | {r['tbs'] or 0:.2f} | {r['tf'] or 0:.1f} | "
                  f"{cell('sdpa')} | {cell('varlen')} | {cell('flex')} | {cell('et')} | {ratio} |"
                  + (f" {fmt(r['prev'])} | {r['prev'] / r['ours']:.2f}x |" if r["prev"] and r["ours"] else
                     (" — | — |" if prev is not None else "")))
    md += ["", "ours/sdpa > 1 means ours is faster.", "",
           "## Numerics (max abs error vs fp32 math SDPA on the same data)", "",
           "| case | ours bf16 | PyTorch SDPA bf16 |", "|---|---:|---:|"]
    for name, eo, ep in num:
        md.append(f"| {name} | {eo:.2e} | {ep:.2e} |")
    if chosen is not None:
        md += ["", "## Tile sweep (our kernel; the table above uses the module defaults)", "",
               f"fastest on the sweep cases: `{chosen}`", "",
               "module defaults: `" + str({n: getattr(K, n) for n in KNOBS}) + "`", "",
               "| variant | sum of time ratios | cases |", "|---|---:|---|"] + sweep_report
    if profile_report:
        md += ["", "## Profile (our kernel, per launch, median µs under torch.profiler, before the sweep)", ""]
        md += [f"- {x}" for x in profile_report]
    if skipped:
        md += ["", f"Not run (time budget of {args.budget_s:.0f} s spent): " + ", ".join(skipped)]
    md.append("")
    md.append(f"Total bench wall time: {time.time() - t_start:.0f} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(md) + "\n")
    log("\n".join(md))


if __name__ == "__main__":
    main()
