"""Triton implementation of ``kvcache::sdpa_varlen`` (contract in ``pipeline/kernels/reference.py``).

A plan per step, then per layer one attention launch (two where the step may hold long blocks) and the
decode merge launch; no host synchronisation:

- ``layout.py``: the plan's int32 layout (header words, block and item record fields), named once;
- ``plan.py``: ``_plan_kernel`` (one program) turns the step's buffers (``q_pos``, ``q_cols``,
  ``seq_info``) into a work list of *items* (a block of query tokens of one sequence x a run
  of its visible keys);
- ``attention.py``: ``_sdpa_varlen_fwd`` runs the items for every KV head in one launch (a second for long blocks),
  the splits of a multi-token block merged by the last of them to finish, those of a one-token
  (decode) block of a causal call by the merge launch after it (``Tuning.dec_merge_launch``);
- ``tiles.py``: the key-tile loop (online softmax over a range of an item's key tiles);
- ``merge.py``: the log-sum-exp merges of split blocks' partials (fused, and the merge launch
  ``_merge_split_list``);
- ``tuning.py``: the tiles and split targets (``Tuning``, a frozen value) and the geometry of one
  call derived from shapes;
- ``ops.py``: the ``kvcache::`` ops that ``lower_kv`` emits for ``backend=cuda`` (with ``Tuning()``)
  and their ``*_impl`` functions, which take a ``Tuning``.

Imports point one way, no cycles: ``tuning`` imports ``layout``; ``plan`` those two;
``merge`` ``layout``; ``attention`` them, ``tiles`` and ``merge``; ``ops`` ``tuning``, ``plan`` and ``attention``.
Importing this package registers the ops.
"""

from .attention import attend_impl, interpreted
from .layout import (
    F_CHUNK,
    F_ITEM0,
    F_KEND,
    F_KSTART,
    F_N0,
    F_NSPLIT,
    F_NTOK,
    F_POS0,
    F_POS1,
    F_PSLOT0,
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
    LIST_WORDS,
    NBF,
)
from .ops import (
    geometry_of,
    sdpa_varlen_attend,
    sdpa_varlen_attend_impl,
    sdpa_varlen_plan,
    sdpa_varlen_plan_impl,
    sdpa_varlen_triton,
    sdpa_varlen_triton_impl,
)
from .plan import plan_impl
from .tuning import Geometry, Tuning, geometry

__all__ = [
    "F_CHUNK", "F_ITEM0", "F_KEND", "F_KSTART", "F_N0", "F_NSPLIT", "F_NTOK", "F_POS0", "F_POS1", "F_PSLOT0",
    "F_ROW0", "F_ROW1", "F_TOK0", "Geometry", "HDR", "H_BLOCKS", "H_CHUNK", "H_DEC_SPLITS", "H_ITEMS", "LIST_WORDS",
    "H_PSLOTS", "H_SPLIT_BLOCKS", "H_TOTAL", "NBF", "Tuning", "attend_impl", "geometry", "geometry_of", "interpreted",
    "plan_impl", "sdpa_varlen_attend", "sdpa_varlen_attend_impl", "sdpa_varlen_plan", "sdpa_varlen_plan_impl",
    "sdpa_varlen_triton", "sdpa_varlen_triton_impl",
]
