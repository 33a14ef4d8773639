"""The merges of split blocks' fp32 partials (acc, max, sum), by log-sum-exp in slot order:
``_merge_rows`` (R rows of one block for one KV head), ``_merge_last`` (the last of a block's
items to take its ticket merges them all; ``attention.py`` calls both from the attention launch)
and ``_merge_split_list``, the decode merge launch (``Tuning.dec_merge_launch``).  The partials'
layout is the attention launch's."""

import triton
import triton.language as tl

from .layout import H_DEC_SPLITS, L_NSPLIT, L_PSLOT0, L_TOK0, LIST_WORDS


@triton.jit
def _merge_rows(out, part_o, part_ml, stride_ot, stride_oh, h, hkv, tok0, ntok, ns, pslot0, pstride, to_slot, r0,
                G: tl.constexpr, G_PAD: tl.constexpr, DV: tl.constexpr, PM: tl.constexpr,
                R: tl.constexpr, SPL: tl.constexpr, c0, DVW: tl.constexpr):
    """Log-sum-exp merge of the ns partials in slots pslot0, pslot0 + pstride, ... of one
    block for one KV head, in slot order: R rows from row r0 (row = token * G_PAD + head, as
    in the attention tile) at once, SPL splits per load, columns [c0, c0 + DVW) of DV.  to_slot < 0: the normalised output is written;
    otherwise the merged partial (acc, max, sum) goes to slot to_slot, for a second level.
    Loads bypass L1 (``.cg``): the partials were written by other programs of this launch."""
    r = r0 + tl.arange(0, R)
    tok_in = r // G_PAD
    hg = r % G_PAD
    rvalid = (tok_in < ntok) & (hg < G)
    offs_dv = c0 + tl.arange(0, DVW)
    sp = tl.arange(0, SPL)
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, DVW], tl.float32)
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
                    G, G_PAD, DV, PM, R, SPL, 0, DV)
        tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # ready for the next layer's launch


@triton.jit
def _merge_split_list(out, plan, part_o, part_ml, stride_ot, stride_oh, LIST_OFF,
                      G: tl.constexpr, G_PAD: tl.constexpr, DV: tl.constexpr, PM: tl.constexpr, SPL: tl.constexpr,
                      DVW: tl.constexpr):
    """The decode merge launch, after the attention launch: program (i, h, c) merges columns
    [c * DVW, c * DVW + DVW) of the i-th split one-token block of the plan's split list for KV
    head h (programs past the list's length exit).  The entry's loads and the count's go
    together: one round trip before the partials'."""
    p = tl.program_id(0)
    h = tl.program_id(1)
    entry = plan + LIST_OFF + p * LIST_WORDS
    tok0 = tl.load(entry + L_TOK0)
    nsplit = tl.load(entry + L_NSPLIT)
    pslot0 = tl.load(entry + L_PSLOT0)
    if p < tl.load(plan + H_DEC_SPLITS):
        _merge_rows(out, part_o, part_ml, stride_ot, stride_oh, h, tl.num_programs(1), tok0, 1, nsplit, pslot0, 1,
                    -1, 0, G, G_PAD, DV, PM, G_PAD, SPL, tl.program_id(2) * DVW, DVW)
