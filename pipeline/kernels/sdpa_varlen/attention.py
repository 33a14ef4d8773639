"""The attention launch: ``_sdpa_varlen_fwd`` (grid = upper bound of items x Hkv, from shapes
only; programs past the plan's item count exit) processes one item for one KV head.

Its query tile holds the block's tokens x the G = Hq/Hkv query heads that share the KV head
(rows = token * G_PAD + head), so K/V are read once per KV head for all of them.  Blocks of
one token (decode) use a small [max(16, G_PAD), D] tile; multi-token blocks of up to
``tokb_short`` tokens (draft blocks, short chunks) a [block_m, D] tile; longer ones (prefill
chunks, cut at ``tokb`` tokens by the plan) a [block_m_long, D] tile in a launch of their own on
``Tuning.long_warps`` warps (a 128-row tile needs 8 warps, which would slow the decode path
compiled into the same launch).  That launch is made only when the step's token count may
exceed ``tokb_short`` (a static bound from the shapes).  The item's key tiles run in up to three loops: tiles that every
row sees entirely run without a mask; only those at the window's edge (the first ones), at
the causal diagonal or past the item's end (the last ones) evaluate it.  When the block's two
segments are not one run of positions, every tile is masked.

An unsplit block writes its output.  A split block writes fp32 partials (acc, max, sum) to a
scratch pool.  In a causal call a split one-token (decode) block leaves them to the merge launch
that ``attend_impl`` makes right after this one (``merge._merge_split_list``, over the plan's split
list; ``Tuning.dec_merge_launch``).  Otherwise the block's items take a ticket (an atomic counter
per block and KV head in the plan): the last of them to finish merges all the partials with a
log-sum-exp, in slot order (so the result does not depend on which finished last), and resets
the ticket for the next layer.

Scores, softmax and accumulation are fp32; P is cast to V's dtype for the second product (as
in FlashAttention).  A query that sees no key gets zeros.
"""

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .layout import (
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
    H_ITEMS,
    NBF,
)
from .merge import _merge_last, _merge_rows, _merge_split_list
from .tiles import _kv_tiles
from .tuning import Geometry

_LOG2E = 1.4426950408889634
_ONE_LEVEL = 1 << 30  # the merge group of Tuning.merge_group=0: every split block merges in one level


@triton.jit
def _attend(
    q, k, v, out, part_o, part_ml, tickets,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    h, col, columns, tok0, ntok, qpos0, row0, n0, pos0, row1, n1, pos1, kstart, kend, nsplit, pslot0, split,
    scale_log2, window,
    M: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BN: tl.constexpr, PM: tl.constexpr, STAGES: tl.constexpr, MULTI: tl.constexpr, SPL: tl.constexpr,
    MERGE_R: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, MERGE_GROUP: tl.constexpr, FUSED_MERGE: tl.constexpr,
):
    """One item for KV head h: keys [kstart, kend) of the block's key index against an M-row
    query tile.  MULTI: several query tokens, whose causal / window bounds differ per row; a
    one-token block's key range is exactly its visible one (the plan trimmed it), so only
    the keys past kend are masked."""
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
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DV], tl.float32)
    kbase = k + h * stride_kh
    vbase = v + h * stride_vh
    # tiles are kstart + t * BN; t < t_full are whole tiles inside the item
    n_tiles = (kend - kstart + BN - 1) // BN
    t_full = (kend - kstart) // BN
    if MULTI:
        # Where the keys' positions are one run (pos0 + key index: segment 1 continues segment 0
        # or is empty), the tiles every row sees whole are t_lo <= t < t_hi: past the window's
        # edge for the last query and before the causal diagonal for the first.
        one_run = (n1 == 0) | (pos1 == pos0 + n0)
        t_lo = n_tiles * 0
        t_hi = t_full
        if HAS_WINDOW:
            x = qpos0 + ntok - 1 - window - pos0 - kstart  # tiles starting at key index <= x are cut
            t_lo = tl.where(x >= 0, x // BN + 1, 0)
        if CAUSAL:
            y = qpos0 - pos0 - kstart + 1  # a whole tile ends at a key index <= qpos0 - pos0
            t_hi = tl.minimum(t_hi, tl.where(y >= 0, y // BN, 0))
        t_lo = tl.where(one_run, tl.minimum(t_lo, n_tiles), n_tiles)
        t_mid = tl.maximum(t_lo, t_hi)
        acc, m_i, l_i = _kv_tiles(acc, m_i, l_i, qt, kbase, vbase, kstart, kstart + t_lo * BN, kend, n0, row0, row1,
                                  pos0, pos1, col, columns, stride_kn, stride_vn, qpos, scale_log2, window,
                                  BN, D, DV, STAGES, True, CAUSAL, HAS_WINDOW, IEEE, UPCAST)
        t_end = kstart + t_mid * BN  # the unmasked tiles: every key visible
        acc, m_i, l_i = _kv_tiles(acc, m_i, l_i, qt, kbase, vbase, kstart + t_lo * BN, t_end, t_end, n0, row0, row1,
                                  pos0, pos1, col, columns, stride_kn, stride_vn, qpos, scale_log2, window,
                                  BN, D, DV, STAGES, False, False, False, IEEE, UPCAST)
        acc, m_i, l_i = _kv_tiles(acc, m_i, l_i, qt, kbase, vbase, kstart + t_mid * BN, kend, kend, n0, row0, row1,
                                  pos0, pos1, col, columns, stride_kn, stride_vn, qpos, scale_log2, window,
                                  BN, D, DV, STAGES, True, CAUSAL, HAS_WINDOW, IEEE, UPCAST)
    else:
        t_end = kstart + t_full * BN
        acc, m_i, l_i = _kv_tiles(acc, m_i, l_i, qt, kbase, vbase, kstart, t_end, t_end, n0, row0, row1,
                                  pos0, pos1, col, columns, stride_kn, stride_vn, qpos, scale_log2, window,
                                  BN, D, DV, STAGES, False, False, False, IEEE, UPCAST)
        acc, m_i, l_i = _kv_tiles(acc, m_i, l_i, qt, kbase, vbase, t_end, kend, kend, n0, row0, row1,
                                  pos0, pos1, col, columns, stride_kn, stride_vn, qpos, scale_log2, window,
                                  BN, D, DV, STAGES, True, False, False, IEEE, UPCAST)
    if pslot0 < 0:  # the block's only item: normalise and write
        inv = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
        op = out + tok.to(tl.int64)[:, None] * stride_ot + qhead[:, None] * stride_oh + offs_dv[None, :]
        tl.store(op, (acc * inv[:, None]).to(out.dtype.element_ty), mask=rvalid[:, None])
    else:  # one of several: write partials; the last of the block's items to finish merges (FUSED_MERGE),
        # or the merge launch after this one (``merge._merge_split_list``)
        hkv = tl.num_programs(1)
        base = ((pslot0 + split).to(tl.int64) * hkv + h) * PM
        tl.store(part_o + (base + r)[:, None] * DV + offs_dv[None, :], acc, mask=rvalid[:, None])
        tl.store(part_ml + (base + r) * 2, m_i, mask=rvalid)
        tl.store(part_ml + (base + r) * 2 + 1, l_i, mask=rvalid)
        if FUSED_MERGE:  # (a constexpr: without it, the partials wait for the merge launch)
            tl.debug_barrier()  # every thread's partials are written before the ticket (released with it)
            if nsplit <= MERGE_GROUP:  # one level (MERGE_GROUP is _ONE_LEVEL where Tuning.merge_group is 0)
                _merge_last(out, part_o, part_ml, tickets, stride_ot, stride_oh, h, hkv, tok0, ntok, nsplit, pslot0,
                            G, G_PAD, DV, PM, MERGE_R, SPL)
            else:
                # two levels: the last item of each group of MERGE_GROUP merges the group into the
                # group's first slot; the last group to finish merges the groups (slot stride MERGE_GROUP).
                # Tickets: a group's at its first slot, the block's at slot pslot0 + 1 (never a group's).
                first = (split // MERGE_GROUP) * MERGE_GROUP
                gticket = tickets + (pslot0 + first) * hkv + h
                if tl.atomic_add(gticket, 1, sem="acq_rel", scope="gpu") == tl.minimum(MERGE_GROUP, nsplit - first) - 1:
                    _merge_rows(out, part_o, part_ml, stride_ot, stride_oh, h, hkv, tok0, ntok,
                                tl.minimum(MERGE_GROUP, nsplit - first), pslot0 + first, 1, pslot0 + first, 0,
                                G, G_PAD, DV, PM, MERGE_R, SPL, 0, DV)
                    tl.atomic_xchg(gticket, 0, sem="relaxed", scope="gpu")
                    tl.debug_barrier()  # the group's partial is written before the block's ticket
                    bticket = tickets + (pslot0 + 1) * hkv + h
                    n_groups = (nsplit + MERGE_GROUP - 1) // MERGE_GROUP
                    if tl.atomic_add(bticket, 1, sem="acq_rel", scope="gpu") == n_groups - 1:
                        _merge_rows(out, part_o, part_ml, stride_ot, stride_oh, h, hkv, tok0, ntok, n_groups, pslot0,
                                    MERGE_GROUP, -1, 0, G, G_PAD, DV, PM, MERGE_R, SPL, 0, DV)
                        tl.atomic_xchg(bticket, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sdpa_varlen_fwd(
    q, k, v, out, plan, part_o, part_ml,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    columns, scale_log2, window, TICKETS_OFF, REC_OFF,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_M_LONG: tl.constexpr, TOKB_SHORT: tl.constexpr, PART_ROWS: tl.constexpr,
    M_DEC: tl.constexpr, BN_DEC: tl.constexpr, BN_PRE: tl.constexpr, BN_LONG: tl.constexpr,
    DEC_STAGES: tl.constexpr, PRE_STAGES: tl.constexpr, LONG_STAGES: tl.constexpr,
    SPL_DEC: tl.constexpr, SPL_PRE: tl.constexpr, SPL_LONG: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    NBF_: tl.constexpr, PATHS: tl.constexpr, MERGE_GROUP: tl.constexpr, REVERSE: tl.constexpr,
    DEC_MERGE_LAUNCH: tl.constexpr,
):
    """The items of the paths in PATHS (a bit mask): 1 decode blocks (one token), 2
    multi-token blocks of at most TOKB_SHORT tokens (BLOCK_M-row tiles), 4 long blocks (more
    tokens, BLOCK_M_LONG-row tiles); the launches of one call cover the three between them.
    REVERSE: program p runs item n_items - 1 - p (the plan's last items first)."""
    scale_log2 = tl.cast(scale_log2, tl.float32)  # AOTInductor passes float scalars as fp64
    p = tl.program_id(0)
    h = tl.program_id(1)
    n_items = tl.load(plan + H_ITEMS)
    if REVERSE:
        # a causal prefill's blocks are in token order, so its longest come last in the plan; run
        # first, they leave the short ones to fill the launch's tail.  The record's loads wait for
        # n_items' (one more round trip), so only the long launch does this.
        p = tl.where(p < n_items, n_items - 1 - p, p)
    # the item record's loads, independent of each other (p < W_MAX is in bounds)
    rp = plan + REC_OFF + p * NBF_
    tok0 = tl.load(rp + F_TOK0)
    ntok = tl.load(rp + F_NTOK)
    row0 = tl.load(rp + F_ROW0)
    n0 = tl.load(rp + F_N0)
    pos0 = tl.load(rp + F_POS0)
    row1 = tl.load(rp + F_ROW1)
    n1 = tl.load(rp + F_N1)
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
            if PATHS & 1:
                _attend(q, k, v, out, part_o, part_ml, tickets,
                        stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
                        h, col, columns, tok0, ntok, qpos0, row0, n0, pos0, row1, n1, pos1, kstart, kend, nsplit,
                        pslot0, split, scale_log2, window,
                        M_DEC, G, G_PAD, D, DV, BN_DEC, PART_ROWS, DEC_STAGES, False, SPL_DEC, G_PAD,
                        CAUSAL, HAS_WINDOW, IEEE, UPCAST, MERGE_GROUP, not DEC_MERGE_LAUNCH)
        elif ntok <= TOKB_SHORT:
            if PATHS & 2:
                _attend(q, k, v, out, part_o, part_ml, tickets,
                        stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
                        h, col, columns, tok0, ntok, qpos0, row0, n0, pos0, row1, n1, pos1, kstart, kend, nsplit,
                        pslot0, split, scale_log2, window,
                        BLOCK_M, G, G_PAD, D, DV, BN_PRE, PART_ROWS, PRE_STAGES, True, SPL_PRE, BLOCK_M,
                        CAUSAL, HAS_WINDOW, IEEE, UPCAST, MERGE_GROUP, True)
        else:
            if PATHS & 4:
                _attend(q, k, v, out, part_o, part_ml, tickets,
                        stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
                        h, col, columns, tok0, ntok, qpos0, row0, n0, pos0, row1, n1, pos1, kstart, kend, nsplit,
                        pslot0, split, scale_log2, window,
                        BLOCK_M_LONG, G, G_PAD, D, DV, BN_LONG, PART_ROWS, LONG_STAGES, True, SPL_LONG, BLOCK_M_LONG,
                        CAUSAL, HAS_WINDOW, IEEE, UPCAST, MERGE_GROUP, True)


def interpreted() -> bool:
    return type(_sdpa_varlen_fwd).__name__ == "InterpretedFunction"


@functools.lru_cache(maxsize=None)
def _shared_memory_per_program(index: int | None) -> int | None:
    """The device's shared memory per program (opt-in), once per device; None where torch does not say."""
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)


def _long_stages(q: Tensor, geo: Geometry, d: int, dv: int) -> int:
    """The long launch's pipelining depth that fits the device's shared memory: its Q tile and
    ``stages`` K and V tiles (Tuning's 128 x 128 tiles at depth 3 take 224 KiB, which a Hopper
    GPU's 227 KiB per program holds and an A100's 163 KiB does not: there one stage fewer)."""
    limit = _shared_memory_per_program(q.device.index) if q.is_cuda else None
    if not limit:  # the interpreter, or no figure to go by
        return geo.long_stages
    for stages in range(geo.long_stages, 1, -1):
        if (geo.block_m_long * d + stages * geo.bn_long * (d + dv)) * q.element_size() <= limit:
            return stages
    return 1


def attend_impl(q: Tensor, k_store: Tensor, v_store: Tensor, plan: Tensor, columns: int,
                scale: float, causal: bool, window: int, geo: Geometry, launch=None) -> Tensor:
    """Attention of one layer along a plan from ``plan_impl``: one launch, a second for the long
    blocks where the step may hold them.  The plan's merge tickets are zero before and after it
    (the launch that uses a ticket resets it)."""
    wrap = launch if launch is not None else (lambda fn: fn)
    if not scale > 0:
        raise ValueError(f"sdpa_varlen: scale={scale}: a positive number is allowed (the kernel keeps its running "
                         "maxima in scaled units)")
    n_tok, hq, d = q.shape
    hkv, dv = k_store.shape[1], v_store.shape[-1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_store = k_store if k_store.stride(-1) == 1 else k_store.contiguous()
    v_store = v_store if v_store.stride(-1) == 1 else v_store.contiguous()
    out = q.new_empty(n_tok, hq, dv)
    long_stages = _long_stages(q, geo, d, dv) if geo.long_launch else geo.long_stages
    part_o = torch.empty(geo.target_items * hkv * geo.part_rows * dv, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(geo.target_items * hkv * geo.part_rows * 2, dtype=torch.float32, device=q.device)
    args = (q, k_store, v_store, out, plan, part_o, part_ml,
            q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1),
            v_store.stride(0), v_store.stride(1), out.stride(0), out.stride(1),
            columns, scale * _LOG2E, window, geo.tickets_off, geo.rec_off)
    consts = dict(G=geo.g, G_PAD=geo.g_pad, D=d, DV=dv, BLOCK_M=geo.block_m, BLOCK_M_LONG=geo.block_m_long,
                  TOKB_SHORT=geo.tokb_short, PART_ROWS=geo.part_rows, M_DEC=geo.m_dec,
                  BN_DEC=geo.bn_dec, BN_PRE=geo.bn_pre, BN_LONG=geo.bn_long, DEC_STAGES=geo.dec_stages,
                  PRE_STAGES=geo.pre_stages, LONG_STAGES=long_stages,
                  SPL_DEC=geo.spl_dec, SPL_PRE=geo.spl_pre, SPL_LONG=geo.spl_long, CAUSAL=causal, HAS_WINDOW=window > 0,
                  IEEE=q.dtype == torch.float32, UPCAST=interpreted() and q.dtype == torch.bfloat16, NBF_=NBF,
                  MERGE_GROUP=geo.merge_group or _ONE_LEVEL)
    grid = (geo.w_max, hkv)
    # (paths, warps, stages) of each launch; every launch reads the whole plan and skips the other paths' items
    launches = [(3, geo.pre_warps if causal else geo.noncausal_warps, max(geo.dec_stages, geo.pre_stages))]
    if geo.long_launch:
        launches.append((4, geo.long_warps, long_stages))
    merge_launch = causal and geo.dec_merge_launch  # a non-causal call's one-token blocks keep the fused merge
    for paths, warps, stages in launches:
        wrap(_sdpa_varlen_fwd)[grid](*args, **consts, PATHS=paths, REVERSE=paths == 4 and geo.longest_first,
                                     DEC_MERGE_LAUNCH=merge_launch, num_warps=warps, num_stages=stages)
        if paths == 3 and merge_launch:
            wrap(_merge_split_list)[(geo.list_len, hkv, geo.dec_merge_split)](
                out, plan, part_o, part_ml, out.stride(0), out.stride(1), geo.list_off, G=geo.g, G_PAD=geo.g_pad,
                DV=dv, PM=geo.part_rows, SPL=geo.spl_merge, DVW=dv // geo.dec_merge_split, num_warps=4, num_stages=1)
    return out
