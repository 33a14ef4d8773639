"""The merges of split blocks' fp32 partials (acc, max, sum), by log-sum-exp in slot order:
``_merge_rows`` (R rows of one block for one KV head), ``_merge_last`` (the fused merge: the last of
a block's items to take its ticket merges them all) and ``_merge_split_blocks`` (the merge launch of
``Tuning.merge_launch``).  ``attention.py`` calls them; the partials' layout is its."""

import triton
import triton.language as tl

from .plan import F_NSPLIT, F_NTOK, F_PSLOT0, F_TOK0, H_MULTI_SPLITS


@triton.jit
def _merge_rows(out, part_o, part_ml, stride_ot, stride_oh, h, hkv, tok0, ntok, ns, pslot0, pstride, to_slot, r0,
                G: tl.constexpr, G_PAD: tl.constexpr, DV: tl.constexpr, PM: tl.constexpr,
                R: tl.constexpr, SPL: tl.constexpr):
    """Log-sum-exp merge of the ns partials in slots pslot0, pslot0 + pstride, ... of one
    block for one KV head, in slot order: R rows from row r0 (row = token * G_PAD + head, as
    in the attention tile) at once, SPL splits per load.  to_slot < 0: the normalised output is written;
    otherwise the merged partial (acc, max, sum) goes to slot to_slot, for a second level.
    Loads bypass L1 (``.cg``): the partials were written by other programs of this launch."""
    r = r0 + tl.arange(0, R)
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
        rows = ((pslot0 + sidx * pstride).to(tl.int64) * hkv + h)[:, None] * PM + r[None, :]
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
    if to_slot >= 0:
        base = (to_slot.to(tl.int64) * hkv + h) * PM
        tl.store(part_o + (base + r)[:, None] * DV + offs_dv[None, :], acc, mask=rvalid[:, None])
        tl.store(part_ml + (base + r) * 2, m_i, mask=rvalid)
        tl.store(part_ml + (base + r) * 2 + 1, l_i, mask=rvalid)
    else:
        inv = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
        op = (out + (tok0 + tok_in).to(tl.int64)[:, None] * stride_ot + (h * G + hg)[:, None] * stride_oh
              + offs_dv[None, :])
        tl.store(op, (acc * inv[:, None]).to(out.dtype.element_ty), mask=rvalid[:, None])


@triton.jit
def _merge_last(out, part_o, part_ml, tickets, stride_ot, stride_oh, h, hkv, tok0, ntok, nsplit, pslot0,
                G: tl.constexpr, G_PAD: tl.constexpr, DV: tl.constexpr, PM: tl.constexpr,
                R: tl.constexpr, SPL: tl.constexpr):
    """One level: the last of the block's nsplit items to take the ticket merges them all."""
    ticket = tickets + pslot0 * hkv + h
    if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == nsplit - 1:
        _merge_rows(out, part_o, part_ml, stride_ot, stride_oh, h, hkv, tok0, ntok, nsplit, pslot0, 1, -1, 0,
                    G, G_PAD, DV, PM, R, SPL)
        tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # ready for the next layer's launch


@triton.jit
def _merge_split_blocks(out, plan, part_o, part_ml, stride_ot, stride_oh, MLIST_OFF,
                        G: tl.constexpr, G_PAD: tl.constexpr, DV: tl.constexpr, PM: tl.constexpr,
                        R: tl.constexpr, SPL: tl.constexpr, NBF_: tl.constexpr, HDR_: tl.constexpr):
    """The merge launch (``Tuning.merge_launch``): program (i, h, c) merges rows
    [c * R, c * R + R) of the i-th split multi-token block of the plan's split list for KV
    head h, after the attention launch wrote all its partials (grid bounded from shapes;
    programs past the list or the block's rows exit)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    if i < tl.load(plan + H_MULTI_SPLITS):
        bp = plan + HDR_ + tl.load(plan + MLIST_OFF + i) * NBF_
        ntok = tl.load(bp + F_NTOK)
        if c * R < ntok * G_PAD:
            _merge_rows(out, part_o, part_ml, stride_ot, stride_oh, h, tl.num_programs(1), tl.load(bp + F_TOK0), ntok,
                        tl.load(bp + F_NSPLIT), tl.load(bp + F_PSLOT0), 1, -1, c * R, G, G_PAD, DV, PM, R, SPL)
