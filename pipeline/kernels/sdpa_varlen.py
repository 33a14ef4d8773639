"""Triton implementation of ``kvcache::sdpa_varlen`` (contract in ``reference.py``).

Registered through ``torch.library.triton_op`` (so it survives ``torch.export``
and AOTInductor, ExecuTorch's CUDA backend) in two forms:

- ``kvcache::sdpa_varlen_triton``: the signature of ``kvcache::sdpa_varlen``, one call.
- ``kvcache::sdpa_varlen_plan`` + ``kvcache::sdpa_varlen_attend``: the same split in
  two, which ``lower_kv`` emits for ``backend=cuda``: the plan depends only on the
  step buffers and the bounds, so a lowered model computes it once per step and
  layer kind, and each layer only attends.

The kernels, with no host synchronisation (the attention kernel launched once for all
blocks; ``SPLIT_LAUNCH`` launches it twice, one-token and multi-token blocks apart,
each with its own warps and stages):

1. ``_plan_kernel`` (one program) splits the query tokens into *blocks* (at most
   ``TOKB`` consecutive tokens of one column with consecutive positions; a new
   block starts on a column change, a position break, or a position that is a
   multiple of ``TOKB``), finds each block's (at most two) segments through a
   per-column table built from ``seq_info``, trims them to the keys that the
   causal and window bounds leave visible, and cuts the visible keys of each
   block into splits of ``chunk`` keys, where ``chunk`` comes from the total
   visible work on the device: ``max(min_chunk, total / target_items)``.  It
   writes a work list of (block, split) items, one self-contained record each.
   The number of blocks is bounded from shapes by
   ``min(T, T // TOKB + 2 * min(T, columns) + 1)``; this holds when each
   sequence's tokens are contiguous in q (the contract).
2. ``_sdpa_varlen_fwd`` (grid = upper bound of items x Hkv, from shapes only;
   programs past the real item count exit) processes one item for one KV head:
   a query tile of the block's tokens x the G = Hq/Hkv query heads that share
   the KV head (rows = token * G_PAD + head), so K/V are read once per KV head.
   Blocks of one token (decode) use a small [max(16, G_PAD), D] tile; longer
   blocks (prefill chunks, draft blocks) a [BLOCK_M, D] tile on the tensor
   cores.  Unsplit blocks write the normalised output directly; split blocks
   write fp32 partials (acc, max, sum) to a scratch pool.
3. ``_merge_kernel`` merges the partials of split blocks with a log-sum-exp, one
   program per (split block, KV head, slice of the head dim), loading many splits
   at a time.

Scores, softmax and accumulation are fp32; P is cast to V's dtype for the
second product (as in FlashAttention).  A query that sees no key gets zeros.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

# Tuning knobs (module constants, read at each call; tests force small splits
# through the keywords of ``sdpa_varlen_triton_impl``).  Key tiles are given for
# D <= 128 and halved for larger head dims.
DEC_BLOCK_N = 64  # keys per inner tile, one-token (decode) blocks
DEC_WARPS = 4
DEC_STAGES = 2  # chosen by bench/sdpa_varlen.py --sweep on an H200 (docs/benchmarks_gpu_sdpa.md)
PRE_BLOCK_M = 64  # rows (tokens x heads) of a multi-token (prefill / draft) tile
PRE_BLOCK_N = 64
PRE_WARPS = 4
PRE_STAGES = 3
SPLIT_LAUNCH = False  # True: decode and multi-token blocks in two launches (own warps / stages);
# one launch won 9 of 11 sweep cases on the H200 (docs/benchmarks.md), by up to 10% (skewed decode)
TARGET_CTAS = 528  # ~4 programs per SM of an H200 (132 SMs); splits aim at this many
MIN_CHUNK = 256  # smallest split (keys); rounded up to the key tile

_NBF = 12  # int32 fields per block in the plan
_HDR = 16  # header words of the plan
_CH = 1024  # vector width of the plan kernel's passes
_MERGE_TILE = 8192  # fp32 partial elements per merge load (splits x rows x DV / MERGE_DV_SPLIT)
MERGE_DV_SPLIT = 4  # merge programs per (split block, KV head), each on DV / this columns (a power of two)
_LOG2E = 1.4426950408889634


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


# --------------------------------------------------------------------------- plan
@triton.jit
def _live_segment(seq_info, s, S, columns):
    """Column of segments s and whether each is a real, non-empty segment of a valid column."""
    sv = s < S
    scol = tl.load(seq_info + s * 4, mask=sv, other=0)
    scnt = tl.load(seq_info + s * 4 + 2, mask=sv, other=0)
    return scol, sv & (scnt > 0) & (scol >= 0) & (scol < columns)


@triton.jit
def _trim_segment(seq_info, s, lo, hi_):
    """Segment s (-1: none) trimmed to the positions [lo, hi_]: its first row, the rows
    skipped, the rows kept and its first position."""
    has = s >= 0
    first_row = tl.load(seq_info + s * 4 + 1, mask=has, other=0)
    count = tl.load(seq_info + s * 4 + 2, mask=has, other=0)
    first_pos = tl.load(seq_info + s * 4 + 3, mask=has, other=0)
    skip = tl.minimum(tl.maximum(lo - first_pos, 0), count)
    end = tl.minimum(tl.maximum(hi_ - first_pos + 1, 0), count)
    return first_row, skip, tl.where(has, tl.maximum(end - skip, 0), 0), first_pos


@triton.jit
def _plan_kernel(
    q_pos, q_cols, seq_info, plan, col_seg,
    T, S, columns, window, NB_MAX, W_MAX, TARGET, MIN_CHUNK_K,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, TOKB: tl.constexpr,
    BN: tl.constexpr, CH: tl.constexpr, NBF: tl.constexpr, HDR: tl.constexpr,
):
    offs = tl.arange(0, CH)
    blk = plan + HDR
    items = blk + NB_MAX * NBF
    marks = items + W_MAX
    split_blk = marks + W_MAX
    recs = split_blk + TARGET
    # P0: clear the per-column segment table and the item marks.
    for base in range(0, columns, CH):
        c = base + offs
        tl.store(col_seg + c * 2, tl.full([CH], -1, tl.int32), mask=c < columns)
        tl.store(col_seg + c * 2 + 1, tl.full([CH], -1, tl.int32), mask=c < columns)
    for base in range(0, W_MAX, CH):
        w = base + offs
        tl.store(marks + w, tl.zeros([CH], tl.int32), mask=w < W_MAX)
    tl.debug_barrier()
    # P1: block heads -> tok0 of each block; first segment of each column.
    nb = tl.full([], 0, tl.int32)
    for base in range(0, T, CH):
        i = base + offs
        valid = i < T
        has_prev = valid & (i > 0)
        col = tl.load(q_cols + i, mask=valid, other=-1)
        pcol = tl.load(q_cols + i - 1, mask=has_prev, other=-1)
        pos = tl.load(q_pos + i, mask=valid, other=0)
        ppos = tl.load(q_pos + i - 1, mask=has_prev, other=0)
        head = valid & ((i == 0) | (col != pcol) | (pos != ppos + 1) | ((pos % TOKB) == 0))
        hi = head.to(tl.int32)
        rank = nb + tl.cumsum(hi, 0) - 1
        keep = head & (rank < NB_MAX)
        tl.store(blk + rank * NBF, i, mask=keep)
        tl.store(blk + rank * NBF + 4, pos.to(tl.int32), mask=keep)  # first query position
        tl.store(blk + rank * NBF + 11, col.to(tl.int32), mask=keep)
        nb += tl.sum(hi, 0)
    nb = tl.minimum(nb, NB_MAX)
    for base in range(0, S, CH):
        s = base + offs
        scol, ok = _live_segment(seq_info, s, S, columns)
        tl.store(col_seg + scol * 2, s, mask=ok)
    tl.debug_barrier()
    # P2: second segment of each column (the one that did not win slot 0).
    for base in range(0, S, CH):
        s = base + offs
        scol, ok = _live_segment(seq_info, s, S, columns)
        first = tl.load(col_seg + scol * 2, mask=ok, other=-1, volatile=True)
        tl.store(col_seg + scol * 2 + 1, s, mask=ok & (first != s))
    tl.debug_barrier()
    # P3: per block: tokens, visible key ranges of its segments, work.
    total = tl.full([], 0, tl.int64)
    for base in range(0, nb, CH):
        b = base + offs
        bv = b < nb
        tok0 = tl.load(blk + b * NBF, mask=bv, other=0, volatile=True)
        nxt = tl.load(blk + (b + 1) * NBF, mask=bv & (b + 1 < nb), other=0, volatile=True)
        tok_end = tl.where(b + 1 < nb, nxt, T)
        ntok = tok_end - tok0
        col = tl.load(blk + b * NBF + 11, mask=bv, other=0, volatile=True).to(tl.int64)
        pmin = tl.load(blk + b * NBF + 4, mask=bv, other=0, volatile=True).to(tl.int64)
        pmax = pmin + ntok - 1
        colok = bv & (col >= 0) & (col < columns)
        s0 = tl.load(col_seg + col * 2, mask=colok, other=-1, volatile=True)
        s1 = tl.load(col_seg + col * 2 + 1, mask=colok, other=-1, volatile=True)
        big = 1 << 60
        if HAS_WINDOW:
            lo = pmin - window + 1
        else:
            lo = pmin * 0 - big
        if CAUSAL:
            hi_ = pmax
        else:
            hi_ = pmax * 0 + big
        f0, a0, n0, p0 = _trim_segment(seq_info, s0, lo, hi_)
        f1, a1, n1, p1 = _trim_segment(seq_info, s1, lo, hi_)
        bp = blk + b * NBF
        tl.store(bp + 1, ntok.to(tl.int32), mask=bv)
        tl.store(bp + 2, (f0 + a0).to(tl.int32), mask=bv)
        tl.store(bp + 3, n0.to(tl.int32), mask=bv)
        tl.store(bp + 4, (p0 + a0).to(tl.int32), mask=bv)
        tl.store(bp + 5, (f1 + a1).to(tl.int32), mask=bv)
        tl.store(bp + 6, n1.to(tl.int32), mask=bv)
        tl.store(bp + 7, (p1 + a1).to(tl.int32), mask=bv)
        tl.store(bp + 11, col.to(tl.int32), mask=bv)
        total += tl.sum(tl.where(bv, n0 + n1, 0).to(tl.int64), 0)
    chunk = tl.maximum((total + TARGET - 1) // TARGET, MIN_CHUNK_K)
    chunk = (((chunk + BN - 1) // BN) * BN).to(tl.int32)
    tl.debug_barrier()
    # P4: splits per block, item starts, partial slots, list of split blocks.
    n_items = tl.full([], 0, tl.int32)
    n_pslots = tl.full([], 0, tl.int32)
    n_split = tl.full([], 0, tl.int32)
    for base in range(0, nb, CH):
        b = base + offs
        bv = b < nb
        bp = blk + b * NBF
        n0 = tl.load(bp + 3, mask=bv, other=0, volatile=True)
        n1 = tl.load(bp + 6, mask=bv, other=0, volatile=True)
        work = n0 + n1
        ns = tl.where(bv, tl.maximum((work + chunk - 1) // chunk, 1), 0)
        start = n_items + tl.cumsum(ns, 0) - ns
        is_split = bv & (ns > 1)
        nsp = tl.where(is_split, ns, 0)
        pstart = n_pslots + tl.cumsum(nsp, 0) - nsp
        srank = n_split + tl.cumsum(is_split.to(tl.int32), 0) - 1
        tl.store(bp + 8, ns, mask=bv)
        tl.store(bp + 9, start, mask=bv)
        tl.store(bp + 10, tl.where(is_split, pstart, -1), mask=bv)
        tl.store(split_blk + srank, b, mask=is_split)
        tl.store(marks + start, tl.full([CH], 1, tl.int32), mask=bv & (start < W_MAX))
        n_items += tl.sum(ns, 0)
        n_pslots += tl.sum(nsp, 0)
        n_split += tl.sum(is_split.to(tl.int32), 0)
    n_items = tl.minimum(n_items, W_MAX)
    tl.debug_barrier()
    # P5: block of each item = (number of block starts <= item) - 1; one
    # self-contained record per item, so that a program needs one level of loads.
    run = tl.full([], 0, tl.int32)
    for base in range(0, n_items, CH):
        w = base + offs
        wv = w < n_items
        mk = tl.load(marks + w, mask=wv, other=0, volatile=True)
        b = run + tl.cumsum(mk, 0) - 1
        run += tl.sum(mk, 0)
        tl.store(items + w, b, mask=wv)
        bp = blk + b * NBF
        n0 = tl.load(bp + 3, mask=wv, other=0, volatile=True)
        n1 = tl.load(bp + 6, mask=wv, other=0, volatile=True)
        istart = tl.load(bp + 9, mask=wv, other=0, volatile=True)
        bps = tl.load(bp + 10, mask=wv, other=-1, volatile=True)
        sp = w - istart
        kstart = sp * chunk
        kend = tl.minimum(kstart + chunk, n0 + n1)
        rp = recs + w * NBF
        for f in tl.static_range(0, 8):
            tl.store(rp + f, tl.load(bp + f, mask=wv, other=0, volatile=True), mask=wv)
        tl.store(rp + 8, kstart, mask=wv)
        tl.store(rp + 9, kend, mask=wv)
        tl.store(rp + 10, tl.where(bps >= 0, bps + sp, -1), mask=wv)
        tl.store(rp + 11, tl.load(bp + 11, mask=wv, other=0, volatile=True), mask=wv)
    tl.store(plan + 0, nb)
    tl.store(plan + 1, n_items)
    tl.store(plan + 2, n_split)
    tl.store(plan + 3, chunk)
    tl.store(plan + 4, total)
    tl.store(plan + 5, n_pslots)


# ------------------------------------------------------------------ attention tile
@triton.jit
def _attend(
    q, k, v, out, q_pos, part_o, part_ml,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    h, col, columns, tok0, ntok, row0, n0, pos0, row1, pos1, kstart, kend,
    pslot, scale_log2, window,
    M: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BN: tl.constexpr, PM: tl.constexpr, ROW_MASK: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    r = tl.arange(0, M)
    tok_in = r // G_PAD
    hg = r % G_PAD
    rvalid = (tok_in < ntok) & (hg < G)
    tok = tok0 + tok_in
    qhead = h * G + hg
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    qp = q + tok.to(tl.int64)[:, None] * stride_qt + qhead[:, None] * stride_qh + offs_d[None, :]
    qt = tl.load(qp, mask=rvalid[:, None], other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    if ROW_MASK:
        qpos = tl.load(q_pos + tok, mask=rvalid, other=0).to(tl.int32)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DV], tl.float32)
    offs_n = tl.arange(0, BN)
    kbase = k + h * stride_kh
    vbase = v + h * stride_vh
    for j in range(kstart, kend, BN):
        idx = j + offs_n
        kv = idx < kend
        in0 = idx < n0
        row = tl.where(in0, row0 + idx, row1 + (idx - n0))
        slot = row.to(tl.int64) * columns + col
        kt = tl.load(kbase + slot[:, None] * stride_kn + offs_d[None, :], mask=kv[:, None], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        if IEEE:
            s = tl.dot(qt, tl.trans(kt), input_precision="ieee")
        else:
            s = tl.dot(qt, tl.trans(kt))
        s = (s * scale_log2).to(tl.float32)  # AOTInductor passes float scalars as fp64
        vis = kv[None, :]
        if ROW_MASK:
            kpos = tl.where(in0, pos0 + idx, pos1 + (idx - n0))
            if CAUSAL:
                vis = vis & (kpos[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                vis = vis & ((qpos[:, None] - kpos[None, :]) < window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(vbase + slot[:, None] * stride_vn + offs_dv[None, :], mask=kv[:, None], other=0.0)
        if UPCAST:
            # Triton's interpreter gets bf16 dots wrong: round P to bf16, dot in fp32
            pc = p.to(tl.bfloat16).to(tl.float32)
            vt = vt.to(tl.float32)
        else:
            pc = p.to(vt.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pc, vt, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pc, vt)
        m_i = m_new
    if pslot < 0:
        inv = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
        o = acc * inv[:, None]
        op = out + tok.to(tl.int64)[:, None] * stride_ot + qhead[:, None] * stride_oh + offs_dv[None, :]
        tl.store(op, o.to(out.dtype.element_ty), mask=rvalid[:, None])
    else:
        base = (pslot.to(tl.int64) * tl.num_programs(1) + h) * PM
        tl.store(part_o + (base + r)[:, None] * DV + offs_dv[None, :], acc, mask=rvalid[:, None])
        tl.store(part_ml + (base + r) * 2, m_i, mask=rvalid)
        tl.store(part_ml + (base + r) * 2 + 1, l_i, mask=rvalid)


@triton.jit
def _sdpa_varlen_fwd(
    q, k, v, out, q_pos, plan, part_o, part_ml,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    columns, scale_log2, window, REC_OFF,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, M_DEC: tl.constexpr, BN_DEC: tl.constexpr, BN_PRE: tl.constexpr,
    MODE: tl.constexpr,  # 0: all blocks, 1: one-token blocks only, 2: multi-token blocks only
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    NBF: tl.constexpr, HDR: tl.constexpr,
):
    p = tl.program_id(0)
    h = tl.program_id(1)
    # all loads independent of each other: the item record (p < W_MAX is in bounds)
    n_items = tl.load(plan + 1)
    rp = plan + REC_OFF + p * NBF
    tok0 = tl.load(rp + 0)
    ntok = tl.load(rp + 1)
    row0 = tl.load(rp + 2)
    n0 = tl.load(rp + 3)
    pos0 = tl.load(rp + 4)
    row1 = tl.load(rp + 5)
    pos1 = tl.load(rp + 7)
    kstart = tl.load(rp + 8)
    kend = tl.load(rp + 9)
    pslot = tl.load(rp + 10)
    col = tl.load(rp + 11)
    if p < n_items:
        if ntok == 1:
            # one token: the trimmed key range is exactly the visible one
            if MODE != 2:
                _attend(q, k, v, out, q_pos, part_o, part_ml,
                    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
                    h, col, columns, tok0, ntok, row0, n0, pos0, row1, pos1, kstart, kend,
                    pslot, scale_log2, window,
                    M_DEC, G, G_PAD, D, DV, BN_DEC, BLOCK_M, False, CAUSAL, HAS_WINDOW, IEEE, UPCAST)
        else:
            if MODE != 1:
                _attend(q, k, v, out, q_pos, part_o, part_ml,
                    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
                    h, col, columns, tok0, ntok, row0, n0, pos0, row1, pos1, kstart, kend,
                    pslot, scale_log2, window,
                    BLOCK_M, G, G_PAD, D, DV, BN_PRE, BLOCK_M, True, CAUSAL, HAS_WINDOW, IEEE, UPCAST)


# ------------------------------------------------------------------------- merge
@triton.jit
def _merge_rows(
    out, part_o, part_ml, stride_ot, stride_oh, h, hkv, tok0, ntok, ns, pslot, offs_dv,
    G: tl.constexpr, G_PAD: tl.constexpr, DV: tl.constexpr, DVB: tl.constexpr, PM: tl.constexpr,
    R: tl.constexpr, SPL: tl.constexpr,
):
    """Log-sum-exp merge of the ns partials of one block for one KV head: R rows
    (token * G_PAD + head, as in the attention tile) at once, SPL splits per load."""
    r = tl.arange(0, R)
    tok_in = r // G_PAD
    hg = r % G_PAD
    rvalid = (tok_in < ntok) & (hg < G)
    sp = tl.arange(0, SPL)
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, DVB], tl.float32)
    for s0 in range(0, ns, SPL):
        sidx = s0 + sp
        rows = ((pslot + sidx).to(tl.int64) * hkv + h)[:, None] * PM + r[None, :]
        ok = (sidx < ns)[:, None] & rvalid[None, :]  # [SPL, R]
        ms = tl.load(part_ml + rows * 2, mask=ok, other=float("-inf"))
        ls = tl.load(part_ml + rows * 2 + 1, mask=ok, other=0.0)
        os_ = tl.load(part_o + rows[:, :, None] * DV + offs_dv[None, None, :], mask=ok[:, :, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(ms, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.math.exp2(m_i - m_use)
        c = tl.math.exp2(ms - m_use[None, :])  # masked splits: exp2(-inf) = 0
        acc = acc * a[:, None] + tl.sum(os_ * c[:, :, None], 0)
        l_i = l_i * a + tl.sum(ls * c, 0)
        m_i = m_new
    inv = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
    o = acc * inv[:, None]
    op = (out + (tok0 + tok_in).to(tl.int64)[:, None] * stride_ot + (h * G + hg)[:, None] * stride_oh
          + offs_dv[None, :])
    tl.store(op, o.to(out.dtype.element_ty), mask=rvalid[:, None])


@triton.jit
def _merge_kernel(
    out, plan, part_o, part_ml, stride_ot, stride_oh, NB_MAX, W_MAX,
    G: tl.constexpr, G_PAD: tl.constexpr, DV: tl.constexpr, DVB: tl.constexpr, PM: tl.constexpr,
    SPL_DEC: tl.constexpr, SPL_PRE: tl.constexpr, NBF: tl.constexpr, HDR: tl.constexpr,
):
    """One program per (split block, KV head, DVB columns of the output): all the block's
    rows at once (a one-token block: G_PAD rows, many splits per load; a longer block:
    its tile's PM rows, fewer splits per load).  A few long sequences' merges would sit
    on a few SMs without the head-dim slices."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    n_split = tl.load(plan + 2)
    if j < n_split:
        blk = plan + HDR
        b = tl.load(blk + NB_MAX * NBF + 2 * W_MAX + j)
        bp = blk + b * NBF
        tok0 = tl.load(bp + 0)
        ntok = tl.load(bp + 1)
        ns = tl.load(bp + 8)
        pslot = tl.load(bp + 10)
        offs_dv = tl.program_id(2) * DVB + tl.arange(0, DVB)
        if ntok == 1:
            _merge_rows(out, part_o, part_ml, stride_ot, stride_oh, h, tl.num_programs(1), tok0, ntok, ns, pslot,
                        offs_dv, G, G_PAD, DV, DVB, PM, G_PAD, SPL_DEC)
        else:
            _merge_rows(out, part_o, part_ml, stride_ot, stride_oh, h, tl.num_programs(1), tok0, ntok, ns, pslot,
                        offs_dv, G, G_PAD, DV, DVB, PM, PM, SPL_PRE)


# ------------------------------------------------------------------------ launch
def _interpreted() -> bool:
    return type(_sdpa_varlen_fwd).__name__ == "InterpretedFunction"


def _sym_min(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return torch.sym_min(a, b)


@dataclass(frozen=True)
class Geometry:
    """Tiles and buffer sizes of one call, from shapes and the tuning constants only.
    Sizes are SymInts under tracing; the plan op and the attention op agree on them."""
    g: int
    g_pad: int
    block_m: int
    tokb: int
    m_dec: int
    bn_dec: int
    bn_pre: int
    dec_stages: int
    pre_stages: int
    min_chunk: int
    target_items: int
    nb_max: object
    w_max: object
    rec_off: object
    plan_len: object


def geometry(n_tok, columns: int, hq: int, hkv: int, d: int, dv: int, elem_bytes: int,
             *, block_n: int | None = None, target_ctas: int | None = None, min_chunk: int | None = None) -> Geometry:
    target_ctas = TARGET_CTAS if target_ctas is None else target_ctas
    g = hq // hkv
    g_pad = _next_pow2(g)
    # key tiles are tuned for 2-byte elements and D <= 128: shrink for more bytes per key
    shrink = max(1, max(d, dv) * elem_bytes // 256)
    block_m = max(PRE_BLOCK_M, 2 * g_pad)
    tokb = block_m // g_pad
    # upper bounds from shapes only (no host sync); blocks: see the module docstring
    nb_max = _sym_min(n_tok, n_tok // tokb + 2 * _sym_min(n_tok, columns) + 1)
    target_items = max(1, -(-target_ctas // hkv))
    w_max = nb_max + target_items
    rec_off = _HDR + nb_max * _NBF + 2 * w_max + target_items
    return Geometry(
        g=g, g_pad=g_pad, block_m=block_m, tokb=tokb, m_dec=max(16, g_pad),
        bn_dec=block_n if block_n is not None else max(16, DEC_BLOCK_N // shrink),
        bn_pre=block_n if block_n is not None else max(16, PRE_BLOCK_N // shrink),
        dec_stages=DEC_STAGES if elem_bytes <= 2 else 2, pre_stages=PRE_STAGES if elem_bytes <= 2 else 2,
        min_chunk=MIN_CHUNK if min_chunk is None else min_chunk, target_items=target_items,
        nb_max=nb_max, w_max=w_max, rec_off=rec_off, plan_len=rec_off + w_max * _NBF,
    )


def _geometry_of(q: Tensor, k_store: Tensor, v_store: Tensor, columns: int, **tuning) -> Geometry:
    return geometry(q.shape[0], columns, q.shape[1], k_store.shape[1], q.shape[2], v_store.shape[-1],
                    q.element_size(), **tuning)


def plan_impl(q_pos: Tensor, q_cols: Tensor, seq_info: Tensor, columns: int, causal: bool, window: int,
              geo: Geometry, launch=None) -> Tensor:
    """The work list of one step for every layer that shares these step buffers and bounds."""
    wrap = launch if launch is not None else (lambda fn: fn)
    plan = torch.empty(geo.plan_len, dtype=torch.int32, device=q_pos.device)
    col_seg = torch.empty(2 * columns, dtype=torch.int32, device=q_pos.device)
    wrap(_plan_kernel)[(1,)](
        q_pos.contiguous(), q_cols.contiguous(), seq_info.contiguous(), plan, col_seg,
        q_pos.shape[0], seq_info.shape[0], columns, window, geo.nb_max, geo.w_max, geo.target_items, geo.min_chunk,
        CAUSAL=causal, HAS_WINDOW=window > 0, TOKB=geo.tokb, BN=max(geo.bn_dec, geo.bn_pre), CH=_CH,
        NBF=_NBF, HDR=_HDR, num_warps=4,
    )
    return plan


def attend_impl(q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, plan: Tensor, columns: int,
                scale: float, causal: bool, window: int, geo: Geometry, launch=None) -> Tensor:
    """Attention of one layer along a plan from ``plan_impl`` (1 or 2 attention launches + the merge)."""
    wrap = launch if launch is not None else (lambda fn: fn)
    n_tok, hq, d = q.shape
    hkv, dv = k_store.shape[1], v_store.shape[-1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_store = k_store if k_store.stride(-1) == 1 else k_store.contiguous()
    v_store = v_store if v_store.stride(-1) == 1 else v_store.contiguous()
    out = q.new_empty(n_tok, hq, dv)
    p_max = 2 * geo.target_items  # split items never exceed 2x the target (see the plan)
    part_o = torch.empty(p_max * hkv * geo.block_m * dv, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(p_max * hkv * geo.block_m * 2, dtype=torch.float32, device=q.device)
    fwd_args = (
        q, k_store, v_store, out, q_pos.contiguous(), plan, part_o, part_ml,
        q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1),
        v_store.stride(0), v_store.stride(1), out.stride(0), out.stride(1),
        columns, scale * _LOG2E, window, geo.rec_off,
    )
    fwd_kw = dict(
        G=geo.g, G_PAD=geo.g_pad, D=d, DV=dv, BLOCK_M=geo.block_m, M_DEC=geo.m_dec,
        CAUSAL=causal, HAS_WINDOW=window > 0, IEEE=q.dtype == torch.float32,
        UPCAST=_interpreted() and q.dtype == torch.bfloat16, NBF=_NBF, HDR=_HDR,
    )
    grid = (geo.w_max, hkv)
    if SPLIT_LAUNCH:
        # the tile of the other path is passed equal to this one's: no extra specialisations
        wrap(_sdpa_varlen_fwd)[grid](*fwd_args, MODE=1, BN_DEC=geo.bn_dec, BN_PRE=geo.bn_dec, **fwd_kw,
                                     num_warps=DEC_WARPS, num_stages=geo.dec_stages)
        wrap(_sdpa_varlen_fwd)[grid](*fwd_args, MODE=2, BN_DEC=geo.bn_pre, BN_PRE=geo.bn_pre, **fwd_kw,
                                     num_warps=PRE_WARPS, num_stages=geo.pre_stages)
    else:
        wrap(_sdpa_varlen_fwd)[grid](*fwd_args, MODE=0, BN_DEC=geo.bn_dec, BN_PRE=geo.bn_pre, **fwd_kw,
                                     num_warps=PRE_WARPS, num_stages=geo.pre_stages)
    dv_split = max(1, min(MERGE_DV_SPLIT, dv // 16))  # powers of two: slices of >= 16 columns
    dvb = dv // dv_split

    def spl(rows):  # splits per merge load: a power of two
        return min(64, 1 << (max(1, _MERGE_TILE // (rows * dvb)).bit_length() - 1))

    wrap(_merge_kernel)[(geo.target_items, hkv, dv_split)](
        out, plan, part_o, part_ml, out.stride(0), out.stride(1), geo.nb_max, geo.w_max,
        G=geo.g, G_PAD=geo.g_pad, DV=dv, DVB=dvb, PM=geo.block_m, SPL_DEC=spl(geo.g_pad), SPL_PRE=spl(geo.block_m),
        NBF=_NBF, HDR=_HDR, num_warps=4,
    )
    return out


def sdpa_varlen_triton_impl(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, q_cols: Tensor,
    seq_info: Tensor, columns: int, scale: float, causal: bool, window: int,
    *, block_n: int | None = None, target_ctas: int | None = None, min_chunk: int | None = None,
    launch=None, return_plan: bool = False,
):
    """Plan and attend in one call; keywords override the module's tuning constants
    (tests use them to force many splits).  ``launch`` wraps each kernel
    (``wrap_triton`` inside the op, identity when called directly)."""
    geo = _geometry_of(q, k_store, v_store, columns, block_n=block_n, target_ctas=target_ctas, min_chunk=min_chunk)
    plan = plan_impl(q_pos, q_cols, seq_info, columns, causal, window, geo, launch)
    out = attend_impl(q, k_store, v_store, q_pos, plan, columns, scale, causal, window, geo, launch)
    return (out, plan) if return_plan else out


@triton_op("kvcache::sdpa_varlen_triton", mutates_args=())
def sdpa_varlen_triton(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, q_cols: Tensor,
    seq_info: Tensor, columns: int, scale: float, causal: bool, window: int,
) -> Tensor:
    return sdpa_varlen_triton_impl(
        q, k_store, v_store, q_pos, q_cols, seq_info, columns, scale, causal, window, launch=wrap_triton,
    )


@sdpa_varlen_triton.register_fake
def _(q, k_store, v_store, q_pos, q_cols, seq_info, columns, scale, causal, window):
    return q.new_empty(q.shape[0], q.shape[1], v_store.shape[-1])


# The same computation as two ops, so that a lowered model plans once per step and layer
# kind (the plan depends only on the step buffers and the bounds) and attends per layer.
@triton_op("kvcache::sdpa_varlen_plan", mutates_args=())
def sdpa_varlen_plan(
    q_pos: Tensor, q_cols: Tensor, seq_info: Tensor, columns: int, causal: bool, window: int,
    n_q_heads: int, n_kv_heads: int, head_dim: int, v_head_dim: int, elem_bytes: int,
) -> Tensor:
    geo = geometry(q_pos.shape[0], columns, n_q_heads, n_kv_heads, head_dim, v_head_dim, elem_bytes)
    return plan_impl(q_pos, q_cols, seq_info, columns, causal, window, geo, launch=wrap_triton)


@sdpa_varlen_plan.register_fake
def _(q_pos, q_cols, seq_info, columns, causal, window, n_q_heads, n_kv_heads, head_dim, v_head_dim, elem_bytes):
    geo = geometry(q_pos.shape[0], columns, n_q_heads, n_kv_heads, head_dim, v_head_dim, elem_bytes)
    return q_pos.new_empty(geo.plan_len, dtype=torch.int32)


@triton_op("kvcache::sdpa_varlen_attend", mutates_args=())
def sdpa_varlen_attend(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, plan: Tensor,
    columns: int, scale: float, causal: bool, window: int,
) -> Tensor:
    geo = _geometry_of(q, k_store, v_store, columns)
    return attend_impl(q, k_store, v_store, q_pos, plan, columns, scale, causal, window, geo, launch=wrap_triton)


@sdpa_varlen_attend.register_fake
def _(q, k_store, v_store, q_pos, plan, columns, scale, causal, window):
    return q.new_empty(q.shape[0], q.shape[1], v_store.shape[-1])
