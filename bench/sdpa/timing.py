"""Timing of the GPU benchmark: CUDA-graph replays over rotated K/V copies (far above L2)."""

import math

import torch

DEV = "cuda"
DT = torch.bfloat16
L2_BYTES = 50e6
GB = 1e9
MAX_KV_OURS = 60 * GB  # the largest K/V our kernel is timed on
MAX_KV_PEER = 30 * GB  # peers are skipped ('mem') where their padded / repeated K/V would pass this


def log(*a):
    print(*a, flush=True)


def time_fn(fns, reps=None, target_s=0.12):
    """fns: list of closures, one per rotated buffer.  Captured in one CUDA graph
    (all rotations); median of replays / len(fns) in microseconds.  A closure that cannot
    be captured raises: every figure of the table is a graph replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for f in fns:
                f()
    except Exception as e:  # not capturable: an error of the case, not a silent eager timing
        torch.cuda.synchronize()
        raise RuntimeError(f"CUDA-graph capture failed: {type(e).__name__}: {str(e)[:200]}") from e
    run = graph.replay
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    st.record()
    run()
    en.record()
    torch.cuda.synchronize()
    est = st.elapsed_time(en) / 1e3
    if reps is None:
        reps = int(max(5, min(40, target_s / max(est, 1e-6))))
    times = []
    for _ in range(reps):
        st.record()
        run()
        en.record()
        torch.cuda.synchronize()
        times.append(st.elapsed_time(en) * 1e3 / len(fns))
    times.sort()
    del graph
    return times[len(times) // 2]


def n_rot(kv_bytes):
    return int(max(1, min(32, math.ceil(3 * L2_BYTES / max(kv_bytes, 1)))))
