"""Tests of the Triton ``kvcache::sdpa_varlen_triton`` against the ATen reference
and a float64 reference written here.

On a machine without a GPU the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, set below before triton is imported).  With
``SDPA_VARLEN_NATIVE=1`` (and a CUDA device) they run compiled on the GPU, on
CUDA tensors, with larger head dims as well.
"""

import os

NATIVE = os.environ.get("SDPA_VARLEN_NATIVE") == "1"
if not NATIVE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import dataclasses
import functools
import json
import math

import pytest
import torch

try:
    import triton  # noqa: F401
except Exception as exc:  # pragma: no cover - triton is a pinned dependency
    pytest.skip(f"triton cannot be imported: {exc}", allow_module_level=True)

from compile_budget import Counter, enforce  # noqa: E402

from conftest import run_in_fresh_process  # noqa: E402
from pipeline.kernels import sdpa_varlen as K  # noqa: E402
from pipeline.kernels.reference import sdpa_varlen_reference  # noqa: E402

# max |out - ref| allowed against the float64 reference, by dtype
TOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DEVICE = "cuda" if NATIVE else "cpu"
# small splits so that tests exercise the split + merge path
SMALL = dict(tuning=K.Tuning(dec_block_n=16, pre_block_n=16, long_block_n=16, target_ctas=64, min_chunk=16, min_chunk_multi=16))

# In the interpreter the kernels run in a fresh process of their own: other test modules'
# use of Inductor (AOTInductor, torch.compile) in the same process breaks the interpreter's
# patching of triton.language ("Cannot call @triton.jit'd outside of the scope of a kernel").
_FRESH = os.environ.get("SDPA_VARLEN_FRESH_PROCESS") == "1"
_RERUN = not NATIVE and not _FRESH

if NATIVE and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("SDPA_VARLEN_NATIVE=1 needs a CUDA device", allow_module_level=True)


# In the parent the kernel tests report the fresh process's outcome for each of them
# (conftest.pytest_pyfunc_call); in the fresh process they run.
needs_kernels = (pytest.mark.in_child_process(run=functools.partial(run_in_fresh_process, __file__)) if _RERUN
                 else pytest.mark.kernels)


@pytest.fixture(autouse=True)
def _compile_budget(request, monkeypatch):
    """Counts the kernel specialisations the test launches against its ``compiles`` marker
    (``compile_budget.py``).  ``SDPA_VARLEN_COMPILES_LOG=PATH``: each test's count is appended
    there instead of checked (to size the budgets)."""
    counter = Counter()
    counter.install(monkeypatch, {"plan": K.plan._plan_kernel, "attention": K.attention._sdpa_varlen_fwd,
                                  "merge": K.merge._merge_split_list})
    yield
    log = os.environ.get("SDPA_VARLEN_COMPILES_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{request.node.nodeid} {len(counter.keys)} {counter.per_kernel()}\n")
        return
    error = enforce(request.node, counter)
    if error:
        pytest.fail(error)


@pytest.fixture(autouse=True)
def _poison_empty():
    """torch.empty fills new memory with NaN (floats) / max int: unwritten outputs
    and uninitialised scratch show up."""
    old_det = torch.are_deterministic_algorithms_enabled()
    old_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(old_det)
    torch.utils.deterministic.fill_uninitialized_memory = old_fill


# ------------------------------------------------------------------ problem maker
def make_step(seqs, *, columns, rows, hq, hkv, d, dv=None, extra_segments=2, dtype=torch.float32,
              seed=0, device=DEVICE):
    """seqs: list of dicts with col, n_keys, start_row, first_pos, n_q and
    optionally q_first (position of the first query token; default: the last
    n_q key positions).  A run of keys that passes the last row wraps to row 0
    (two segments)."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    k = torch.randn(rows * columns, hkv, d, generator=g).to(dtype)
    v = torch.randn(rows * columns, hkv, dv, generator=g).to(dtype)
    segs, q_cols, q_pos = [], [], []
    for s in seqs:
        n, r0, p0 = s["n_keys"], s.get("start_row", 0), s.get("first_pos", 0)
        first = min(n, rows - r0)
        if first > 0:
            segs.append([s["col"], r0, first, p0])
        if n - first > 0:
            segs.append([s["col"], 0, n - first, p0 + first])
        qf = s.get("q_first", p0 + n - s["n_q"])
        q_cols += [s["col"]] * s["n_q"]
        q_pos += list(range(qf, qf + s["n_q"]))
    for _ in range(extra_segments):  # unused rows: row_count == 0, junk elsewhere
        segs.append([int(torch.randint(0, columns, (1,), generator=g)), 3, 0, 77])
    perm = torch.randperm(len(segs), generator=g).tolist()
    seq_info = torch.tensor([segs[i] for i in perm], dtype=torch.int64)
    t = len(q_cols)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    args = [q, k, v, torch.tensor(q_pos, dtype=torch.int64), torch.tensor(q_cols, dtype=torch.int64), seq_info]
    return [a.to(device) for a in args]


def ref64(q, k, v, q_pos, q_cols, seq_info, columns, scale, causal, window):
    """Straightforward float64 reference, token by token."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    q_pos, q_cols, seq_info = q_pos.cpu(), q_cols.cpu(), seq_info.cpu()
    t, hq, _ = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(t, hq, v.shape[-1], dtype=torch.float64)
    for i in range(t):
        slots, kpos = [], []
        for col, r0, cnt, p0 in seq_info.tolist():
            if cnt > 0 and col == int(q_cols[i]):
                rows = torch.arange(r0, r0 + cnt)
                slots.append(rows * columns + col)
                kpos.append(p0 + rows - r0)
        if not slots:
            continue
        slots, kpos = torch.cat(slots), torch.cat(kpos)
        keep = torch.ones_like(kpos, dtype=torch.bool)
        if causal:
            keep &= kpos <= int(q_pos[i])
        if window > 0:
            keep &= int(q_pos[i]) - kpos < window
        idx = slots[keep]
        if idx.numel() == 0:
            continue
        kh = k[idx].repeat_interleave(g, 1)  # [n, hq, d]
        vh = v[idx].repeat_interleave(g, 1)
        s = torch.einsum("hd,nhd->hn", q[i], kh) * scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vh)
    return out


def check(args, columns, causal, window, scale=None, expect_split=None, **kw):
    q = args[0]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, plan = K.sdpa_varlen_triton_impl(*args, columns, scale, causal, window, return_plan=True, **kw)
    ref = sdpa_varlen_reference(*args, columns, scale, causal, window)
    r64 = ref64(*args, columns, scale, causal, window)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert torch.isfinite(out.float()).all(), "unwritten (NaN-poisoned) or non-finite output"
    tol = TOL[q.dtype]
    err64 = (out.double().cpu() - r64).abs().max().item()
    err_ref = (out.float() - ref.float()).abs().max().item()
    assert err64 <= tol, f"max err vs float64 {err64} > {tol}"
    assert err_ref <= 2 * tol, f"max err vs sdpa_varlen_reference {err_ref} > {2 * tol}"
    n_split = int(plan[int(K.H_SPLIT_BLOCKS)])
    if expect_split is not None:
        assert (n_split > 0) == expect_split, f"split blocks: {n_split}"
    return out, r64, n_split


MIXED = [
    # prefill chunk of 7 over a ring that wraps (rows 30..47 then 0..21)
    dict(col=3, n_keys=40, start_row=30, first_pos=200, n_q=7),
    # decode
    dict(col=0, n_keys=33, start_row=0, first_pos=0, n_q=1),
    # a column with no segment: sees nothing
    dict(col=1, n_keys=0, n_q=2, q_first=5),
    # decode at a position before every key: sees nothing when causal
    dict(col=4, n_keys=25, start_row=10, first_pos=50, n_q=1, q_first=40),
    # draft block of 3 over a wrapped ring
    dict(col=2, n_keys=45, start_row=40, first_pos=7, n_q=3),
]


@pytest.mark.compiles(3)
@needs_kernels
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [0, 6])
def test_mixed_step(hq, hkv, causal, window):
    """Decode, draft and prefill blocks in one step, in one attention launch."""
    args = make_step(MIXED, columns=5, rows=48, hq=hq, hkv=hkv, d=16, seed=hq * 10 + window + causal)
    out, r64, n_split = check(args, 5, causal, window, expect_split=True if window == 0 else None, **SMALL)
    t_nothing = [i for i, c in enumerate(args[4].tolist()) if c == 1]
    assert out[t_nothing].abs().max() == 0  # no key: zeros
    if causal:
        t_before = [i for i, c in enumerate(args[4].tolist()) if c == 4]
        assert out[t_before].abs().max() == 0


def test_nonpositive_scale_refused():
    """The kernel keeps its running maxima in scaled units (one multiply-add per score), which
    needs scale > 0: anything else is refused before a launch."""
    args = make_step(MIXED[:2], columns=5, rows=48, hq=4, hkv=2, d=16, seed=6)
    geo = K.geometry_of(args[0], args[1], args[2], 5)
    with pytest.raises(ValueError, match=r"scale=-0.5: a positive number"):
        K.attend_impl(args[0], args[1], args[2], torch.zeros(geo.plan_len, dtype=torch.int32), 5, -0.5, True, 0, geo)


def _item_lengths(args, columns, tuning):
    """The plan's item key counts and its header, for a causal step."""
    geo = K.geometry_of(args[0], args[1], args[2], columns, tuning)
    plan = K.plan_impl(args[3], args[4], args[5], columns, True, 0, geo).cpu()
    recs = plan[geo.rec_off: geo.rec_off + int(plan[int(K.H_ITEMS)]) * K.NBF].view(-1, K.NBF)
    return (recs[:, int(K.F_KEND)] - recs[:, int(K.F_KSTART)]).tolist(), plan[:K.HDR].tolist(), geo


@pytest.mark.compiles(3)
@needs_kernels
def test_splits_stay_within_target_ctas():
    """A long decode's splits make at most ``Tuning.target_ctas`` programs (items x KV heads): at
    32 KV heads 264 // 32 = 8 items, not 9 (288 programs, two per SM of an H200, would leave 24
    for a second round)."""
    tuning = K.Tuning()
    for hkv in (8, 16, 32):  # (at 2, min_chunk bounds the splits first)
        args = make_step([dict(col=0, n_keys=32768, n_q=1)], columns=1, rows=32768, hq=hkv, hkv=hkv, d=16, seed=hkv)
        programs = len(_item_lengths(args, 1, tuning)[0]) * hkv
        # most of the budget used: items hold a whole number of key tiles, so a few less than aimed at
        assert 0.9 * tuning.target_ctas <= programs <= tuning.target_ctas, f"{hkv} KV heads: {programs} programs"


@pytest.mark.compiles(4)
@needs_kernels
def test_item_cap():
    """Tuning.item_cap: a block between one and two nominal chunks (visible keys / target items),
    which the split in proportion to its share leaves as items longer than the chunk, is cut so
    that none passes item_cap chunks (rounded up to the key tile), where the step's items then stay
    within one wave (the target); the output still matches float64."""
    small = dict(dec_block_n=16, pre_block_n=16, long_block_n=16, target_ctas=16, min_chunk=16, min_chunk_multi=16)
    # three decodes (8 target items at 2 KV heads): 508 keys, a nominal chunk of 64; 190 keys -> 2 items of 96 by share
    args = make_step([dict(col=0, n_keys=256, start_row=40, n_q=1), dict(col=1, n_keys=62, n_q=1),
                      dict(col=2, n_keys=190, start_row=100, n_q=1)], columns=3, rows=320, hq=4, hkv=2, d=16, seed=21)
    for cap, longest in ((0.0, 96), (1.0, 64)):
        tuning = K.Tuning(**small, item_cap=cap)
        lengths, hdr, geo = _item_lengths(args, 3, tuning)
        assert max(lengths) == longest and len(lengths) <= geo.target_items, f"item_cap={cap}: items {lengths}"
        check(args, 3, True, 0, expect_split=True, tuning=tuning)
    # seven decodes of 8/7 chunks: cut in two they would make 14 items, past the wave of 8: left whole
    args = make_step([dict(col=c, n_keys=64, start_row=8 * c, n_q=1) for c in range(7)], columns=7, rows=96,
                     hq=4, hkv=2, d=16, seed=22)
    assert _item_lengths(args, 7, K.Tuning(**small, item_cap=1.0))[0] == [64] * 7
    for bad in (0.5, float("inf")):
        with pytest.raises(ValueError, match=r"item_cap=.*: 0 \(off\) or a number from 1 to 1000"):
            K.Tuning(item_cap=bad)


@pytest.mark.compiles(3)
@needs_kernels
def test_default_tuning_no_split():
    args = make_step(MIXED, columns=5, rows=48, hq=4, hkv=2, d=16, seed=3)
    check(args, 5, True, 0, expect_split=False)


@pytest.mark.compiles(3)
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_dv(dtype):
    seqs = [dict(col=1, n_keys=70, start_row=50, first_pos=3, n_q=5),
            dict(col=0, n_keys=20, start_row=2, first_pos=9, n_q=1)]
    args = make_step(seqs, columns=2, rows=80, hq=4, hkv=1, d=32, dv=16, dtype=dtype, seed=7)
    check(args, 2, True, 0, expect_split=True, **SMALL)


@pytest.mark.compiles(5)
@needs_kernels
@pytest.mark.parametrize("window", [0, 1, 20])
def test_long_prefill_blocks_and_window(window):
    # 40 query tokens (several query blocks, not aligned to the block size),
    # history in a wrapped ring, non-causal and causal
    seqs = [dict(col=0, n_keys=90, start_row=70, first_pos=1000, n_q=40),
            dict(col=1, n_keys=12, start_row=0, first_pos=0, n_q=12)]
    args = make_step(seqs, columns=2, rows=96, hq=2, hkv=1, d=16, seed=11 + window)
    check(args, 2, True, window, **SMALL)
    check(args, 2, False, window, **SMALL)


@pytest.mark.compiles(3)
@needs_kernels
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gap", [0, 6])
def test_key_tile_across_the_ring_wrap(causal, gap):
    """A key tile that holds the end of one segment and the start of the other (the ring's
    wrap), inside the key range, under a window.  The plan puts a column's segments in order of
    position whatever seq_info's order: the same plan either way, the older segment first, so a
    wrapped ring (gap 0) is one run of positions and its interior tiles run unmasked.  With a gap
    in the positions the two are not one run, so that tile is masked even where its first
    position says every row sees it."""
    g = torch.Generator().manual_seed(21)
    rows, hkv, hq, d = 64, 1, 2, 16
    k = torch.randn(rows, hkv, d, generator=g)
    v = torch.randn(rows, hkv, d, generator=g)
    # rows 40..63: positions 100..123; rows 0..35: 124 + gap ..
    wrap_seg, head_seg = [0, 40, 24, 100], [0, 0, 36, 124 + gap]
    q_pos = torch.arange(144, 160) + gap
    tuning = K.Tuning(pre_block_n=16, target_ctas=1)
    plans = []
    for order in ([wrap_seg, head_seg], [head_seg, wrap_seg]):
        seq_info = torch.tensor(order, dtype=torch.int64)
        args = [a.to(DEVICE) for a in (torch.randn(16, hq, d, generator=g), k, v, q_pos,
                                        torch.zeros(16, dtype=torch.int64), seq_info)]
        _, plan = K.sdpa_varlen_triton_impl(*args, 1, 0.25, causal, 50, return_plan=True, tuning=tuning)
        plans.append(plan.cpu())
        check(args, 1, causal, 50, tuning=tuning)
    assert torch.equal(plans[0], plans[1])
    blk = plans[0][K.HDR: K.HDR + K.NBF].tolist()
    skip = max(0, 144 + gap - 50 + 1 - 100)  # keys of the older segment before the first query's window
    assert (blk[int(K.F_ROW0)], blk[int(K.F_POS0)], blk[int(K.F_ROW1)], blk[int(K.F_POS1)]) == (
        40 + skip, 100 + skip, 0, 124 + gap)
    assert (blk[int(K.F_POS1)] == blk[int(K.F_POS0)] + blk[int(K.F_N0)]) == (gap == 0)  # one run of positions


def test_long_stages_fit_shared_memory(monkeypatch):
    """The long launch's depth is the Tuning's where the device's shared memory per program holds its
    tiles (a Hopper GPU's 227 KiB: 3 stages of 128-key tiles), one stage fewer on an A100's 163 KiB;
    no device figure (the interpreter): the Tuning's."""
    import types

    geo = K.geometry(4096, 4, 32, 8, 128, 128, 2, K.Tuning())
    assert geo.long_launch and geo.bn_long == 128 and geo.block_m_long == 128 and geo.long_stages == 3
    q = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda:0"), element_size=lambda: 2)
    for optin, stages in [(232448, 3), (166912, 2), (90000, 1), (None, 3)]:
        K.attention._shared_memory_per_program.cache_clear()  # read once per device: a new device each time here
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda _dev, optin=optin: types.SimpleNamespace(shared_memory_per_block_optin=optin))
        assert K.attention._long_stages(q, geo, 128, 128) == stages, optin
    K.attention._shared_memory_per_program.cache_clear()


@pytest.mark.compiles(5)
@needs_kernels
def test_long_launch_order():
    """The long launch runs its items last to first (``Tuning.longest_first``): the same output,
    bit for bit, as in plan order, split long blocks (merged by their last item) included."""
    tuning = dataclasses.replace(SMALL["tuning"], pre_block_m=16, long_block_m=32, long_min_tokens=0)
    seqs = [dict(col=0, n_keys=70, n_q=40), dict(col=1, n_keys=3, n_q=1), dict(col=2, n_keys=55, n_q=12),
            dict(col=3, n_keys=64, start_row=9, first_pos=0, n_q=33)]
    args = make_step(seqs, columns=4, rows=72, hq=4, hkv=2, d=16, seed=21)
    geo = K.geometry_of(args[0], args[1], args[2], 4, tuning)
    plan = K.plan_impl(args[3], args[4], args[5], 4, True, 0, geo).cpu()
    blocks = [(int(plan[K.HDR + b * K.NBF + int(K.F_NTOK)]), int(plan[K.HDR + b * K.NBF + int(K.F_NSPLIT)]))
              for b in range(int(plan[int(K.H_BLOCKS)]))]
    assert geo.long_launch and sum(n > geo.tokb_short and s > 1 for n, s in blocks) >= 2, blocks  # long, split
    last_first, _, n_split = check(args, 4, True, 0, expect_split=True, tuning=tuning)
    in_order, _, _ = check(args, 4, True, 0, expect_split=True, tuning=dataclasses.replace(tuning, longest_first=False))
    assert n_split >= 2 and torch.equal(last_first, in_order)


@pytest.mark.compiles(8)
@needs_kernels
@pytest.mark.parametrize("long_m", [0, 32])
def test_blocks_cut_from_each_run_start(long_m):
    """A run of query tokens is cut into blocks of TOKB tokens from its first token, wherever
    its positions start: a draft block of TOKB tokens at an unaligned position is one block
    (its keys read once), a run of 2 TOKB + 3 is three.  With long blocks (long_m = 32 rows:
    TOKB 16) the same runs give blocks of 8 (the short path), 16 (the long path's launch) and 3."""
    tuning = K.Tuning(pre_block_m=16, dec_block_n=16, pre_block_n=16, long_block_m=long_m, long_block_n=16,
                      long_min_tokens=0)
    tokb = 16 if long_m else 8  # G_PAD 2
    seqs = [dict(col=0, n_keys=40, start_row=0, first_pos=0, n_q=8, q_first=13),  # 13..20 crosses 16
            dict(col=1, n_keys=50, start_row=5, first_pos=0, n_q=19)]  # 31..49
    args = make_step(seqs, columns=2, rows=64, hq=4, hkv=2, d=16, seed=11)
    geo = K.geometry_of(args[0], args[1], args[2], 2, tuning)
    assert (geo.tokb_short, geo.tokb, geo.long_launch) == (8, tokb, bool(long_m))
    _, plan = K.sdpa_varlen_triton_impl(*args, 2, 0.25, True, 0, return_plan=True, tuning=tuning)
    plan = plan.cpu()
    ntok = [int(plan[K.HDR + b * K.NBF + int(K.F_NTOK)]) for b in range(int(plan[int(K.H_BLOCKS)]))]
    assert ntok == ([8, 16, 3] if long_m else [8, 8, 8, 3]), ntok
    check(args, 2, True, 0, tuning=tuning)
    check(args, 2, False, 5, tuning=tuning)
    # a run of 1100 tokens after one decode token: the plan's passes go 1024 tokens at a time,
    # the run's start carried into the second
    seqs = [dict(col=0, n_keys=5, n_q=1), dict(col=1, n_keys=1103, start_row=0, first_pos=0, n_q=1100)]
    args = make_step(seqs, columns=2, rows=1200, hq=4, hkv=2, d=16, seed=12)
    geo = K.geometry_of(args[0], args[1], args[2], 2, tuning)
    plan = K.plan_impl(args[3], args[4], args[5], 2, True, 0, geo).cpu()
    tok0 = [int(plan[K.HDR + b * K.NBF]) for b in range(int(plan[int(K.H_BLOCKS)]))]
    assert tok0 == [0] + list(range(1, 1101, tokb)), tok0[120:]


@needs_kernels
def test_long_blocks_launch_skipped_by_the_token_bound():
    """Long blocks (and their launch) only where the step may hold more than TOKB_SHORT and
    long_min_tokens tokens; without them the plan cuts runs at the short tile's tokens."""
    t = K.Tuning(pre_block_m=16, long_block_m=32, long_min_tokens=0)
    assert not K.geometry(8, 4, 4, 2, 16, 16, 4, t).long_launch  # 8 tokens: no long block possible
    geo = K.geometry(9, 4, 4, 2, 16, 16, 4, t)
    assert geo.long_launch and (geo.tokb, geo.part_rows) == (16, 32)
    geo = K.geometry(64, 4, 4, 2, 16, 16, 4, dataclasses.replace(t, long_min_tokens=64))
    assert not geo.long_launch and (geo.tokb, geo.part_rows) == (8, 16)
    assert K.geometry(65, 4, 4, 2, 16, 16, 4, dataclasses.replace(t, long_min_tokens=64)).long_launch
    assert not K.geometry(64, 4, 4, 2, 16, 16, 4, dataclasses.replace(t, long_block_m=0)).long_launch
    assert not K.geometry(64, 4, 4, 2, 128, 128, 4, t).long_launch  # fp32 at D 128: no long blocks
    with pytest.raises(ValueError, match="long_block_m=24"):
        K.Tuning(long_block_m=24)


@pytest.mark.compiles(4)
@needs_kernels
@pytest.mark.parametrize("trial", range(6))  # one test each: the GPU suite's shards compile them side by side
def test_fuzz(trial):
    g = torch.Generator().manual_seed(123 + trial)
    columns, rows = (4, 40) if trial < 4 else (24, 40)  # trials 4, 5: 18 sequences, more blocks and items
    hkv = [1, 2][trial % 2]
    hq = hkv * [1, 2, 4][trial % 3]
    seqs = []
    cols = torch.randperm(columns, generator=g).tolist()[: 3 if trial < 4 else 18]
    for col in cols:
        n = int(torch.randint(0, rows + 1, (1,), generator=g))
        n_q = int(torch.randint(1, 9 if trial < 4 else 21, (1,), generator=g))
        seqs.append(dict(col=col, n_keys=n, start_row=int(torch.randint(0, rows, (1,), generator=g)),
                         first_pos=int(torch.randint(0, 50, (1,), generator=g)), n_q=n_q,
                         q_first=int(torch.randint(0, 100, (1,), generator=g))))
    args = make_step(seqs, columns=columns, rows=rows, hq=hq, hkv=hkv, d=16, seed=trial)
    causal = bool(trial % 2)
    window = [0, 9][trial // 2 % 2]
    # trials 0, 3, 4, 5: the plan's passes 16 lanes at a time (several per pass, carries across them);
    # trials 1, 2, 4, 5: 16-row short tiles and 32-row long ones (TOKB 4 / 8 at G_PAD 4, 8 / 16 at 2),
    # so blocks go down all three paths
    small_tiles = trial in (1, 2, 4, 5)
    check(args, columns, causal, window,
          tuning=dataclasses.replace(SMALL["tuning"], plan_width=16 if trial in (0, 3, 4, 5) else 1024,
                                     pre_block_m=16 if small_tiles else 64, long_block_m=32 if small_tiles else 128,
                                     long_min_tokens=0, longest_first=trial != 4))


@pytest.mark.compiles(3)
@needs_kernels
def test_registered_op_and_fake():
    args = make_step(MIXED[:2], columns=5, rows=48, hq=4, hkv=2, d=16, seed=5)
    out = torch.ops.kvcache.sdpa_varlen_triton(*args, 5, 0.25, True, 0)
    ref = sdpa_varlen_reference(*args, 5, 0.25, True, 0)
    assert (out - ref).abs().max().item() <= TOL[torch.float32]
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        fo = torch.ops.kvcache.sdpa_varlen_triton(*fake, 5, 0.25, True, 0)
    assert tuple(fo.shape) == tuple(ref.shape) and fo.dtype == ref.dtype


NATIVE_CASES = [(d, torch.bfloat16, 8, 2) for d in (64, 128, 256)] + [(d, torch.float32, 8, 2) for d in (128, 256)]
NATIVE_CASES += [(128, torch.bfloat16, 4, 4), (128, torch.bfloat16, 32, 8)]


@pytest.mark.skipif(not NATIVE, reason="compiled-kernel test: set SDPA_VARLEN_NATIVE=1 on a CUDA machine")
@pytest.mark.compiles(6)
@pytest.mark.parametrize("case", range(len(NATIVE_CASES)),
                         ids=[f"d{d}-{str(t)[6:]}-{hq}x{hkv}" for d, t, hq, hkv in NATIVE_CASES])
def test_native_head_dims(case):
    """Each head dim, dtype and grouping compiled for the GPU, in two specialisations of each kernel
    (~20 s of compile each; the decode merge launch's, a small kernel, for the causal calls): causal
    with a window, unsplit, and split blocks (a Tuning of many short items)
    under one of causal or not, alternating over the cases, so that across them every head dim and
    dtype meets both masks' code and the split + merge path."""
    d, dtype, hq, hkv = NATIVE_CASES[case]
    seqs = [dict(col=5, n_keys=700, start_row=600, first_pos=31, n_q=150),  # prefill chunk, wrapped
            dict(col=0, n_keys=1000, start_row=0, first_pos=0, n_q=1),
            dict(col=2, n_keys=333, start_row=900, first_pos=5, n_q=16),  # draft block, wrapped
            dict(col=3, n_keys=0, n_q=1, q_first=3)]
    args = make_step(seqs, columns=6, rows=1024, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=d + hq)
    check(args, 6, True, 100)
    check(args, 6, case % 2 == 0, 0, expect_split=True, tuning=K.Tuning(target_ctas=512, min_chunk=64, min_chunk_multi=64))


@pytest.mark.compiles(3)
@needs_kernels
def test_export_keeps_op():
    args = make_step(MIXED[:2], columns=5, rows=48, hq=4, hkv=2, d=16, seed=5)

    class M(torch.nn.Module):
        def forward(self, q, k, v, qp, qc, si):
            return torch.ops.kvcache.sdpa_varlen_triton(q, k, v, qp, qc, si, 5, 0.25, True, 0) * 2

    ep = torch.export.export(M(), tuple(args))
    assert "kvcache.sdpa_varlen_triton" in ep.graph_module.code
    assert (ep.module()(*args) - M()(*args)).abs().max().item() == 0


@pytest.mark.skipif(not NATIVE, reason="inductor codegen of the Triton kernels needs CUDA")
@pytest.mark.compiles(2)  # Inductor compiles its own copies of the kernels (not counted by the fixture; weighed for the shards)
def test_native_torch_compile_dynamic():
    # inductor traces into the triton_op (as AOTInductor does): symbolic T in the grid
    fn = torch.compile(lambda *a: torch.ops.kvcache.sdpa_varlen_triton(*a, 6, 0.1, True, 0), dynamic=True, fullgraph=True)
    for n_q in (5, 9):
        seqs = [dict(col=5, n_keys=300, start_row=900, first_pos=31, n_q=n_q),
                dict(col=0, n_keys=100, start_row=0, first_pos=0, n_q=1)]
        args = make_step(seqs, columns=6, rows=1024, hq=8, hkv=2, d=64, dtype=torch.bfloat16, seed=n_q)
        out = fn(*args)
        ref = ref64(*args, 6, 0.1, True, 0)
        assert (out.double().cpu() - ref).abs().max().item() <= TOL[torch.bfloat16]


@pytest.mark.compiles(3)
@needs_kernels
def test_planned_ops_match_one_call():
    """plan + attend (what lower_kv emits for CUDA) computes exactly what the one-call op does."""
    args = make_step(MIXED, columns=5, rows=48, hq=4, hkv=2, d=16, seed=9)
    q, k, v, q_pos, q_cols, seq_info = args
    one = torch.ops.kvcache.sdpa_varlen_triton(*args, 5, 0.25, True, 6)
    plan = torch.ops.kvcache.sdpa_varlen_plan(q_pos, q_cols, seq_info, 5, True, 6, 4, 2, 16, 16, q.element_size())
    two = torch.ops.kvcache.sdpa_varlen_attend(q, k, v, q_pos, plan, 5, 0.25, True, 6)
    assert torch.equal(one, two)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fq, fqp, fqc, fsi = (mode.from_tensor(a) for a in (q, q_pos, q_cols, seq_info))
        fplan = torch.ops.kvcache.sdpa_varlen_plan(fqp, fqc, fsi, 5, True, 6, 4, 2, 16, 16, q.element_size())
    assert fplan.shape == plan.shape and fplan.dtype == plan.dtype


@pytest.mark.compiles(3)
@needs_kernels
@pytest.mark.parametrize("per_load,group", [(1, 0), (2, 0), (4, 0), (1, 3), (2, 2), (2, 3)])
def test_merge_of_many_splits(per_load, group):
    """A long sequence split many times, merged by the last of its items to finish (the fused merge:
    a non-causal call's decode blocks and every multi-token block; here the decode block too), a few
    splits per load (odd remainders included); splits in proportion to each block's keys; with
    ``group``, in two levels (groups of that many items, then the groups; a short last group)."""
    # per_load splits per merge load for G_PAD=2, 16 columns
    tuning = K.Tuning(dec_block_n=16, pre_block_n=16, target_ctas=64, min_chunk=16, min_chunk_multi=16,
                      merge_tile=per_load * 2 * 16, merge_group=group, dec_merge_launch=False)
    seqs = [dict(col=1, n_keys=300, start_row=250, first_pos=0, n_q=1),
            dict(col=0, n_keys=150, start_row=0, first_pos=0, n_q=3)]
    args = make_step(seqs, columns=2, rows=320, hq=4, hkv=2, d=16, seed=4 + per_load)
    _, _, n_split = check(args, 2, True, 0, expect_split=True, tuning=tuning)
    assert n_split == 2, "both blocks split"
    plan = K.sdpa_varlen_triton_impl(*args, 2, 0.25, True, 0, return_plan=True, tuning=tuning)[1].cpu()
    nbf, hdr = K.NBF, K.HDR
    blocks = [plan[hdr + b * nbf: hdr + (b + 1) * nbf].tolist() for b in range(int(plan[int(K.H_BLOCKS)]))]
    long = next(b for b in blocks if b[int(K.F_NTOK)] == 1)
    assert long[int(K.F_NSPLIT)] >= 5, f"the long sequence should have at least 5 splits: {long}"
    assert long[int(K.F_CHUNK)] * (long[int(K.F_NSPLIT)] - 1) < 300 <= long[int(K.F_CHUNK)] * long[int(K.F_NSPLIT)]
    multi = next(b for b in blocks if b[int(K.F_NTOK)] == 3)
    assert multi[int(K.F_NSPLIT)] >= 2, f"the multi-token block should be split: {multi}"
    geo = K.geometry_of(args[0], args[1], args[2], 2, tuning)
    assert geo.spl_dec == per_load
    tickets = plan[geo.tickets_off: geo.tickets_off + geo.n_tickets]
    assert int(tickets.abs().sum()) == 0, "every merge ticket is back to zero after the launch"



@pytest.mark.compiles(5)
@needs_kernels
@pytest.mark.parametrize("per_load,split", [(1, 1), (2, 2), (64, 1)])
def test_decode_merge_launch(per_load, split):
    """A causal call's split one-token blocks are merged by the merge launch after the attention
    launch (``Tuning.dec_merge_launch``), from the plan's split list: every split decode block listed
    once with its first token, items and first partial slot; a few partials per load and the columns
    over ``split`` programs; the multi-token block beside them keeps the fused merge."""
    tuning = K.Tuning(dec_block_n=16, pre_block_n=16, target_ctas=64, min_chunk=16, min_chunk_multi=16,
                      merge_tile=per_load * 2 * 32 // split, dec_merge_split=split)
    seqs = [dict(col=1, n_keys=300, start_row=250, first_pos=0, n_q=1),
            dict(col=0, n_keys=150, start_row=0, first_pos=0, n_q=3),
            dict(col=3, n_keys=200, start_row=40, first_pos=9, n_q=1),
            dict(col=2, n_keys=20, start_row=0, first_pos=0, n_q=1)]  # too short to split
    args = make_step(seqs, columns=4, rows=320, hq=4, hkv=2, d=32, seed=11 + per_load)
    _, _, n_split = check(args, 4, True, 0, expect_split=True, tuning=tuning)
    assert n_split == 3, "the two long decode blocks and the multi-token block split"
    geo = K.geometry_of(args[0], args[1], args[2], 4, tuning)
    assert geo.dec_merge_split == split and geo.spl_merge == per_load
    plan = K.sdpa_varlen_triton_impl(*args, 4, 0.25, True, 0, return_plan=True, tuning=tuning)[1].cpu()
    blocks = [plan[K.HDR + b * K.NBF: K.HDR + (b + 1) * K.NBF].tolist() for b in range(int(plan[int(K.H_BLOCKS)]))]
    want = sorted((b[int(K.F_TOK0)], b[int(K.F_NSPLIT)], b[int(K.F_PSLOT0)]) for b in blocks
                  if b[int(K.F_NTOK)] == 1 and b[int(K.F_NSPLIT)] > 1)
    n_listed = int(plan[int(K.H_DEC_SPLITS)])
    listed = [plan[geo.list_off + i * K.LIST_WORDS: geo.list_off + i * K.LIST_WORDS + 3].tolist() for i in range(n_listed)]
    assert len(want) == 2 and sorted(tuple(e) for e in listed) == want, (listed, want)
    check(args, 4, False, 0, expect_split=True, tuning=tuning)  # non-causal: every block on the fused merge


# The episode's tuning: few programs per launch (the interpreter is slow; the registered ops' Tuning()
# makes 264 // Hkv items per KV head, most of them exiting at once) and splits even on short histories.
EPISODE = K.Tuning(target_ctas=8, min_chunk=16, min_chunk_multi=16)


def _plan_under_episode_tuning(*args, **kwargs):
    return K.sdpa_varlen_plan_impl(*args, **kwargs, tuning=EPISODE)


def _attend_under_episode_tuning(*args, **kwargs):
    return K.sdpa_varlen_attend_impl(*args, **kwargs, tuning=EPISODE)


def _with_episode_tuning(module) -> int:
    """Points a lowered method's planned-attention ops at their ``*_impl`` under ``EPISODE`` (the
    same arguments; the registered ops pass ``Tuning()``); returns how many it changed."""
    swap = {torch.ops.kvcache.sdpa_varlen_plan.default: _plan_under_episode_tuning,
            torch.ops.kvcache.sdpa_varlen_attend.default: _attend_under_episode_tuning}
    swapped = 0
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target in swap:
            node.target = swap[node.target]
            swapped += 1
    module.recompile()
    return swapped


@pytest.mark.compiles(7)
@needs_kernels
@pytest.mark.skipif(NATIVE, reason="CPU interpreter test; on a GPU the pipeline's validate stage does this")
def test_cuda_lowering_runs_an_episode(tmp_path):
    """The graphs lower_kv builds for backend=cuda (one plan per layer kind, Triton attention
    per layer; here in the interpreter, their ops run under ``EPISODE``), driven through a
    continuous-batching episode with the methods sharing their KV stores, match the eager oracle."""
    from conftest import compose_config
    from pipeline.build.manifest import manifest
    from pipeline.build.plan import plan_of
    from pipeline.build.roles import TARGET
    from pipeline.runtime.session import Session
    from pipeline.stages import export, lower_kv, validate

    cfg = compose_config("kv=sequence", "kv.max_seqs=2", "kv.max_step_tokens=8", "backend=cuda", "stages=[export,lower_kv]",
                         "validate.prompt_lengths=[11,4,13]", "validate.decode_steps=12")
    plan = plan_of(cfg)  # the GPU is needed from compile on: not here
    exported = export.run(plan, {}, tmp_path)
    lowered = lower_kv.run(plan, exported, tmp_path)
    kinds = set(plan.target.layout.kinds)
    for name in ("target_forward_from_embeddings",):
        targets = [str(n.target) for n in lowered["lowered"][name].graph.nodes if n.op == "call_function"]
        assert targets.count("kvcache.sdpa_varlen_plan.default") == len(kinds)  # once per layer kind
        assert targets.count("kvcache.sdpa_varlen_attend.default") == cfg.model.n_layers
    stores, runners, swapped = {}, {}, {}
    for name, ep in lowered["lowered"].items():
        module = ep.module()
        swapped[name] = _with_episode_tuning(module)
        for fqn, buf in list(module.named_buffers()):
            if fqn.startswith("kv_store."):  # one set of stores for every method, as in the .pte
                setattr(module.kv_store, fqn.split(".", 1)[1], stores.setdefault(fqn, torch.randn_like(buf)))
        runners[name] = lambda args, m=module: [m(*args)]
    assert swapped["target_forward_from_embeddings"] == len(kinds) + cfg.model.n_layers
    methods = {name: [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
               for name, ep in lowered["lowered"].items()}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest(plan.manifest_sections(), "cuda", "-", [], methods)))
    session = Session(tmp_path, methods=runners)
    model = exported["models"][TARGET]
    scripts = validate.plan(cfg.validate, session.max_seqs, model.args.vocab_size)
    stats = validate.run_episode(session, model, scripts, causal=True)
    assert stats["decode_steps"] > 0 and stats["mixed_steps"] > 0
    assert max(max(s.errors) for s in scripts) < 1e-4
