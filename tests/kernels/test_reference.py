"""The ATen attention ops against a float64 loop over queries, on fresh random data."""

import math

import pytest
import torch

from pipeline.kernels.reference import sdpa_cells_reference, sdpa_gather_reference, sdpa_varlen_reference

TOL = 1e-5


def naive(q, keys_of, scale):
    """keys_of(i) -> (k [N, Hkv, D], v [N, Hkv, Dv]) visible to query i, in float64."""
    n_tok, n_heads, _ = q.shape
    out = torch.zeros(n_tok, n_heads, 0 if n_tok == 0 else keys_of(0)[1].shape[-1] if keys_of(0)[1].numel() else 0, dtype=torch.float64)
    rows = []
    for i in range(n_tok):
        k, v = keys_of(i)
        if k.shape[0] == 0:
            rows.append(torch.zeros(n_heads, v.shape[-1], dtype=torch.float64))
            continue
        group = n_heads // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        rows.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v))
    return torch.stack(rows) if rows else out


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [0, 5])
def test_sdpa_varlen_matches_float64(hq, hkv, causal, window):
    gen = torch.Generator().manual_seed(hq * 10 + hkv + 100 * causal + window)
    rows, columns, d = 12, 3, 16
    k_store = torch.randn(rows * columns, hkv, d, generator=gen)
    v_store = torch.randn(rows * columns, hkv, d, generator=gen)
    # column 0: wrapped ring (positions 20..31 in rows 8..11 then 0..7); column 1: 5 rows; column 2: empty
    seq_info = torch.tensor([[0, 8, 4, 20], [0, 0, 8, 24], [1, 0, 5, 0], [0, 0, 0, 0], [2, 0, 0, 0]])
    q_cols = torch.tensor([0, 0, 0, 1, 1, 2])
    q_pos = torch.tensor([29, 30, 31, 3, 4, 0])
    q = torch.randn(len(q_cols), hq, d, generator=gen)
    scale = 1 / math.sqrt(d)
    got = sdpa_varlen_reference(q, k_store, v_store, q_pos, q_cols, seq_info, columns, scale, causal, window)

    def keys_of(i):
        keep = []
        for col, first_row, count, first_pos in seq_info.tolist():
            for r in range(first_row, first_row + count):
                kp = first_pos + r - first_row
                if col == q_cols[i] and (not causal or kp <= q_pos[i]) and (window == 0 or q_pos[i] - kp < window):
                    keep.append(r * columns + col)
        idx = torch.tensor(keep, dtype=torch.int64)
        return k_store[idx], v_store[idx]

    want = naive(q, keys_of, scale)
    assert torch.allclose(got.double(), want, atol=TOL, rtol=0)
    assert torch.all(got[-1] == 0), "a query that sees no key gets zeros"


def test_sdpa_varlen_detects_a_wrong_segment():
    """The float64 check can fail: shifting a segment's first position changes the answer."""
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(8, 1, 16, generator=gen)
    v = torch.randn(8, 1, 16, generator=gen)
    q = torch.randn(1, 2, 16, generator=gen)
    args = (q, k, v, torch.tensor([5]), torch.tensor([0]))
    a = sdpa_varlen_reference(*args, torch.tensor([[0, 0, 6, 0]]), 1, 0.25, True, 0)
    b = sdpa_varlen_reference(*args, torch.tensor([[0, 0, 6, 1]]), 1, 0.25, True, 0)
    assert not torch.allclose(a, b, atol=TOL)


@pytest.mark.parametrize("causal,window", [(True, 0), (True, 4), (False, 0)])
def test_sdpa_cells_matches_float64(causal, window):
    gen = torch.Generator().manual_seed(3 + window)
    n_cells, hq, hkv, d = 20, 4, 2, 16
    k_store = torch.randn(n_cells, hkv, d, generator=gen)
    v_store = torch.randn(n_cells, hkv, d, generator=gen)
    cell_pos = torch.randint(0, 12, (n_cells,), generator=gen)
    cell_owners = torch.randint(0, 8, (n_cells,), generator=gen)  # shared and free cells
    q_bits = torch.tensor([1, 2, 4, 1, 8])
    q_pos = torch.tensor([11, 6, 9, 3, 5])
    q = torch.randn(5, hq, d, generator=gen)
    got = sdpa_cells_reference(q, k_store, v_store, q_pos, q_bits, cell_pos, cell_owners, 0.3, causal, window)

    def keys_of(i):
        vis = (cell_owners & q_bits[i]) != 0
        if causal:
            vis &= cell_pos <= q_pos[i]
        if window:
            vis &= q_pos[i] - cell_pos < window
        return k_store[vis], v_store[vis]

    assert torch.allclose(got.double(), naive(q, keys_of, 0.3), atol=TOL, rtol=0)


def _gather_case(gen, hq, hkv, d, causal, window):
    """A step of three sequences in a store of 40 slots: a decode, a 5-token chunk (the block) and a
    2-token chunk attending alone; every list in position order, padded with slot 0 / position -1."""
    k_store = torch.randn(40, hkv, d, generator=gen)
    v_store = torch.randn(40, hkv, d, generator=gen)
    perm = torch.randperm(40, generator=gen)
    held = {0: (perm[:9], torch.arange(9)), 1: (perm[9:21], torch.arange(20, 32)), 2: (perm[21:24], torch.arange(3))}
    # tokens: seq 0 decodes position 8; seq 1 prefills 27..31; seq 2 prefills 1..2
    q_pos = torch.tensor([8, 27, 28, 29, 30, 31, 1, 2])
    seq_of = [0, 1, 1, 1, 1, 1, 2, 2]
    width = 9
    one = torch.zeros(3, 3, width, dtype=torch.int64)  # per row: slots, positions, the token
    one[:, 1] = -1
    for row, tok in enumerate([0, 6, 7]):
        slots, pos = held[seq_of[tok]]
        one[row, 0, : len(slots)], one[row, 1, : len(pos)], one[row, 2] = slots, pos, tok
    block_q = torch.tensor([1, 2, 3, 4, 5])
    out_rows = torch.tensor([0, 3, 4, 5, 6, 7, 1, 2])
    q = torch.randn(8, hq, d, generator=gen)
    args = (q, k_store, v_store, q_pos, one, block_q, torch.stack(held[1]), out_rows)

    def keys_of(i):
        slots, pos = held[seq_of[i]]
        keep = torch.ones(len(pos), dtype=torch.bool)
        if causal:
            keep &= pos <= q_pos[i]
        if window:
            keep &= q_pos[i] - pos < window
        return k_store[slots[keep]], v_store[slots[keep]]

    return args, keys_of


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("causal,window", [(True, 0), (True, 3), (False, 0)])
def test_sdpa_gather_matches_float64(hq, hkv, causal, window):
    gen = torch.Generator().manual_seed(11 * hq + hkv + 5 * window + causal)
    args, keys_of = _gather_case(gen, hq, hkv, 16, causal, window)
    got = sdpa_gather_reference(*args, 0.3, causal, window)
    want = naive(args[0], keys_of, 0.3)
    assert torch.allclose(got.double(), want, atol=TOL, rtol=0)


def test_sdpa_gather_detects_a_wrong_key_list():
    """The float64 check can fail: a block key listed at a wrong position, or a query routed to another
    output row, changes the answer."""
    gen = torch.Generator().manual_seed(5)
    args, keys_of = _gather_case(gen, 4, 2, 16, True, 0)
    want = naive(args[0], keys_of, 0.3)
    moved = list(args)
    moved[6] = args[6] + torch.tensor([[0], [1]])  # every block key one position later: the diagonal hides one more key
    assert not torch.allclose(sdpa_gather_reference(*moved, 0.3, True, 0).double(), want, atol=TOL, rtol=0)
    swapped = list(args)
    swapped[7] = args[7][[1, 0, 2, 3, 4, 5, 6, 7]]
    assert not torch.allclose(sdpa_gather_reference(*swapped, 0.3, True, 0).double(), want, atol=TOL, rtol=0)
