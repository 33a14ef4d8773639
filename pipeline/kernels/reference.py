"""Length-aware attention over an explicit KV store, as plain ATen.

Contract of ``kvcache::sdpa_varlen`` (the Triton kernel in ``sdpa_varlen.py``
implements the same one):

    q         [T, Hq, D]             query tokens of every sequence in the step
    k_store   [rows * columns, Hkv, D]   slot of (row, column) = row * columns + column
    v_store   [rows * columns, Hkv, Dv]
    q_pos     [T] int64              absolute position of each query token
    q_cols    [T] int64              column (sequence) of each query token
    seq_info  [max_segments, 4] int64   (column, first_row, row_count, first_position);
                                     row_count == 0 marks an unused segment
    -> out    [T, Hq, Dv] (dtype of q)

Key at row r of a segment has position first_position + (r - first_row).
Query i attends every key of the segments whose column is q_cols[i] with
    key_pos <= q_pos[i]            (when causal)
    q_pos[i] - key_pos < window    (when window > 0)
Query head h reads KV head h // (Hq // Hkv). A query that sees no key gets zeros.
Scores and the softmax are computed in fp32.

``sdpa_cells`` is the same attention for the cell layout: keys are cells of a
shared pool, visible to query i when ``cell_owners & q_seq_bits[i] != 0`` and
the causal and window bounds hold on ``cell_pos``.
"""

import torch
from torch import Tensor


def _attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> Tensor:
    # q: [T, Hq, D]  k: [T, N, Hkv, D]  v: [T, N, Hkv, Dv]  visible: [T, N] bool
    n_tok, n_heads, _ = q.shape
    group = n_heads // k.shape[2]
    qf = _f32(q).reshape(n_tok, k.shape[2], group, q.shape[-1])  # [T, Hkv, G, D]
    kf = _f32(k).permute(0, 2, 3, 1)  # [T, Hkv, D, N]
    vf = _f32(v).permute(0, 2, 1, 3)  # [T, Hkv, N, Dv]
    scores = torch.matmul(qf, kf) * scale  # [T, Hkv, G, N]
    # hidden keys get a finite -1e30 (fp32 scores): exp underflows to exactly 0 next to any visible
    # key, and a query that sees none gets a finite uniform average, zeroed below, never NaN
    weights = torch.softmax(scores.masked_fill(~visible[:, None, None, :], -1e30), dim=-1)
    out = torch.matmul(weights, vf)  # [T, Hkv, G, Dv]
    sees_any = visible.any(dim=-1).to(out.dtype)[:, None, None, None]
    return (out * sees_any).reshape(n_tok, n_heads, v.shape[-1]).to(q.dtype)


def _f32(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _window_causal(visible: Tensor, key_pos: Tensor, q_pos: Tensor, causal: bool, window: int) -> Tensor:
    if causal:
        visible = visible & (key_pos <= q_pos[:, None])
    if window > 0:
        visible = visible & (q_pos[:, None] - key_pos < window)
    return visible


def sdpa_varlen_reference(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, q_cols: Tensor,
    seq_info: Tensor, columns: int, scale: float, causal: bool, window: int,
) -> Tensor:
    rows = k_store.shape[0] // columns
    row = torch.arange(rows, device=q.device, dtype=torch.int64)  # [rows]
    seg_col, first_row, row_count, first_pos = seq_info.unbind(1)  # each [S]
    in_seg = (row[None, :] >= first_row[:, None]) & (row[None, :] < (first_row + row_count)[:, None])  # [S, rows]
    seg_key_pos = first_pos[:, None] + (row[None, :] - first_row[:, None])  # [S, rows]
    hit = (q_cols[:, None] == seg_col[None, :])[:, :, None] & in_seg[None]  # [T, S, rows]
    visible = hit.any(dim=1)  # [T, rows]
    key_pos = (hit.to(torch.int64) * seg_key_pos[None]).sum(dim=1)  # [T, rows]
    visible = _window_causal(visible, key_pos, q_pos, causal, window)
    # each query's column of the store: [rows, columns, H, D] -> [T, rows, H, D]. index_select copies
    # whole rows of H * D; an advanced-index gather over [T, rows] slots is several times slower on
    # ExecuTorch's portable kernels.
    k = k_store.view(rows, columns, *k_store.shape[1:]).index_select(1, q_cols).transpose(0, 1)
    v = v_store.view(rows, columns, *v_store.shape[1:]).index_select(1, q_cols).transpose(0, 1)
    return _attend(q, k, v, visible, scale)


def sdpa_cells_reference(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, q_seq_bits: Tensor,
    cell_pos: Tensor, cell_owners: Tensor, scale: float, causal: bool, window: int,
) -> Tensor:
    n_tok = q.shape[0]
    visible = torch.bitwise_and(cell_owners[None, :], q_seq_bits[:, None]) != 0  # [T, cells]
    key_pos = cell_pos[None, :].expand(n_tok, -1)
    visible = _window_causal(visible, key_pos, q_pos, causal, window)
    k = k_store[None].expand(n_tok, -1, -1, -1)
    v = v_store[None].expand(n_tok, -1, -1, -1)
    return _attend(q, k, v, visible, scale)


@torch.library.custom_op("kvcache::sdpa_varlen", mutates_args=())
def sdpa_varlen(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, q_cols: Tensor,
    seq_info: Tensor, columns: int, scale: float, causal: bool, window: int,
) -> Tensor:
    return sdpa_varlen_reference(q, k_store, v_store, q_pos, q_cols, seq_info, columns, scale, causal, window)


@sdpa_varlen.register_fake
def _(q, k_store, v_store, q_pos, q_cols, seq_info, columns, scale, causal, window):
    return q.new_empty(q.shape[0], q.shape[1], v_store.shape[-1])


@torch.library.custom_op("kvcache::sdpa_cells", mutates_args=())
def sdpa_cells(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, q_seq_bits: Tensor,
    cell_pos: Tensor, cell_owners: Tensor, scale: float, causal: bool, window: int,
) -> Tensor:
    return sdpa_cells_reference(q, k_store, v_store, q_pos, q_seq_bits, cell_pos, cell_owners, scale, causal, window)


@sdpa_cells.register_fake
def _(q, k_store, v_store, q_pos, q_seq_bits, cell_pos, cell_owners, scale, causal, window):
    return q.new_empty(q.shape[0], q.shape[1], v_store.shape[-1])


# ExecuTorch CPU backends have no kernel for the custom ops: compile replaces
# them with their ATen bodies through this table.
ATEN_DECOMPOSITIONS = {
    torch.ops.kvcache.sdpa_varlen.default: sdpa_varlen_reference,
    torch.ops.kvcache.sdpa_cells.default: sdpa_cells_reference,
}
