"""The plan's int32 layout, named once: [header | blocks | item marks | merge tickets | split list | item records].

``H_*`` are header words; a block and an item record share one layout of ``NBF`` fields (``F_*``),
a record being its block's fields plus the item's own key range.  ``tuning.geometry`` gives the
offsets of the parts, ``plan.py`` writes them and ``attention.py`` reads them."""

import triton.language as tl

HDR = 16  # header words: H_BLOCKS, H_ITEMS, H_SPLIT_BLOCKS, H_CHUNK, H_TOTAL, H_PSLOTS, H_DEC_SPLITS (the rest unused)
H_BLOCKS = tl.constexpr(0)
H_ITEMS = tl.constexpr(1)
H_SPLIT_BLOCKS = tl.constexpr(2)
H_CHUNK = tl.constexpr(3)  # visible keys / target items: the nominal split (blocks round it to themselves)
H_TOTAL = tl.constexpr(4)  # visible keys of the step (per KV head)
H_PSLOTS = tl.constexpr(5)  # partial slots in use
H_DEC_SPLITS = tl.constexpr(6)  # split one-token blocks: the entries of the split list

NBF = 16
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

LIST_WORDS = tl.constexpr(4)  # a split list entry (a split one-token block, for the decode merge launch): its first token,
L_TOK0 = tl.constexpr(0)  # items and first partial slot (one word unused)
L_NSPLIT = tl.constexpr(1)
L_PSLOT0 = tl.constexpr(2)
