"""Tuning of the ``sdpa_varlen`` kernels and the geometry of one call derived from it.

``Tuning`` is a frozen value passed to the launch functions (``plan_impl``, ``attend_impl``,
``sdpa_varlen_*_impl``); the registered ops pass ``Tuning()``.  ``bench/sdpa_varlen.py --sweep``
times variants of it (``dataclasses.replace``); why each default is what it is:
docs/benchmarks_gpu_sdpa.md, "Tuning history".
"""

from dataclasses import dataclass

import torch

from .layout import HDR, LIST_WORDS, NBF


@dataclass(frozen=True)
class Tuning:
    """Tiles are given for 2-byte elements and D <= 128; ``geometry`` shrinks them for more
    bytes per key."""

    dec_block_n: int = 64  # keys per tile of a one-token (decode) block
    dec_stages: int = 3  # software-pipelining depth of the decode key loop
    pre_block_m: int = 64  # rows (tokens x query heads) of a multi-token (prefill / draft) tile
    pre_block_n: int = 64  # keys per tile of a multi-token block
    pre_stages: int = 3  # pipelining depth of the multi-token key loops
    long_block_m: int = 128  # rows of the tile of a *long* block (more tokens than a pre_block_m tile holds), in a
    # launch of its own on long_warps warps; 0 (or <= pre_block_m): no long blocks, runs cut at pre_block_m rows
    long_block_n: int = 128  # keys per tile of a long block (with long_stages=3: 224 KiB of shared memory, Hopper's;
    # attention.py takes a stage off where the device has less)
    long_stages: int = 3  # pipelining depth of the long blocks' key loops
    long_warps: int = 8  # warps of the long blocks' launch
    long_min_tokens: int = 256  # long blocks only in steps whose token count may exceed this (a static bound from the
    # shapes): an empty long launch still costs a launch, which smaller steps (decodes, drafts) would pay
    longest_first: bool = True  # the long launch runs the plan's items last to first: a causal prefill's longest
    # blocks first, its short ones in the launch's tail
    pre_warps: int = 4  # warps of the launch of decode and multi-token blocks
    noncausal_warps: int = 8  # that launch's warps in a non-causal call: a draft model's blocks of queries, each a
    # 64-row tile; causal calls (decodes, which 8 warps slow) keep pre_warps
    target_ctas: int = 264  # ~2 programs per SM of a 132-SM GPU (H200): the splits aim at this many, never more
    min_chunk: int = 256  # shortest split of a decode block (keys; rounded up to the key tile)
    item_cap: float = 1.5  # > 0: no item longer than item_cap x the step's nominal chunk (visible keys / items aimed
    # at), besides the split in proportion to each block's share, which leaves a block of up to twice the nominal chunk
    # whole: a long sequence among short ones is cut (skewed steps), where the step's items then stay within one wave
    # (target items).  0: no cap
    min_chunk_multi: int = 2048  # shortest split of a multi-token block (its partials are block_m rows)
    merge_tile: int = 8192  # fp32 partial elements per load of the merge
    merge_group: int = 8  # > 1: a split block merges in two levels, groups of this many items first; 0: one level
    dec_merge_launch: bool = True  # a causal call's split one-token (decode) blocks merged by a launch of their own
    # after the attention launch (the plan's split list), not by their last item: that one-program merge ran ~8 µs at
    # B=1 where the merge launch costs ~4 (docs/benchmarks_gpu_sdpa.md); multi-token blocks keep the fused merge
    dec_merge_split: int = 4  # the merge launch's programs per (block, KV head), each on DV / this columns
    plan_warps: int = 8  # most warps of the plan kernel (one program)
    plan_width: int = 1024  # most lanes of the plan kernel's vectors (its passes go this many at a time)
    plan_lanes: int = 1  # lanes per thread the plan aims at: its warps are width // (32 * plan_lanes), 1 .. plan_warps

    def __post_init__(self) -> None:
        if self.merge_group < 0 or self.merge_group == 1:
            raise ValueError(f"Tuning.merge_group={self.merge_group}: 0 (one level) or >= 2 is allowed")
        if self.long_block_m and (self.long_block_m < 16 or self.long_block_m & (self.long_block_m - 1)):
            raise ValueError(f"Tuning.long_block_m={self.long_block_m}: 0 or a power of two >= 16 is allowed")
        for name, least in (("dec_block_n", 16), ("pre_block_m", 16), ("pre_block_n", 16), ("long_block_n", 16),
                            ("plan_width", 16), ("dec_merge_split", 1)):
            value = getattr(self, name)
            if value < least or value & (value - 1):
                raise ValueError(f"Tuning.{name}={value}: a power of two >= {least} is allowed")
        if self.item_cap != 0 and not 1 <= self.item_cap <= 1000:
            raise ValueError(f"Tuning.item_cap={self.item_cap}: 0 (off) or a number from 1 to 1000 is allowed")
        if self.long_min_tokens < 0:
            raise ValueError(f"Tuning.long_min_tokens={self.long_min_tokens}: a non-negative integer is allowed")
        for name in ("dec_stages", "pre_stages", "long_stages", "pre_warps", "noncausal_warps", "long_warps", "target_ctas",
                     "min_chunk", "min_chunk_multi", "merge_tile", "plan_warps", "plan_lanes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Tuning.{name}={getattr(self, name)}: a positive integer is allowed")


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def _sym_min(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return torch.sym_min(a, b)


@dataclass(frozen=True)
class Geometry:
    """Tiles, launch settings and buffer sizes of one call, from shapes and a ``Tuning`` only.
    Sizes are SymInts under tracing; the plan op and the attention op agree on them."""

    g: int  # query heads per KV head
    g_pad: int
    block_m: int  # rows of a multi-token tile
    tokb_short: int  # most tokens of a block on the multi-token path (block_m // g_pad)
    block_m_long: int  # rows of a long block's tile (== block_m: no long blocks in this step)
    tokb: int  # most tokens of a block: the plan cuts runs at this many (block_m_long // g_pad)
    long_launch: bool  # long blocks (and their launch) in this step
    longest_first: bool  # the long launch runs the items last to first
    m_dec: int  # rows of a decode tile
    bn_dec: int
    bn_pre: int
    bn_long: int
    dec_stages: int
    pre_stages: int
    long_stages: int
    pre_warps: int
    noncausal_warps: int
    long_warps: int
    merge_group: int
    dec_merge_launch: bool
    dec_merge_split: int  # programs per (block, KV head) of the merge launch: a power of two dividing DV
    spl_merge: int  # partial slots per load of the merge launch (its DV / dec_merge_split columns)
    min_chunk: int
    min_chunk_multi: int
    spl_dec: int  # partial slots merged per load: decode blocks, multi-token blocks, long blocks
    spl_pre: int
    spl_long: int
    plan_width: int  # lanes of the plan kernel's vectors (a power of two)
    plan_warps: int
    target_items: int  # items the splits aim at (per KV head); also the most partial slots (plan.py, P4)
    item_cap_permille: int  # Tuning.item_cap x 1000 (0: off)
    n_tickets: int  # one merge ticket per (partial slot, KV head)
    list_len: int  # most split one-token blocks (the split list): each has >= 2 of the target_items partial slots
    nb_max: object  # most blocks
    w_max: object  # most items (the attention grid)
    tickets_off: object  # offsets in the plan (layout.py)
    rec_off: object
    plan_len: object

    @property
    def list_off(self):
        """Offset of the split list in the plan (after the merge tickets)."""
        return self.tickets_off + self.n_tickets

    @property
    def part_rows(self) -> int:
        """Rows of one partial slot: the largest tile's."""
        return self.block_m_long


def _upper(x) -> int | None:
    """x, or for a SymInt its static upper bound (``torch.export.Dim(max=...)``; None: unbounded)."""
    if isinstance(x, int):
        return x
    try:
        node = x.node
        upper = node.shape_env.bound_sympy(node.expr).upper
        return int(upper) if upper.is_finite else None
    except Exception:  # no shape env to ask (a plain SymInt): no bound known
        return None


def _plan_width(n_tok, columns: int, target_items: int, tuning: Tuning) -> int:
    """Lanes of the plan's vectors: the step's largest extent (tokens, columns, items aimed
    at) rounded up to a power of two, 64 .. ``tuning.plan_width`` (the most when the tokens are
    unbounded); a pass over more than that goes in several."""
    tok = _upper(n_tok)
    cols = _upper(columns)
    if tok is None or cols is None:
        return tuning.plan_width
    return min(tuning.plan_width, max(64, next_pow2(max(tok, cols, target_items))))


def _splits_per_load(rows: int, dv: int, merge_tile: int) -> int:
    """Partials merged per load: a power of two, about ``merge_tile`` elements."""
    return min(64, 1 << (max(1, merge_tile // (rows * dv)).bit_length() - 1))


def geometry(n_tok, columns: int, hq: int, hkv: int, d: int, dv: int, elem_bytes: int, tuning: Tuning) -> Geometry:
    g = hq // hkv
    g_pad = next_pow2(g)
    shrink = max(1, max(d, dv) * elem_bytes // 256)  # tiles sized for 2-byte elements, D <= 128
    block_m = max(tuning.pre_block_m // shrink, 2 * g_pad)
    # long blocks only where the sweep measured them (2-byte elements, D <= 128) and in steps that may
    # hold more than long_min_tokens tokens; without them runs are cut at the short tile's tokens
    tok_bound = _upper(n_tok)
    long_launch = (shrink == 1 and tuning.long_block_m > block_m
                   and (tok_bound is None or tok_bound > max(tuning.long_min_tokens, block_m // g_pad)))
    block_m_long = tuning.long_block_m if long_launch else block_m
    tokb_short, tokb = block_m // g_pad, block_m_long // g_pad
    # upper bounds from shapes only (no host sync); blocks: see the plan kernel
    nb_max = _sym_min(n_tok, n_tok // tokb + 2 * _sym_min(n_tok, columns) + 1)
    # rounded down: the programs never pass target_ctas (rounded up, the few programs past it would run in a
    # second round of their own)
    target_items = max(1, tuning.target_ctas // hkv)
    w_max = nb_max + target_items  # every block one item, plus at most target_items from splits
    tickets_off = HDR + nb_max * NBF + w_max
    list_len = max(1, target_items // 2)
    merge_split = max(1, min(tuning.dec_merge_split, dv // 16))  # >= 16 columns per program
    rec_off = tickets_off + target_items * hkv + list_len * LIST_WORDS.value  # after the tickets and the split list
    wide = elem_bytes > 2
    plan_width = _plan_width(n_tok, columns, target_items, tuning)
    return Geometry(
        g=g, g_pad=g_pad, block_m=block_m, tokb_short=tokb_short, block_m_long=block_m_long, tokb=tokb,
        long_launch=long_launch, longest_first=tuning.longest_first, m_dec=max(16, g_pad),
        bn_dec=max(16, tuning.dec_block_n // shrink), bn_pre=max(16, tuning.pre_block_n // shrink),
        bn_long=max(16, tuning.long_block_n // shrink),
        dec_stages=min(tuning.dec_stages, 2) if wide else tuning.dec_stages,
        pre_stages=min(tuning.pre_stages, 2) if wide else tuning.pre_stages,
        long_stages=min(tuning.long_stages, 2) if wide else tuning.long_stages,
        pre_warps=tuning.pre_warps, noncausal_warps=tuning.noncausal_warps, long_warps=tuning.long_warps, merge_group=tuning.merge_group,
        dec_merge_launch=tuning.dec_merge_launch, dec_merge_split=merge_split,
        spl_merge=_splits_per_load(g_pad, dv // merge_split, tuning.merge_tile), min_chunk=tuning.min_chunk, min_chunk_multi=tuning.min_chunk_multi,
        spl_dec=_splits_per_load(g_pad, dv, tuning.merge_tile), spl_pre=_splits_per_load(block_m, dv, tuning.merge_tile),
        spl_long=_splits_per_load(block_m_long, dv, tuning.merge_tile),
        plan_width=plan_width, plan_warps=max(1, min(tuning.plan_warps, plan_width // (32 * tuning.plan_lanes))),
        target_items=target_items, item_cap_permille=round(tuning.item_cap * 1000),
        n_tickets=target_items * hkv, list_len=list_len, nb_max=nb_max, w_max=w_max,
        tickets_off=tickets_off, rec_off=rec_off, plan_len=rec_off + w_max * NBF,
    )
