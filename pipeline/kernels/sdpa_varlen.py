"""Triton implementation of ``kvcache::sdpa_varlen`` (contract in ``reference.py``).

Registered through ``torch.library.triton_op`` (so it survives ``torch.export`` and
AOTInductor, ExecuTorch's CUDA backend) in two forms:

- ``kvcache::sdpa_varlen_triton``: the signature of ``kvcache::sdpa_varlen``, one call.
- ``kvcache::sdpa_varlen_plan`` + ``kvcache::sdpa_varlen_attend``: the same split in two,
  which ``lower_kv`` emits for ``backend=cuda``: the plan depends only on the step buffers
  and the bounds, so a lowered model computes it once per step and layer kind, and each
  layer only attends.

Two kernels, no host synchronisation:

1. ``_plan_kernel`` (one program) cuts the step into *blocks*: at most ``TOKB``
   consecutive query tokens of one column with consecutive positions (a new block starts
   on a column change, a position break, or a position that is a multiple of ``TOKB``).
   It finds each block's (at most two) segments through a per-column table built from
   ``seq_info``, trims them to the keys the causal and window bounds leave visible, and
   splits each block's visible keys into ``n`` equal *items*, ``n`` proportional to the
   block's share of the step's visible keys (``target_items`` items in all, about
   ``TARGET_CTAS`` programs with the KV heads), none shorter than ``MIN_CHUNK`` keys.
   It writes one self-contained record per item (the ``F_*`` fields below) and zeroes the
   merge tickets.  The number of blocks is bounded from shapes by
   ``min(T, T // TOKB + 2 * min(T, columns) + 1)``; this holds when each sequence's tokens
   are contiguous in q (the contract).
2. ``_sdpa_varlen_fwd`` (grid = upper bound of items x Hkv, from shapes only; programs
   past the real item count exit) processes one item for one KV head: a query tile of
   the block's tokens x the G = Hq/Hkv query heads that share the KV head (rows = token *
   G_PAD + head), so K/V are read once per KV head.  Blocks of one token (decode) use a
   small [max(16, G_PAD), D] tile; longer blocks (prefill chunks, draft blocks) a
   [BLOCK_M, D] tile.  Key tiles that every row of the block sees entirely skip the
   mask.  An unsplit block writes its output; a split block writes fp32 partials
   (acc, max, sum) to a scratch pool and takes a ticket (an atomic counter per block and
   KV head): the last of its items to finish merges all the partials with a
   log-sum-exp, in slot order (so the result does not depend on which finished last),
   and resets the ticket to zero for the next layer.

Scores, softmax and accumulation are fp32; P is cast to V's dtype for the second
product (as in FlashAttention).  A query that sees no key gets zeros.
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
PRE_BLOCK_M = 64  # rows (tokens x heads) of a multi-token (prefill / draft) tile
PRE_BLOCK_N = 64
WARPS = 4  # one launch serves decode and multi-token items: one warp count, one depth
STAGES = 3  # software pipelining depth; tiles, warps and stages chosen by bench/sdpa_varlen.py --sweep on an H200
TARGET_CTAS = 528  # ~4 programs per SM of an H200 (132 SMs); splits aim at this many
MIN_CHUNK = 256  # smallest split (keys); rounded up to the key tile
_MERGE_TILE = 8192  # fp32 partial elements per merge load (splits x rows x DV)
_LOG2E = 1.4426950408889634

# ---- the plan: int32 words.  [header | blocks | item marks | merge tickets | item records]
_HDR = 16  # header words: H_BLOCKS, H_ITEMS, H_SPLIT_BLOCKS, H_CHUNK, H_TOTAL, H_PSLOTS
H_BLOCKS = tl.constexpr(0)
H_ITEMS = tl.constexpr(1)
H_SPLIT_BLOCKS = tl.constexpr(2)
H_CHUNK = tl.constexpr(3)  # visible keys / target items: the nominal split (blocks round it to themselves)
H_TOTAL = tl.constexpr(4)  # visible keys of the step (per KV head)
H_PSLOTS = tl.constexpr(5)  # partial slots in use
# A block and an item record share one layout of _NBF fields; a record is its block's
# fields plus the item's own key range.
_NBF = 16
F_TOK0 = tl.constexpr(0)  # first query token (index into q)
F_NTOK = tl.constexpr(1)  # query tokens
F_ROW0 = tl.constexpr(2)  # segment 0: first visible row, visible rows, position of that row
F_N0 = tl.constexpr(3)
F_POS0 = tl.constexpr(4)
F_ROW1 = tl.constexpr(5)  # segment 1 (keys n0 .. n0 + n1 of the block's key index)
F_N1 = tl.constexpr(6)
F_POS1 = tl.constexpr(7)
F_COL = tl.constexpr(8)  # column (sequence) of the block
F_QPOS = tl.constexpr(9)  # position of the first query token (the others follow it)
F_NSPLIT = tl.constexpr(10)  # items of the block
F_ITEM0 = tl.constexpr(11)  # index of its first item
F_PSLOT0 = tl.constexpr(12)  # first partial slot (-1: one item, no partials); item i of the block uses PSLOT0 + i
F_CHUNK = tl.constexpr(13)  # keys per item (a multiple of the key tile)
F_KSTART = tl.constexpr(14)  # item only: its keys [KSTART, KEND) of the block's key index
F_KEND = tl.constexpr(15)
_CH = 1024  # vector width of the plan kernel's passes


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
    T, S, columns, window, NB_MAX, W_MAX, N_TICKETS, TARGET, MIN_CHUNK_K,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, TOKB: tl.constexpr,
    BN: tl.constexpr, CH: tl.constexpr, NBF: tl.constexpr, HDR: tl.constexpr,
):
    offs = tl.arange(0, CH)
    blk = plan + HDR
    marks = blk + NB_MAX * NBF
    tickets = marks + W_MAX
    recs = tickets + N_TICKETS
    # P0: clear the per-column segment table, the item marks and the merge tickets.
    for base in range(0, columns, CH):
        c = base + offs
        tl.store(col_seg + c * 2, tl.full([CH], -1, tl.int32), mask=c < columns)
        tl.store(col_seg + c * 2 + 1, tl.full([CH], -1, tl.int32), mask=c < columns)
    for base in range(0, W_MAX, CH):
        w = base + offs
        tl.store(marks + w, tl.zeros([CH], tl.int32), mask=w < W_MAX)
    for base in range(0, N_TICKETS, CH):
        w = base + offs
        tl.store(tickets + w, tl.zeros([CH], tl.int32), mask=w < N_TICKETS)
    tl.debug_barrier()
    # P1: block heads (first token, its position, the column); first segment of each column.
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
        tl.store(blk + rank * NBF + F_TOK0, i, mask=keep)
        tl.store(blk + rank * NBF + F_QPOS, pos.to(tl.int32), mask=keep)
        tl.store(blk + rank * NBF + F_COL, col.to(tl.int32), mask=keep)
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
    # P3: per block: tokens, visible key ranges of its segments, visible keys of the step.
    total = tl.full([], 0, tl.int64)
    for base in range(0, nb, CH):
        b = base + offs
        bv = b < nb
        bp = blk + b * NBF
        tok0 = tl.load(bp + F_TOK0, mask=bv, other=0, volatile=True)
        nxt = tl.load(bp + NBF + F_TOK0, mask=bv & (b + 1 < nb), other=0, volatile=True)
        ntok = tl.where(b + 1 < nb, nxt, T) - tok0
        col = tl.load(bp + F_COL, mask=bv, other=0, volatile=True).to(tl.int64)
        pmin = tl.load(bp + F_QPOS, mask=bv, other=0, volatile=True).to(tl.int64)
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
        tl.store(bp + F_NTOK, ntok.to(tl.int32), mask=bv)
        tl.store(bp + F_ROW0, (f0 + a0).to(tl.int32), mask=bv)
        tl.store(bp + F_N0, n0.to(tl.int32), mask=bv)
        tl.store(bp + F_POS0, (p0 + a0).to(tl.int32), mask=bv)
        tl.store(bp + F_ROW1, (f1 + a1).to(tl.int32), mask=bv)
        tl.store(bp + F_N1, n1.to(tl.int32), mask=bv)
        tl.store(bp + F_POS1, (p1 + a1).to(tl.int32), mask=bv)
        total += tl.sum(tl.where(bv, n0 + n1, 0).to(tl.int64), 0)
    tl.debug_barrier()
    # P4: items per block, in proportion to its share of the visible keys (target items in
    # all; at least one, none shorter than MIN_CHUNK_K keys), the block's keys cut evenly
    # into them; first item and first partial slot of each block.  A split block has
    # share >= 2 items, so split items (partial slots) never exceed TARGET.
    n_items = tl.full([], 0, tl.int32)
    n_pslots = tl.full([], 0, tl.int32)
    n_split = tl.full([], 0, tl.int32)
    for base in range(0, nb, CH):
        b = base + offs
        bv = b < nb
        bp = blk + b * NBF
        work = tl.load(bp + F_N0, mask=bv, other=0, volatile=True) + tl.load(bp + F_N1, mask=bv, other=0, volatile=True)
        share = (work.to(tl.int64) * TARGET // tl.maximum(total, 1)).to(tl.int32)
        ns = tl.maximum(tl.minimum(share, work // MIN_CHUNK_K), 1)
        chunk = tl.maximum((((work + ns - 1) // ns + BN - 1) // BN) * BN, BN)
        ns = tl.where(bv, tl.maximum((work + chunk - 1) // chunk, 1), 0)
        start = n_items + tl.cumsum(ns, 0) - ns
        is_split = bv & (ns > 1)
        nsp = tl.where(is_split, ns, 0)
        pstart = n_pslots + tl.cumsum(nsp, 0) - nsp
        tl.store(bp + F_NSPLIT, ns, mask=bv)
        tl.store(bp + F_ITEM0, start, mask=bv)
        tl.store(bp + F_PSLOT0, tl.where(is_split, pstart, -1), mask=bv)
        tl.store(bp + F_CHUNK, chunk, mask=bv)
        tl.store(marks + start, tl.full([CH], 1, tl.int32), mask=bv & (start < W_MAX))
        n_items += tl.sum(ns, 0)
        n_pslots += tl.sum(nsp, 0)
        n_split += tl.sum(is_split.to(tl.int32), 0)
    n_items = tl.minimum(n_items, W_MAX)
    tl.debug_barrier()
    # P5: block of each item = (number of block starts <= item) - 1; one self-contained
    # record per item (its block's fields and its key range), one level of loads.
    run = tl.full([], 0, tl.int32)
    for base in range(0, n_items, CH):
        w = base + offs
        wv = w < n_items
        mk = tl.load(marks + w, mask=wv, other=0, volatile=True)
        b = run + tl.cumsum(mk, 0) - 1
        run += tl.sum(mk, 0)
        bp = blk + b * NBF
        rp = recs + w * NBF
        for f in tl.static_range(0, F_KSTART):
            tl.store(rp + f, tl.load(bp + f, mask=wv, other=0, volatile=True), mask=wv)
        work = tl.load(bp + F_N0, mask=wv, other=0, volatile=True) + tl.load(bp + F_N1, mask=wv, other=0, volatile=True)
        chunk = tl.load(bp + F_CHUNK, mask=wv, other=0, volatile=True)
        kstart = (w - tl.load(bp + F_ITEM0, mask=wv, other=0, volatile=True)) * chunk
        tl.store(rp + F_KSTART, kstart, mask=wv)
        tl.store(rp + F_KEND, tl.minimum(kstart + chunk, work), mask=wv)
    tl.store(plan + H_BLOCKS, nb)
    tl.store(plan + H_ITEMS, n_items)
    tl.store(plan + H_SPLIT_BLOCKS, n_split)
    tl.store(plan + H_CHUNK, ((total + TARGET - 1) // TARGET).to(tl.int32))
    tl.store(plan + H_TOTAL, total.to(tl.int32))
    tl.store(plan + H_PSLOTS, n_pslots)


# ------------------------------------------------------------------ attention tile
@triton.jit
def _merge_rows(out, part_o, part_ml, stride_ot, stride_oh, h, hkv, tok0, ntok, ns, pslot0,
                G: tl.constexpr, G_PAD: tl.constexpr, DV: tl.constexpr, PM: tl.constexpr,
                R: tl.constexpr, SPL: tl.constexpr):
    """Log-sum-exp merge of the ns partials of one block for one KV head, in slot order: R
    rows (token * G_PAD + head, as in the attention tile) at once, SPL splits per load.
    Loads bypass L1 (``.cg``): the partials were written by other programs of this launch."""
    r = tl.arange(0, R)
    tok_in = r // G_PAD
    hg = r % G_PAD
    rvalid = (tok_in < ntok) & (hg < G)
    offs_dv = tl.arange(0, DV)
    sp = tl.arange(0, SPL)
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, DV], tl.float32)
    for s0 in range(0, ns, SPL):
        sidx = s0 + sp
        rows = ((pslot0 + sidx).to(tl.int64) * hkv + h)[:, None] * PM + r[None, :]
        ok = (sidx < ns)[:, None] & rvalid[None, :]  # [SPL, R]
        ms = tl.load(part_ml + rows * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
        ls = tl.load(part_ml + rows * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
        os_ = tl.load(part_o + rows[:, :, None] * DV + offs_dv[None, None, :], mask=ok[:, :, None], other=0.0,
                      cache_modifier=".cg")
        m_new = tl.maximum(m_i, tl.max(ms, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.math.exp2(m_i - m_use)
        c = tl.math.exp2(ms - m_use[None, :])  # masked splits: exp2(-inf) = 0
        acc = acc * a[:, None] + tl.sum(os_ * c[:, :, None], 0)
        l_i = l_i * a + tl.sum(ls * c, 0)
        m_i = m_new
    inv = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
    op = (out + (tok0 + tok_in).to(tl.int64)[:, None] * stride_ot + (h * G + hg)[:, None] * stride_oh
          + offs_dv[None, :])
    tl.store(op, (acc * inv[:, None]).to(out.dtype.element_ty), mask=rvalid[:, None])


@triton.jit
def _attend(
    q, k, v, out, part_o, part_ml, tickets,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    h, col, columns, tok0, ntok, qpos0, row0, n0, pos0, row1, pos1, kstart, kend, nsplit, pslot0, split,
    scale_log2, window,
    M: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BN: tl.constexpr, PM: tl.constexpr, MULTI: tl.constexpr, SPL: tl.constexpr, MERGE_R: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """One item for KV head h: keys [kstart, kend) of the block's key index (segment 0's n0
    keys, then segment 1's) against an M-row query tile.  MULTI: several query tokens, whose
    causal / window bounds differ per row (a one-token block's key range is exactly its
    visible one: only the last tile masks, the keys past kend)."""
    r = tl.arange(0, M)
    tok_in = r // G_PAD
    hg = r % G_PAD
    rvalid = (tok_in < ntok) & (hg < G)
    tok = tok0 + tok_in
    qhead = h * G + hg
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    qt = tl.load(q + tok.to(tl.int64)[:, None] * stride_qt + qhead[:, None] * stride_qh + offs_d[None, :],
                 mask=rvalid[:, None], other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    qpos = qpos0 + tok_in  # a block's tokens have consecutive positions
    qpos_last = qpos0 + ntok - 1
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
        slot = tl.where(in0, row0 + idx, row1 + (idx - n0)).to(tl.int64) * columns + col
        kt = tl.load(kbase + slot[:, None] * stride_kn + offs_d[None, :], mask=kv[:, None], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        if IEEE:
            s = tl.dot(qt, tl.trans(kt), input_precision="ieee")
        else:
            s = tl.dot(qt, tl.trans(kt))
        s = (s * scale_log2).to(tl.float32)  # AOTInductor passes float scalars as fp64
        if MULTI:
            # a tile inside one segment that every row sees entirely needs no mask
            tpos = tl.where(j < n0, pos0 + j, pos1 + (j - n0))  # position of the tile's first key
            masked = (j + BN > kend) | ((j < n0) & (j + BN > n0))
            if CAUSAL:
                masked = masked | (tpos + BN - 1 > qpos0)
            if HAS_WINDOW:
                masked = masked | (qpos_last - tpos >= window)
            if masked:
                kpos = tl.where(in0, pos0 + idx, pos1 + (idx - n0))
                vis = kv[None, :]
                if CAUSAL:
                    vis = vis & (kpos[None, :] <= qpos[:, None])
                if HAS_WINDOW:
                    vis = vis & ((qpos[:, None] - kpos[None, :]) < window)
                s = tl.where(vis, s, float("-inf"))
        else:
            if j + BN > kend:
                s = tl.where(kv[None, :], s, float("-inf"))
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
    if pslot0 < 0:  # the block's only item: normalise and write
        inv = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
        op = out + tok.to(tl.int64)[:, None] * stride_ot + qhead[:, None] * stride_oh + offs_dv[None, :]
        tl.store(op, (acc * inv[:, None]).to(out.dtype.element_ty), mask=rvalid[:, None])
    else:  # one of several: write partials; the last of the block's items to finish merges
        hkv = tl.num_programs(1)
        base = ((pslot0 + split).to(tl.int64) * hkv + h) * PM
        tl.store(part_o + (base + r)[:, None] * DV + offs_dv[None, :], acc, mask=rvalid[:, None])
        tl.store(part_ml + (base + r) * 2, m_i, mask=rvalid)
        tl.store(part_ml + (base + r) * 2 + 1, l_i, mask=rvalid)
        tl.debug_barrier()  # every thread's partials are written before the ticket (released with it)
        ticket = tickets + pslot0 * hkv + h
        if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == nsplit - 1:
            _merge_rows(out, part_o, part_ml, stride_ot, stride_oh, h, hkv, tok0, ntok, nsplit, pslot0,
                        G, G_PAD, DV, PM, MERGE_R, SPL)
            tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # ready for the next layer's launch


@triton.jit
def _sdpa_varlen_fwd(
    q, k, v, out, plan, part_o, part_ml,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    columns, scale_log2, window, TICKETS_OFF, REC_OFF,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, M_DEC: tl.constexpr, BN_DEC: tl.constexpr, BN_PRE: tl.constexpr,
    SPL_DEC: tl.constexpr, SPL_PRE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    NBF: tl.constexpr,
):
    p = tl.program_id(0)
    h = tl.program_id(1)
    # all loads independent of each other: the item record (p < W_MAX is in bounds)
    n_items = tl.load(plan + H_ITEMS)
    rp = plan + REC_OFF + p * NBF
    tok0 = tl.load(rp + F_TOK0)
    ntok = tl.load(rp + F_NTOK)
    row0 = tl.load(rp + F_ROW0)
    n0 = tl.load(rp + F_N0)
    pos0 = tl.load(rp + F_POS0)
    row1 = tl.load(rp + F_ROW1)
    pos1 = tl.load(rp + F_POS1)
    col = tl.load(rp + F_COL)
    qpos0 = tl.load(rp + F_QPOS)
    nsplit = tl.load(rp + F_NSPLIT)
    split = p - tl.load(rp + F_ITEM0)
    pslot0 = tl.load(rp + F_PSLOT0)
    kstart = tl.load(rp + F_KSTART)
    kend = tl.load(rp + F_KEND)
    tickets = plan + TICKETS_OFF
    if p < n_items:
        if ntok == 1:
            _attend(q, k, v, out, part_o, part_ml, tickets,
                    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
                    h, col, columns, tok0, ntok, qpos0, row0, n0, pos0, row1, pos1, kstart, kend, nsplit, pslot0,
                    split, scale_log2, window,
                    M_DEC, G, G_PAD, D, DV, BN_DEC, BLOCK_M, False, SPL_DEC, G_PAD, CAUSAL, HAS_WINDOW, IEEE, UPCAST)
        else:
            _attend(q, k, v, out, part_o, part_ml, tickets,
                    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
                    h, col, columns, tok0, ntok, qpos0, row0, n0, pos0, row1, pos1, kstart, kend, nsplit, pslot0,
                    split, scale_log2, window,
                    BLOCK_M, G, G_PAD, D, DV, BN_PRE, BLOCK_M, True, SPL_PRE, BLOCK_M, CAUSAL, HAS_WINDOW, IEEE,
                    UPCAST)


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
    stages: int
    min_chunk: int
    target_items: int  # items the splits aim at (per KV head); also the most partial slots
    n_tickets: int  # one merge ticket per (partial slot, KV head)
    nb_max: object  # most blocks
    w_max: object  # most items (the attention grid)
    tickets_off: object
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
    w_max = nb_max + target_items  # every block one item, plus at most target_items from splits
    tickets_off = _HDR + nb_max * _NBF + w_max
    rec_off = tickets_off + target_items * hkv
    return Geometry(
        g=g, g_pad=g_pad, block_m=block_m, tokb=tokb, m_dec=max(16, g_pad),
        bn_dec=block_n if block_n is not None else max(16, DEC_BLOCK_N // shrink),
        bn_pre=block_n if block_n is not None else max(16, PRE_BLOCK_N // shrink),
        stages=STAGES if elem_bytes <= 2 else 2,
        min_chunk=MIN_CHUNK if min_chunk is None else min_chunk, target_items=target_items,
        n_tickets=target_items * hkv, nb_max=nb_max, w_max=w_max, tickets_off=tickets_off, rec_off=rec_off,
        plan_len=rec_off + w_max * _NBF,
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
        q_pos.shape[0], seq_info.shape[0], columns, window, geo.nb_max, geo.w_max, geo.n_tickets,
        geo.target_items, geo.min_chunk,
        CAUSAL=causal, HAS_WINDOW=window > 0, TOKB=geo.tokb, BN=max(geo.bn_dec, geo.bn_pre), CH=_CH,
        NBF=_NBF, HDR=_HDR, num_warps=4,
    )
    return plan


def _splits_per_load(rows: int, dv: int) -> int:
    """Partials merged per load: a power of two, about _MERGE_TILE elements."""
    return min(64, 1 << (max(1, _MERGE_TILE // (rows * dv)).bit_length() - 1))


def attend_impl(q: Tensor, k_store: Tensor, v_store: Tensor, plan: Tensor, columns: int,
                scale: float, causal: bool, window: int, geo: Geometry, launch=None) -> Tensor:
    """Attention of one layer along a plan from ``plan_impl``: one launch.  The plan's merge
    tickets are zero before and after it (the launch that uses a ticket resets it)."""
    wrap = launch if launch is not None else (lambda fn: fn)
    n_tok, hq, d = q.shape
    hkv, dv = k_store.shape[1], v_store.shape[-1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_store = k_store if k_store.stride(-1) == 1 else k_store.contiguous()
    v_store = v_store if v_store.stride(-1) == 1 else v_store.contiguous()
    out = q.new_empty(n_tok, hq, dv)
    part_o = torch.empty(geo.target_items * hkv * geo.block_m * dv, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(geo.target_items * hkv * geo.block_m * 2, dtype=torch.float32, device=q.device)
    wrap(_sdpa_varlen_fwd)[(geo.w_max, hkv)](
        q, k_store, v_store, out, plan, part_o, part_ml,
        q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1),
        v_store.stride(0), v_store.stride(1), out.stride(0), out.stride(1),
        columns, scale * _LOG2E, window, geo.tickets_off, geo.rec_off,
        G=geo.g, G_PAD=geo.g_pad, D=d, DV=dv, BLOCK_M=geo.block_m, M_DEC=geo.m_dec,
        BN_DEC=geo.bn_dec, BN_PRE=geo.bn_pre,
        SPL_DEC=_splits_per_load(geo.g_pad, dv), SPL_PRE=_splits_per_load(geo.block_m, dv),
        CAUSAL=causal, HAS_WINDOW=window > 0, IEEE=q.dtype == torch.float32,
        UPCAST=_interpreted() and q.dtype == torch.bfloat16, NBF=_NBF,
        num_warps=WARPS, num_stages=geo.stages,
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
    out = attend_impl(q, k_store, v_store, plan, columns, scale, causal, window, geo, launch)
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


# q_pos stays in the signature (the call site is shared with ``kvcache::sdpa_varlen``); the
# kernel reads positions from the plan.  The plan's merge tickets are used and reset to zero
# within the call, so the plan reads the same after it: not a mutation of the op's inputs.
@triton_op("kvcache::sdpa_varlen_attend", mutates_args=())
def sdpa_varlen_attend(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, plan: Tensor,
    columns: int, scale: float, causal: bool, window: int,
) -> Tensor:
    geo = _geometry_of(q, k_store, v_store, columns)
    return attend_impl(q, k_store, v_store, plan, columns, scale, causal, window, geo, launch=wrap_triton)


@sdpa_varlen_attend.register_fake
def _(q, k_store, v_store, q_pos, plan, columns, scale, causal, window):
    return q.new_empty(q.shape[0], q.shape[1], v_store.shape[-1])
