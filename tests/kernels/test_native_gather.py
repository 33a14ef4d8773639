"""The native CPU attention (kv.cpu_kernel=native: pipeline/kernels/cpu/sdpa_gather.cpp for the tokens that
attend alone, the ATen form for a block; pipeline/kernels/native.py) against float64 on fresh random inputs:
tokens attending alone over their own padded lists, a block of tokens sharing one list, causal and not,
windowed and not, float32 and 8-bit stores, each run by ExecuTorch's runtime from a program inlined as the
backend inlines it (the kernel called by name: the default backend's partitioner leaves it alone)."""

import shutil

import pytest
import torch

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the native kernels are built with g++: none here")

HQ, HKV, D, DV, SLOTS = 6, 2, 16, 8, 40


def problem(seed: int, int8: bool, only_block: bool = False) -> dict:
    """Seven tokens: three attend alone (lists of 7 slots, shorter ones padded with position -1), four share a
    block's list of 9; or, ``only_block``, the four block tokens and an empty alone-group (one hidden entry)."""
    g = torch.Generator().manual_seed(seed)
    if int8:
        k = torch.randint(-127, 128, (SLOTS, HKV, D), generator=g, dtype=torch.int8)
        v = torch.randint(-127, 128, (SLOTS, HKV, DV), generator=g, dtype=torch.int8)
        scales = [torch.rand(SLOTS, HKV, generator=g) / 100 + 1e-3 for _ in range(2)]
    else:
        k, v, scales = torch.randn(SLOTS, HKV, D, generator=g), torch.randn(SLOTS, HKV, DV, generator=g), None
    n_one, n_keys = 3, 7
    alone_tokens, block_tokens = ([], [0, 1, 2, 3]) if only_block else ([0, 2, 5], [1, 3, 4, 6])
    n_tokens = len(alone_tokens) + len(block_tokens)
    q = torch.randn(n_tokens, HQ, D, generator=g)
    q_pos = torch.randint(0, 12, (n_tokens,), generator=g)
    one = torch.full((max(len(alone_tokens), 1), 3, n_keys), -1, dtype=torch.int64)
    one[:, 0] = 0
    one[:, 2] = 0
    for e, token in enumerate(alone_tokens[:n_one]):
        length = [7, 4, 1][e]
        one[e, 0, :length] = torch.randperm(SLOTS, generator=g)[:length]
        one[e, 1, :length] = torch.randperm(14, generator=g)[:length].sort().values  # some past the token's
        one[e, 2] = token
    block = torch.stack([torch.randperm(SLOTS, generator=g)[:9], torch.arange(9) + 2])
    q_pos[block_tokens] = torch.tensor([6, 8, 9, 10])  # inside the block's positions: the causal bound matters
    rows = {t: r for r, t in enumerate(alone_tokens)}
    offset = one.shape[0]
    rows.update({t: offset + r for r, t in enumerate(block_tokens)})
    out_rows = torch.tensor([rows[t] for t in range(n_tokens)])
    return dict(q=q, k=k, v=v, scales=scales, q_pos=q_pos, one=one, block_q=torch.tensor(block_tokens), block=block,
                out_rows=out_rows)


def oracle(p: dict, scale: float, causal: bool, window: int) -> torch.Tensor:
    """Each token over its own list, in float64, written from the contract (not from reference.py)."""
    k, v = p["k"].double(), p["v"].double()
    if p["scales"] is not None:
        k, v = k * p["scales"][0].double()[..., None], v * p["scales"][1].double()[..., None]
    lists = {int(p["one"][e, 2, 0]): (p["one"][e, 0], p["one"][e, 1]) for e in range(p["one"].shape[0])
             if (p["one"][e, 1] >= 0).any()}
    lists.update({int(t): (p["block"][0], p["block"][1]) for t in p["block_q"]})
    out = torch.zeros(p["q"].shape[0], HQ, DV, dtype=torch.float64)
    for t, (slots, positions) in lists.items():
        qp = int(p["q_pos"][t])
        seen = (positions >= 0) & (qp >= 0)
        if causal:
            seen &= positions <= qp
        if window > 0:
            seen &= qp - positions < window
        if not seen.any():
            continue
        for h in range(HQ):
            keys, values = k[slots[seen], h // (HQ // HKV)], v[slots[seen], h // (HQ // HKV)]
            weights = torch.softmax(keys @ p["q"][t, h].double() * scale, dim=0)
            out[t, h] = weights @ values
    return out


def run_native(p: dict, scale: float, causal: bool, window: int) -> torch.Tensor:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from pipeline.kernels import native

    native.load()
    int8 = p["scales"] is not None

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, ks, vs, q_pos, one, block_q, block, out_rows):
            if int8:
                return torch.ops.kvcache.sdpa_gather_q8(q, k, ks, v, vs, q_pos, one, block_q, block, out_rows, scale,
                                                        causal, window)
            return torch.ops.kvcache.sdpa_gather(q, k, v, q_pos, one, block_q, block, out_rows, scale, causal, window)

    scales = p["scales"] or [torch.zeros(1), torch.zeros(1)]
    args = (p["q"], p["k"], p["v"], *scales, p["q_pos"], p["one"], p["block_q"], p["block"], p["out_rows"])
    # as Backend.programs inlines it with kv.cpu_kernel=native: the tokens alone through the kernel, the block ATen
    exported = torch.export.export(Attend(), args).run_decompositions(native.DECOMPOSITIONS)
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()],
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    program = edge.to_executorch()
    kernel = "kvcache::sdpa_gather_alone_q8" if int8 else "kvcache::sdpa_gather_alone"
    assert kernel in {op.name for op in program.executorch_program.execution_plan[0].operators}
    buffer = program.buffer
    method = Runtime.get().load_program(buffer).load_method("forward")
    return method.execute(args)[0]


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("causal,window", [(True, 0), (True, 3), (False, 0)])
def test_native_gather_matches_float64(int8, causal, window):
    for seed in range(2):
        p = problem(seed, int8)
        want = oracle(p, 0.3, causal, window)
        got = run_native(p, 0.3, causal, window).double()
        assert (want != 0).any()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_native_gather_over_a_long_block(int8):
    """A prefill chunk as the server sends it: 37 tokens over a list of 50 keys (some slots listed twice), the
    chunk's tokens the list's last positions, beside two tokens alone."""
    p = problem(3, int8)
    g = torch.Generator().manual_seed(11)
    n_block, n_keys = 37, 50
    alone = p["one"][:2].clone()
    alone[0, 2], alone[1, 2] = 0, 1
    tokens = torch.arange(2, 2 + n_block)
    p["q"] = torch.randn(2 + n_block, HQ, D, generator=g)
    p["q_pos"] = torch.cat([torch.tensor([13, 5]), torch.arange(n_keys - n_block, n_keys)])
    p.update(one=alone, block_q=tokens, block=torch.stack([torch.randperm(SLOTS, generator=g).repeat(2)[:n_keys],
                                                           torch.arange(n_keys)]),
             out_rows=torch.arange(2 + n_block))
    for causal, window in [(True, 0), (True, 20)]:
        want = oracle(p, 0.2, causal, window)
        got = run_native(p, 0.2, causal, window).double()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()


def test_native_gather_with_an_empty_alone_group():
    p = problem(7, False, only_block=True)
    want = oracle(p, 0.25, True, 0)
    got = run_native(p, 0.25, True, 0).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
