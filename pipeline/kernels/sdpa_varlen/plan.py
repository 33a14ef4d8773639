"""The plan of one step: ``_plan_kernel`` (one program) cuts the step's query tokens into
*blocks* and the blocks' visible keys into *items*, the attention grid's work list.

A block is at most ``TOKB`` consecutive query tokens of one column with consecutive
positions: a *run* (tokens of one column with consecutive positions) is cut into blocks of
``TOKB`` tokens from its first, so a draft block of up to ``TOKB`` tokens is one block (one
read of its keys) wherever its positions start.  The kernel finds each block's (at most
two) segments through a per-column table built from ``seq_info``, trims them to the keys
the causal and window bounds leave visible, and cuts each block's visible keys into ``n``
equal items, ``n`` in proportion to the block's share of the step's visible keys
(``target_items`` in all, about ``Tuning.target_ctas`` programs with the KV heads), none
shorter than ``min_chunk`` keys (``min_chunk_multi`` for multi-token blocks) and, where the
step's items then stay within ``target_items``, none longer than ``Tuning.item_cap`` nominal
chunks (a long sequence among short ones is cut).  It writes one self-contained record per
item, zeroes the merge tickets and lists the split one-token blocks (the split list, for the
decode merge launch: ``Tuning.dec_merge_launch``).  The number of blocks is bounded from shapes by
``min(T, T // TOKB + 2 * min(T, columns) + 1)``; this holds when each sequence's tokens are
contiguous in q (the contract).

The plan is int32 words: [header | blocks | item marks | merge tickets | split list | item records], its
fields named once in ``layout.py``; ``tuning.geometry`` gives the offsets of the parts.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .layout import (
    F_CHUNK,
    F_COL,
    F_ITEM0,
    F_KEND,
    F_KSTART,
    F_N0,
    F_N1,
    F_NSPLIT,
    F_NTOK,
    F_POS0,
    F_POS1,
    F_PSLOT0,
    F_QPOS,
    F_ROW0,
    F_ROW1,
    F_TOK0,
    H_BLOCKS,
    H_CHUNK,
    H_DEC_SPLITS,
    H_ITEMS,
    H_PSLOTS,
    H_SPLIT_BLOCKS,
    H_TOTAL,
    HDR,
    L_NSPLIT,
    L_PSLOT0,
    L_TOK0,
    LIST_WORDS,
    NBF,
)
from .tuning import Geometry

_SEG_NONE = tl.constexpr(2**63 - 1)  # an empty slot 0 of the per-column segment table


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


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
    first_row = tl.load(seq_info + s * 4 + 1, mask=has, other=0).to(tl.int32)
    count = tl.load(seq_info + s * 4 + 2, mask=has, other=0).to(tl.int32)
    first_pos = tl.load(seq_info + s * 4 + 3, mask=has, other=0).to(tl.int32)
    skip = tl.minimum(tl.maximum(lo - first_pos, 0), count)
    end = tl.minimum(tl.maximum(hi_ - first_pos + 1, 0), count)
    return first_row, skip, tl.where(has, tl.maximum(end - skip, 0), 0), first_pos


@triton.jit
def _block_work(bp, bv):
    """Visible keys of the blocks at bp (both segments) and whether each holds several tokens."""
    work = tl.load(bp + F_N0, mask=bv, other=0, volatile=True) + tl.load(bp + F_N1, mask=bv, other=0, volatile=True)
    return work, tl.load(bp + F_NTOK, mask=bv, other=1, volatile=True) > 1


@triton.jit
def _block_items(work, multi, total, TARGET, MIN_CHUNK_K, MIN_CHUNK_MULTI, cap_on, BN: tl.constexpr,
                 CAP_PERMILLE: tl.constexpr):
    """Items of each block and its keys per item (whole key tiles): its share of TARGET items,
    rounded down, and where cap_on at least ceil(work / (CAP * total / TARGET)); at least one,
    none shorter than the least chunk."""
    share = (work.to(tl.int64) * TARGET // tl.maximum(total, 1)).to(tl.int32)
    if CAP_PERMILLE > 0:
        den = tl.maximum(total, 1) * CAP_PERMILLE
        capped = ((work.to(tl.int64) * TARGET * 1000 + den - 1) // den).to(tl.int32)
        share = tl.where(cap_on, tl.maximum(share, capped), share)
    ns = tl.maximum(tl.minimum(share, work // tl.where(multi, MIN_CHUNK_MULTI, MIN_CHUNK_K)), 1)
    chunk = tl.maximum((((work + ns - 1) // ns + BN - 1) // BN) * BN, BN)
    return tl.maximum((work + chunk - 1) // chunk, 1), chunk


@triton.jit
def _plan_kernel(
    q_pos, q_cols, seq_info, plan, col_seg,
    T, S, columns, window, NB_MAX, W_MAX, N_TICKETS, LIST_LEN, TARGET, MIN_CHUNK_K, MIN_CHUNK_MULTI,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, TOKB: tl.constexpr,
    BN: tl.constexpr, CH: tl.constexpr, NBF: tl.constexpr, HDR: tl.constexpr, CAP_PERMILLE: tl.constexpr,
):
    offs = tl.arange(0, CH)
    blk = plan + HDR
    marks = blk + NB_MAX * NBF
    tickets = marks + W_MAX
    split_list = tickets + N_TICKETS
    recs = split_list + LIST_LEN * LIST_WORDS
    # P0: clear the per-column segment table (slot 0: none yet, the most; slot 1: none, -1), the item
    # marks and the merge tickets.
    for base in range(0, columns, CH):
        c = base + offs
        tl.store(col_seg + c * 2, tl.full([CH], _SEG_NONE, tl.int64), mask=c < columns)
        tl.store(col_seg + c * 2 + 1, tl.full([CH], -1, tl.int64), mask=c < columns)
    for base in range(0, W_MAX, CH):
        w = base + offs
        tl.store(marks + w, tl.zeros([CH], tl.int32), mask=w < W_MAX)
    for base in range(0, N_TICKETS, CH):
        w = base + offs
        tl.store(tickets + w, tl.zeros([CH], tl.int32), mask=w < N_TICKETS)
    tl.debug_barrier()
    # P1, one pass over the tokens and the segments (their loads in flight together): block heads
    # (first token, its position, the column); each column's two segments, ordered by first
    # position (keys (position << 32 | segment): the least in slot 0, the greatest in slot 1, by
    # atomic min / max; a column of one segment has it in both).
    nb = tl.full([], 0, tl.int32)
    run0 = tl.full([], -1, tl.int32)  # the latest run start seen (carried across chunks)
    for base in range(0, tl.maximum(T, S), CH):
        i = base + offs
        valid = i < T
        has_prev = valid & (i > 0)
        col = tl.load(q_cols + i, mask=valid, other=-1)
        pcol = tl.load(q_cols + i - 1, mask=has_prev, other=-1)
        pos = tl.load(q_pos + i, mask=valid, other=0)
        ppos = tl.load(q_pos + i - 1, mask=has_prev, other=0)
        if base < S:  # a long prefill's later chunks hold no segment: no masked atomics for them
            s = base + offs
            scol, ok = _live_segment(seq_info, s, S, columns)
            key = tl.load(seq_info + s * 4 + 3, mask=ok, other=0) * (1 << 32) + s
            tl.atomic_min(col_seg + scol * 2, key, mask=ok, sem="relaxed")
            tl.atomic_max(col_seg + scol * 2 + 1, key, mask=ok, sem="relaxed")
        run_head = valid & ((i == 0) | (col != pcol) | (pos != ppos + 1))
        start = tl.maximum(tl.associative_scan(tl.where(run_head, i, -1), 0, _max), run0)  # of i's run
        head = run_head | (valid & ((i - start) % TOKB == 0))
        hi = head.to(tl.int32)
        rank = nb + tl.cumsum(hi, 0) - 1
        keep = head & (rank < NB_MAX)
        tl.store(blk + rank * NBF + F_TOK0, i, mask=keep)
        tl.store(blk + rank * NBF + F_QPOS, pos.to(tl.int32), mask=keep)
        tl.store(blk + rank * NBF + F_COL, col.to(tl.int32), mask=keep)
        nb += tl.sum(hi, 0)
        run0 = tl.max(start, 0)
    nb = tl.minimum(nb, NB_MAX)
    tl.debug_barrier()
    # P3: per block: tokens, visible key ranges of its segments, visible keys of the step.
    total = tl.full([], 0, tl.int64)
    for base in range(0, nb, CH):  # int32 lanes: positions and rows are int32 (seq_info's are below 2**30)
        b = base + offs
        bv = b < nb
        bp = blk + b * NBF
        tok0 = tl.load(bp + F_TOK0, mask=bv, other=0, volatile=True)
        nxt = tl.load(bp + NBF + F_TOK0, mask=bv & (b + 1 < nb), other=0, volatile=True)
        ntok = tl.where(b + 1 < nb, nxt, T) - tok0
        col = tl.load(bp + F_COL, mask=bv, other=0, volatile=True)
        pmin = tl.load(bp + F_QPOS, mask=bv, other=0, volatile=True)
        pmax = pmin + ntok - 1
        colok = bv & (col >= 0) & (col < columns)
        key0 = tl.load(col_seg + col * 2, mask=colok, other=_SEG_NONE, volatile=True)
        key1 = tl.load(col_seg + col * 2 + 1, mask=colok, other=-1, volatile=True)
        s0 = tl.where(key0 == _SEG_NONE, -1, key0 & 0xFFFFFFFF).to(tl.int32)
        s1 = tl.where((key1 < 0) | (key1 == key0), -1, key1 & 0xFFFFFFFF).to(tl.int32)
        big = 1 << 30
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
    # all; at least one, none shorter than MIN_CHUNK_K keys, MIN_CHUNK_MULTI for
    # multi-token blocks) and, with CAP_PERMILLE, at least enough that none is longer than
    # CAP nominal chunks if all the step's items then fit in one wave (TARGET: past it, cutting
    # blocks just over the cap would add a round of programs); the block's keys cut evenly
    # into them; first item and first partial slot of each block.  A split block has share
    # >= 2 items, so split items (partial slots) never exceed TARGET (with the cap, all items
    # are within TARGET); items stay below TARGET + blocks.
    cap_on = False
    if CAP_PERMILLE > 0:  # the cap only where the capped items stay within one wave (TARGET per KV head)
        capped = tl.full([], 0, tl.int32)
        for base in range(0, nb, CH):
            b = base + offs
            bv = b < nb
            work, multi = _block_work(blk + b * NBF, bv)
            ns, _ = _block_items(work, multi, total, TARGET, MIN_CHUNK_K, MIN_CHUNK_MULTI, True, BN, CAP_PERMILLE)
            capped += tl.sum(tl.where(bv, ns, 0), 0)
        cap_on = capped <= TARGET
    n_items = tl.full([], 0, tl.int32)
    n_pslots = tl.full([], 0, tl.int32)
    n_split = tl.full([], 0, tl.int32)
    n_dec_split = tl.full([], 0, tl.int32)
    for base in range(0, nb, CH):
        b = base + offs
        bv = b < nb
        bp = blk + b * NBF
        work, multi = _block_work(bp, bv)
        ns, chunk = _block_items(work, multi, total, TARGET, MIN_CHUNK_K, MIN_CHUNK_MULTI, cap_on, BN, CAP_PERMILLE)
        ns = tl.where(bv, ns, 0)
        start = n_items + tl.cumsum(ns, 0) - ns
        is_split = bv & (ns > 1)
        nsp = tl.where(is_split, ns, 0)
        pstart = n_pslots + tl.cumsum(nsp, 0) - nsp
        tl.store(bp + F_NSPLIT, ns, mask=bv)
        tl.store(bp + F_ITEM0, start, mask=bv)
        tl.store(bp + F_PSLOT0, tl.where(is_split, pstart, -1), mask=bv)
        tl.store(bp + F_CHUNK, chunk, mask=bv)
        tl.store(marks + start, tl.full([CH], 1, tl.int32), mask=bv & (start < W_MAX))
        # a split one-token block: (first token, items, first partial slot) to the split list
        dec_split = is_split & ~multi
        rank = n_dec_split + tl.cumsum(dec_split.to(tl.int32), 0) - 1
        entry = split_list + rank * LIST_WORDS
        listed = dec_split & (rank < LIST_LEN)
        tl.store(entry + L_TOK0, tl.load(bp + F_TOK0, mask=listed, other=0, volatile=True), mask=listed)
        tl.store(entry + L_NSPLIT, ns, mask=listed)
        tl.store(entry + L_PSLOT0, pstart, mask=listed)
        n_dec_split += tl.sum(dec_split.to(tl.int32), 0)
        n_items += tl.sum(ns, 0)
        n_pslots += tl.sum(nsp, 0)
        n_split += tl.sum(is_split.to(tl.int32), 0)
    n_items = tl.minimum(n_items, W_MAX)
    tl.debug_barrier()
    # P5: block of each item = (number of block starts <= item) - 1; one self-contained
    # record per item (its block's fields and its key range), one level of loads.
    fld = tl.arange(0, NBF)
    run = tl.full([], 0, tl.int32)
    for base in range(0, n_items, CH):
        w = base + offs
        wv = w < n_items
        mk = tl.load(marks + w, mask=wv, other=0, volatile=True)
        b = run + tl.cumsum(mk, 0) - 1
        run += tl.sum(mk, 0)
        bp = blk + b * NBF
        # the block's fields in one [CH, NBF] load (the item's own two left 0), then its key range
        rec = tl.load(bp[:, None] + fld[None, :], mask=wv[:, None] & (fld[None, :] < F_KSTART), other=0,
                      volatile=True)
        work = tl.load(bp + F_N0, mask=wv, other=0, volatile=True) + tl.load(bp + F_N1, mask=wv, other=0, volatile=True)
        chunk = tl.load(bp + F_CHUNK, mask=wv, other=0, volatile=True)
        kstart = (w - tl.load(bp + F_ITEM0, mask=wv, other=0, volatile=True)) * chunk
        kend = tl.minimum(kstart + chunk, work)
        rec = tl.where(fld[None, :] == F_KSTART, kstart[:, None], tl.where(fld[None, :] == F_KEND, kend[:, None], rec))
        tl.store(recs + w[:, None] * NBF + fld[None, :], rec, mask=wv[:, None])
    tl.store(plan + H_BLOCKS, nb)
    tl.store(plan + H_ITEMS, n_items)
    tl.store(plan + H_SPLIT_BLOCKS, n_split)
    tl.store(plan + H_CHUNK, ((total + TARGET - 1) // TARGET).to(tl.int32))
    tl.store(plan + H_TOTAL, total.to(tl.int32))
    tl.store(plan + H_PSLOTS, n_pslots)
    tl.store(plan + H_DEC_SPLITS, tl.minimum(n_dec_split, LIST_LEN))


def plan_impl(q_pos: Tensor, q_cols: Tensor, seq_info: Tensor, columns: int, causal: bool, window: int,
              geo: Geometry, launch=None) -> Tensor:
    """The work list of one step for every layer that shares these step buffers and bounds."""
    wrap = launch if launch is not None else (lambda fn: fn)
    tile = max(geo.bn_dec, geo.bn_pre, geo.bn_long if geo.long_launch else 0)  # items: whole tiles
    plan = torch.empty(geo.plan_len, dtype=torch.int32, device=q_pos.device)
    col_seg = torch.empty(2 * columns, dtype=torch.int64, device=q_pos.device)
    wrap(_plan_kernel)[(1,)](
        q_pos.contiguous(), q_cols.contiguous(), seq_info.contiguous(), plan, col_seg,
        q_pos.shape[0], seq_info.shape[0], columns, window, geo.nb_max, geo.w_max, geo.n_tickets,
        geo.list_len, geo.target_items, geo.min_chunk, geo.min_chunk_multi,
        CAUSAL=causal, HAS_WINDOW=window > 0, TOKB=geo.tokb, BN=tile, CH=geo.plan_width,
        NBF=NBF, HDR=HDR, CAP_PERMILLE=geo.item_cap_permille, num_warps=geo.plan_warps,
    )
    return plan
