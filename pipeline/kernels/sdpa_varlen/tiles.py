"""The key-tile loop of one item: ``_kv_tiles`` runs the online softmax over a range of key
tiles of the block's key index (segment 0's keys, then segment 1's), masked or not.
``attention.py`` calls it."""

import triton
import triton.language as tl


@triton.jit
def _load_tile(base, slot, stride, offs, kv, MASK: tl.constexpr):
    """One K or V tile [BN, len(offs)]: rows slot, masked by kv where MASK."""
    if MASK:
        t = tl.load(base + slot[:, None] * stride + offs[None, :], mask=kv[:, None], other=0.0)
    else:
        t = tl.load(base + slot[:, None] * stride + offs[None, :])
    return t


@triton.jit
def _kv_tiles(acc, m_i, l_i, qt, kbase, vbase, j0, j1, kend, n0, row0, row1, pos0, pos1, col, columns,
              stride_kn, stride_vn, qpos, scale_log2, window,
              BN: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, STAGES: tl.constexpr, MASK: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax over the key tiles starting at j0, j0 + BN, ... < j1 of the block's key
    index (segment 0's n0 keys, then segment 1's).  MASK: keys at or past kend and, per row,
    those outside the causal / window bounds are masked; otherwise every key is visible.
    m_i is in scaled units (scores x scale_log2, scale_log2 > 0), so a tile's exponent is one
    fused multiply-add per score."""
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    for j in tl.range(j0, j1, BN, num_stages=STAGES):
        idx = j + offs_n
        in0 = idx < n0
        slot = tl.where(in0, row0 + idx, row1 + (idx - n0)).to(tl.int64) * columns + col
        kv = idx < kend
        kt = _load_tile(kbase, slot, stride_kn, offs_d, kv, MASK)
        if UPCAST:
            kt = kt.to(tl.float32)
        if IEEE:
            s = tl.dot(qt, tl.trans(kt), input_precision="ieee")
        else:
            s = tl.dot(qt, tl.trans(kt))
        if MASK:
            kpos = tl.where(in0, pos0 + idx, pos1 + (idx - n0))
            vis = kv[None, :]
            if CAUSAL:
                vis = vis & (kpos[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                vis = vis & ((qpos[:, None] - kpos[None, :]) < window)
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        if MASK:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        else:  # every key visible: the max is finite
            m_use = m_new
        p = tl.math.exp2(s * scale_log2 - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = _load_tile(vbase, slot, stride_vn, offs_dv, kv, MASK)
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
    return acc, m_i, l_i

