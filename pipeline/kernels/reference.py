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

``sdpa_gather`` is the CPU backends' attention for every layout: the host lists the store slots a
query reads (its own sequence's rows or cells, in position order, with their positions), so a step
reads what its sequences hold and nothing else:

    one       [T1, 3, N1]      tokens that attend alone, each over its own keys: one[:, 0] its store
                               slots, one[:, 1] their positions (-1 past the token's keys), one[:, 2]
                               the token (every entry alike)
    block_q   [Tb]             the tokens of one block (a prefill chunk: tokens of one sequence) that
    block     [2, Nb]          share one key list, gathered once: block[0] slots, block[1] positions
    out_rows  [T]              token i's output is row out_rows[i] of cat(one outputs, block outputs)

A group with nothing to do holds one entry whose keys are all -1 (its output is never read).
Visibility is ``kpos >= 0`` plus the causal and window bounds on positions.
"""

import torch
from torch import Tensor


def _hidden_bias(visible: Tensor) -> Tensor:
    # [T, N] additive mask: hidden keys get a finite -1e30, so exp underflows to exactly 0 next to
    # any visible key and a query that sees none gets a finite uniform average (zeroed by the
    # caller), never the NaN of an all -inf row. Built once per step and layer kind; a broadcast
    # add per layer is cheaper than a masked fill over every head.
    return torch.where(visible, 0.0, -1e30)


def _attend_per_query(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> Tensor:
    # each query its own keys. q: [T, Hq, D]  k: [T, N, Hkv, D]  v: [T, N, Hkv, Dv]  visible: [T, N]
    # 3-d bmm throughout: a 4-d matmul lowers to bmm plus a copy of each operand
    n_tok, n_heads, d = q.shape
    _, n_keys, n_kv, dv = v.shape
    group = n_heads // n_kv
    qf = _f32(q).reshape(n_tok * n_kv, group, d)
    kf = _f32(k).permute(0, 2, 3, 1).reshape(n_tok * n_kv, d, n_keys)
    vf = _f32(v).permute(0, 2, 1, 3).reshape(n_tok * n_kv, n_keys, dv)
    scores = torch.bmm(qf, kf).reshape(n_tok, n_kv, group, n_keys) * scale
    weights = torch.softmax(scores + _hidden_bias(visible)[:, None, None, :], dim=-1)
    out = torch.bmm(weights.reshape(n_tok * n_kv, group, n_keys), vf).reshape(n_tok, n_heads, dv)
    return (out * visible.any(dim=-1).to(torch.float32)[:, None, None]).to(q.dtype)


def _attend_shared(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> Tensor:
    # all queries against one key set, in one matmul per KV head (no per-query copy of the keys).
    # q: [T, Hq, D]  k: [N, Hkv, D]  v: [N, Hkv, Dv]  visible: [T, N]
    n_tok, n_heads, d = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    qf = _f32(q).reshape(n_tok, n_kv, group, d).permute(1, 0, 2, 3).reshape(n_kv, n_tok * group, d)
    scores = torch.bmm(qf, _f32(k).permute(1, 2, 0)) * scale  # [Hkv, T*G, N]
    scores = scores.reshape(n_kv, n_tok, group, -1)
    weights = torch.softmax(scores + _hidden_bias(visible)[None, :, None, :], dim=-1).reshape(n_kv, n_tok * group, -1)
    out = torch.bmm(weights, _f32(v).permute(1, 0, 2))  # [Hkv, T*G, Dv]
    out = out.reshape(n_kv, n_tok, group, -1).permute(1, 0, 2, 3)  # [T, Hkv, G, Dv]
    out = out * visible.any(dim=-1).to(torch.float32)[:, None, None, None]
    return out.reshape(n_tok, n_heads, v.shape[-1]).to(q.dtype)


def _f32(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _window_causal_pos(visible: Tensor, key_pos: Tensor, q_pos: Tensor, causal: bool, window: int) -> Tensor:
    # key_pos and q_pos already broadcast against each other
    if causal:
        visible = visible & (key_pos <= q_pos)
    if window > 0:
        visible = visible & (q_pos - key_pos < window)
    return visible


def _window_causal(visible: Tensor, key_pos: Tensor, q_pos: Tensor, causal: bool, window: int) -> Tensor:
    if causal:
        visible = visible & (key_pos <= q_pos[:, None])
    if window > 0:
        visible = visible & (q_pos[:, None] - key_pos < window)
    return visible


def _column_visibility(q_pos: Tensor, q_cols: Tensor, seq_info: Tensor, columns: int, rows, causal: bool,
                       window: int) -> Tensor:
    """[T, rows]: which of the first ``rows`` rows of its column each query sees."""
    row = torch.arange(rows, device=q_pos.device, dtype=torch.int64)  # [rows]
    seg_col, first_row, row_count, first_pos = seq_info.unbind(1)  # each [S]
    in_seg = ((row[None, :] >= first_row[:, None]) & (row[None, :] < (first_row + row_count)[:, None])).float()  # [S, rows]
    seg_key_pos = (first_pos[:, None] + (row[None, :] - first_row[:, None])).float()  # [S, rows]
    # per column, which rows hold keys and at which positions: [columns, S] @ [S, rows]. Done once
    # per step and layer kind (compile merges the copies of other layers); per query it is then a
    # row lookup, O(T * rows) rather than O(T * segments * rows). fp32 holds positions exactly
    # below 2**24.
    owns = (torch.arange(columns, device=q_pos.device)[:, None] == seg_col[None, :]).float()  # [columns, S]
    col_visible = torch.matmul(owns, in_seg) > 0  # [columns, rows]
    col_key_pos = torch.matmul(owns, in_seg * seg_key_pos)  # [columns, rows]
    visible = col_visible.index_select(0, q_cols)  # [T, rows]
    key_pos = col_key_pos.index_select(0, q_cols)
    return _window_causal(visible, key_pos, q_pos.float(), causal, window)


def _gathered(store: Tensor, slots: Tensor, n_batch: int, n_keys: int, order: list[int], shape: list[int]) -> Tensor:
    # the listed slots of a store, [B, N, Hkv, D] as float32, permuted to ``order`` and reshaped for the bmm.
    # An 8-bit store's integers become floats through a per-tensor dequantization of scale 1 (exact), which
    # XNNPACK runs with the permuting copy in its delegate: 0.89 ms for 8 x 1,000 keys against 1.83 ms for
    # a float32 store's copy, where an int8 cast (portable's) then the float permute took 3.2 ms and an int8
    # permute (portable's, element by element) 11.8 ms (docs/design.md "The 8-bit KV cache")
    rows = store.index_select(0, slots)
    if store.dtype == torch.int8:
        # the op (torch's), and its out variant and kernel (ExecuTorch's quantized kernels: portable runs it)
        import executorch.kernels.quantized  # noqa: F401
        from torch.ao.quantization.fx._decomposed import quantized_decomposed_lib  # noqa: F401

        rows = torch.ops.quantized_decomposed.dequantize_per_tensor.default(rows, 1.0, 0, -127, 127, torch.int8)
    return _f32(rows).view(n_batch, n_keys, *store.shape[1:]).permute(*order).reshape(shape)


def _gathered_scales(scales: Tensor, slots: Tensor, n_batch: int, n_keys: int) -> Tensor:
    # an 8-bit store's scales of the listed slots, [B, N, Hkv] -> [B * Hkv, 1, N]: one per key and KV head
    n_kv = scales.shape[1]
    return scales.index_select(0, slots).view(n_batch, n_keys, n_kv).permute(0, 2, 1).reshape(n_batch * n_kv, 1, n_keys)


def _attend_group(q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, q_idx: Tensor, key_slots: Tensor,
                  key_pos: Tensor, scale: float, causal: bool, window: int, k_scale: Tensor | None = None,
                  v_scale: Tensor | None = None) -> Tensor:
    # B batches of Tq queries, each batch over its own N keys, in one bmm per (batch, KV head).
    # q_idx: [B, Tq] token of each query  key_slots, key_pos: [B, N]  ->  [B * Tq, Hq, Dv]
    # 8-bit stores (k_scale, v_scale [slots, Hkv]): the key scales multiply the scores, the value scales
    # the softmax weights (sum_n w_n (s_n v_n) = sum_n (w_n s_n) v_n): G * Tq numbers per key and KV head
    # instead of D
    n_batch, n_q = q_idx.shape
    n_keys = key_slots.shape[1]
    _, n_heads, d = q.shape
    n_kv, dv = v_store.shape[1], v_store.shape[2]
    group = n_heads // n_kv
    flat = q_idx.reshape(-1)
    qp = q_pos.index_select(0, flat).view(n_batch, n_q, 1)
    kp = key_pos.reshape(n_batch, 1, n_keys)
    visible = _window_causal_pos((kp >= 0) & (qp >= 0), kp, qp, causal, window)  # [B, Tq, N] (positions are >= 0)
    # [B, Tq, Hkv, G * D] -> [B, Hkv, Tq, G * D] -> [B * Hkv, Tq * G, D]: query head h reads KV head h // G
    qf = _f32(q).index_select(0, flat).view(n_batch, n_q, n_kv, group * d).permute(0, 2, 1, 3).reshape(
        n_batch * n_kv, n_q * group, d)
    slots = key_slots.reshape(-1)
    kf = _gathered(k_store, slots, n_batch, n_keys, [0, 2, 3, 1], [n_batch * n_kv, d, n_keys])
    vf = _gathered(v_store, slots, n_batch, n_keys, [0, 2, 1, 3], [n_batch * n_kv, n_keys, dv])
    scores = torch.bmm(qf, kf)
    if k_scale is not None:
        scores = scores * _gathered_scales(k_scale, slots, n_batch, n_keys)
    scores = scores.view(n_batch, n_kv, n_q * group, n_keys) * scale
    # the mask repeated for the G query heads of a KV head: [B, 1, Tq * G, N], a 4-d broadcast
    bias = _hidden_bias(visible).view(n_batch, 1, n_q, 1, n_keys).expand(n_batch, 1, n_q, group, n_keys)
    weights = torch.softmax(scores + bias.reshape(n_batch, 1, n_q * group, n_keys), dim=-1).view(
        n_batch * n_kv, n_q * group, n_keys)
    if v_scale is not None:
        weights = weights * _gathered_scales(v_scale, slots, n_batch, n_keys)
    out = torch.bmm(weights, vf)  # [B * Hkv, Tq * G, Dv]
    out = out.view(n_batch, n_kv, n_q, group * dv).permute(0, 2, 1, 3).reshape(n_batch * n_q, n_heads, dv)
    return out * visible.any(dim=-1).view(n_batch * n_q, 1, 1).to(torch.float32)


def sdpa_gather_reference(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, one: Tensor, block_q: Tensor, block: Tensor,
    out_rows: Tensor, scale: float, causal: bool, window: int,
) -> Tensor:
    """Each query over the keys the host listed for it (module docstring): the one-token queries each
    over its own row of keys (a decode reads its sequence's rows once), the block's queries over one
    shared list (a prefill chunk reads its sequence's rows once, not once per token)."""
    alone = sdpa_gather_alone_reference(q, k_store, v_store, q_pos, one, scale, causal, window)
    shared = sdpa_gather_block_reference(q, k_store, v_store, q_pos, block_q, block, scale, causal, window)
    return torch.cat([alone, shared]).index_select(0, out_rows).to(q.dtype)


def sdpa_gather_alone_reference(q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, one: Tensor, scale: float,
                                causal: bool, window: int, k_scale: Tensor | None = None,
                                v_scale: Tensor | None = None) -> Tensor:
    """The tokens that attend alone, each over its own list: ``[T1, Hq, Dv]`` float32 (``sdpa_gather``'s rows
    before the block's; the native kernel's contract, ``pipeline/kernels/native.py``)."""
    return _attend_group(q, k_store, v_store, q_pos, one[:, 2, :1], one[:, 0], one[:, 1], scale, causal, window,
                         k_scale, v_scale)


def sdpa_gather_block_reference(q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, block_q: Tensor,
                                block: Tensor, scale: float, causal: bool, window: int, k_scale: Tensor | None = None,
                                v_scale: Tensor | None = None) -> Tensor:
    """The block's tokens over its one list: ``[Tb, Hq, Dv]`` float32."""
    return _attend_group(q, k_store, v_store, q_pos, block_q.view(1, -1), block[0].reshape(1, -1),
                         block[1].reshape(1, -1), scale, causal, window, k_scale, v_scale)


def sdpa_gather_q8_reference(
    q: Tensor, k_store: Tensor, k_scale: Tensor, v_store: Tensor, v_scale: Tensor, q_pos: Tensor, one: Tensor,
    block_q: Tensor, block: Tensor, out_rows: Tensor, scale: float, causal: bool, window: int,
) -> Tensor:
    """``sdpa_gather`` over 8-bit stores (``kv.dtype=int8``): a key or value is its store's integers
    times its slot's scale for its KV head (``k_scale``, ``v_scale``: [slots, Hkv] float32)."""
    alone = sdpa_gather_alone_reference(q, k_store, v_store, q_pos, one, scale, causal, window, k_scale, v_scale)
    shared = sdpa_gather_block_reference(q, k_store, v_store, q_pos, block_q, block, scale, causal, window, k_scale,
                                         v_scale)
    return torch.cat([alone, shared]).index_select(0, out_rows).to(q.dtype)


def sdpa_varlen_reference(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, q_cols: Tensor,
    seq_info: Tensor, columns: int, scale: float, causal: bool, window: int,
) -> Tensor:
    rows = k_store.shape[0] // columns
    visible = _column_visibility(q_pos, q_cols, seq_info, columns, rows, causal, window)
    # each query's column of the store: [rows, columns, H, D] -> [T, rows, H, D]. index_select copies
    # whole rows of H * D; an advanced-index gather over [T, rows] slots is several times slower on
    # ExecuTorch's portable kernels.
    k = k_store.view(rows, columns, *k_store.shape[1:]).index_select(1, q_cols).transpose(0, 1)
    v = v_store.view(rows, columns, *v_store.shape[1:]).index_select(1, q_cols).transpose(0, 1)
    return _attend_per_query(q, k, v, visible, scale)


def sdpa_cells_reference(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, q_seq_bits: Tensor,
    cell_pos: Tensor, cell_owners: Tensor, scale: float, causal: bool, window: int,
) -> Tensor:
    visible = torch.bitwise_and(cell_owners[None, :], q_seq_bits[:, None]) != 0  # [T, cells]
    visible = _window_causal(visible, cell_pos[None, :], q_pos, causal, window)
    return _attend_shared(q, k_store, v_store, visible, scale)


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


@torch.library.custom_op("kvcache::sdpa_gather", mutates_args=())
def sdpa_gather(
    q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, one: Tensor, block_q: Tensor, block: Tensor,
    out_rows: Tensor, scale: float, causal: bool, window: int,
) -> Tensor:
    return sdpa_gather_reference(q, k_store, v_store, q_pos, one, block_q, block, out_rows, scale, causal, window)


@sdpa_gather.register_fake
def _(q, k_store, v_store, q_pos, one, block_q, block, out_rows, scale, causal, window):
    return q.new_empty(out_rows.shape[0], q.shape[1], v_store.shape[-1])


@torch.library.custom_op("kvcache::sdpa_gather_q8", mutates_args=())
def sdpa_gather_q8(
    q: Tensor, k_store: Tensor, k_scale: Tensor, v_store: Tensor, v_scale: Tensor, q_pos: Tensor, one: Tensor,
    block_q: Tensor, block: Tensor, out_rows: Tensor, scale: float, causal: bool, window: int,
) -> Tensor:
    return sdpa_gather_q8_reference(q, k_store, k_scale, v_store, v_scale, q_pos, one, block_q, block, out_rows, scale,
                                    causal, window)


@sdpa_gather_q8.register_fake
def _(q, k_store, k_scale, v_store, v_scale, q_pos, one, block_q, block, out_rows, scale, causal, window):
    return q.new_empty(out_rows.shape[0], q.shape[1], v_store.shape[-1])


# ExecuTorch CPU backends have no kernel for the custom ops: compile replaces
# them with their ATen bodies through this table.
ATEN_DECOMPOSITIONS = {
    torch.ops.kvcache.sdpa_varlen.default: sdpa_varlen_reference,
    torch.ops.kvcache.sdpa_cells.default: sdpa_cells_reference,
    torch.ops.kvcache.sdpa_gather.default: sdpa_gather_reference,
    torch.ops.kvcache.sdpa_gather_q8.default: sdpa_gather_q8_reference,
}
