"""The registered ops (``torch.library.triton_op``: they survive ``torch.export`` and
AOTInductor, ExecuTorch's CUDA backend), each running its ``*_impl`` with ``Tuning()``:

- ``kvcache::sdpa_varlen_triton``: the signature of ``kvcache::sdpa_varlen``, one call.
- ``kvcache::sdpa_varlen_plan`` + ``kvcache::sdpa_varlen_attend``: the same split in two,
  which ``lower_kv`` emits for ``backend=cuda``: the plan depends only on the step buffers and
  the bounds, so a lowered model computes it once per step and layer kind, and each layer
  only attends.

The ``*_impl`` functions take the ``Tuning`` as an argument (None: ``Tuning()``; tests and the
benchmark pass others) and ``launch``, which wraps each kernel (``wrap_triton`` inside the op,
identity when called directly).
"""

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from .attention import attend_impl
from .plan import plan_impl
from .tuning import Geometry, Tuning, geometry


def geometry_of(q: Tensor, k_store: Tensor, v_store: Tensor, columns: int, tuning: Tuning | None = None) -> Geometry:
    """The geometry of a call on these tensors."""
    return geometry(q.shape[0], columns, q.shape[1], k_store.shape[1], q.shape[2], v_store.shape[-1],
                    q.element_size(), Tuning() if tuning is None else tuning)


def sdpa_varlen_triton_impl(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, q_cols: Tensor,
    seq_info: Tensor, columns: int, scale: float, causal: bool, window: int,
    *, tuning: Tuning | None = None, launch=None, return_plan: bool = False,
):
    """Plan and attend in one call."""
    geo = geometry_of(q, k_store, v_store, columns, tuning)
    plan = plan_impl(q_pos, q_cols, seq_info, columns, causal, window, geo, launch)
    out = attend_impl(q, k_store, v_store, plan, columns, scale, causal, window, geo, launch)
    return (out, plan) if return_plan else out


def sdpa_varlen_plan_impl(
    q_pos: Tensor, q_cols: Tensor, seq_info: Tensor, columns: int, causal: bool, window: int,
    n_q_heads: int, n_kv_heads: int, head_dim: int, v_head_dim: int, elem_bytes: int,
    *, tuning: Tuning | None = None, launch=None,
) -> Tensor:
    """``kvcache::sdpa_varlen_plan`` under ``tuning``."""
    geo = geometry(q_pos.shape[0], columns, n_q_heads, n_kv_heads, head_dim, v_head_dim, elem_bytes,
                   Tuning() if tuning is None else tuning)
    return plan_impl(q_pos, q_cols, seq_info, columns, causal, window, geo, launch)


def sdpa_varlen_attend_impl(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, plan: Tensor,
    columns: int, scale: float, causal: bool, window: int, *, tuning: Tuning | None = None, launch=None,
) -> Tensor:
    """``kvcache::sdpa_varlen_attend`` under ``tuning``: the plan's (its offsets and tiles follow from it)."""
    geo = geometry_of(q, k_store, v_store, columns, tuning)
    return attend_impl(q, k_store, v_store, plan, columns, scale, causal, window, geo, launch)


@triton_op("kvcache::sdpa_varlen_triton", mutates_args=())
def sdpa_varlen_triton(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, q_cols: Tensor,
    seq_info: Tensor, columns: int, scale: float, causal: bool, window: int,
) -> Tensor:
    return sdpa_varlen_triton_impl(
        q, k_store, v_store, q_pos, q_cols, seq_info, columns, scale, causal, window, tuning=Tuning(), launch=wrap_triton,
    )


@sdpa_varlen_triton.register_fake
def _(q, k_store, v_store, q_pos, q_cols, seq_info, columns, scale, causal, window):
    return q.new_empty(q.shape[0], q.shape[1], v_store.shape[-1])


@triton_op("kvcache::sdpa_varlen_plan", mutates_args=())
def sdpa_varlen_plan(
    q_pos: Tensor, q_cols: Tensor, seq_info: Tensor, columns: int, causal: bool, window: int,
    n_q_heads: int, n_kv_heads: int, head_dim: int, v_head_dim: int, elem_bytes: int,
) -> Tensor:
    return sdpa_varlen_plan_impl(q_pos, q_cols, seq_info, columns, causal, window, n_q_heads, n_kv_heads, head_dim,
                                 v_head_dim, elem_bytes, tuning=Tuning(), launch=wrap_triton)


@sdpa_varlen_plan.register_fake
def _(q_pos, q_cols, seq_info, columns, causal, window, n_q_heads, n_kv_heads, head_dim, v_head_dim, elem_bytes):
    geo = geometry(q_pos.shape[0], columns, n_q_heads, n_kv_heads, head_dim, v_head_dim, elem_bytes, Tuning())
    return q_pos.new_empty(geo.plan_len, dtype=torch.int32)


# q_pos stays in the signature (the call site is shared with ``kvcache::sdpa_varlen``); the
# kernel reads positions from the plan.  The plan's merge tickets are used and reset to zero
# within the call, so the plan reads the same after it: not a mutation of the op's inputs.
@triton_op("kvcache::sdpa_varlen_attend", mutates_args=())
def sdpa_varlen_attend(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, plan: Tensor,
    columns: int, scale: float, causal: bool, window: int,
) -> Tensor:
    return sdpa_varlen_attend_impl(q, k_store, v_store, q_pos, plan, columns, scale, causal, window,
                                   tuning=Tuning(), launch=wrap_triton)


@sdpa_varlen_attend.register_fake
def _(q, k_store, v_store, q_pos, plan, columns, scale, causal, window):
    return q.new_empty(q.shape[0], q.shape[1], v_store.shape[-1])
