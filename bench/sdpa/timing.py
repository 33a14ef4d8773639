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


def graph_of(fns) -> "torch.cuda.CUDAGraph":
    """fns (closures, one per rotated buffer) run twice on a side stream, then captured in one CUDA graph.
    A closure that cannot be captured raises: every figure of the benchmark is a graph replay."""
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
    return graph


def time_fn(fns, reps=None, target_s=0.12):
    """fns: list of closures, one per rotated buffer.  Captured in one CUDA graph
    (all rotations); median of replays / len(fns) in microseconds."""
    graph = graph_of(fns)
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


def kernel_timeline(fns, replays: int = 8) -> list[tuple[str, int, float, float]]:
    """The kernels of fns' CUDA graph (as ``time_fn`` captures it), replayed under torch.profiler (CUPTI records
    a graph's kernels one by one): per kernel name, (name, launches per call, median duration µs, median gap µs
    from the end of the kernel before it in the graph; the first kernel of a replay has none)."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    graph = graph_of(fns)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    events = sorted((e.start_ns(), e.duration_ns(), e.name()) for e in prof.profiler.kineto_results.events()
                    if e.device_type() == DeviceType.CUDA and not e.name().lower().startswith(("memcpy", "memset")))
    per_replay, extra = divmod(len(events), replays)
    if not per_replay or extra:
        raise RuntimeError(f"kernel timeline: {len(events)} kernel events over {replays} replays (CUPTI did not "
                           "record the graph's kernels one by one)")
    durations: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    for i, (start, dur, name) in enumerate(events):
        durations.setdefault(name, []).append(dur / 1e3)
        if i % per_replay:
            prev_start, prev_dur, _ = events[i - 1]
            gaps.setdefault(name, []).append((start - prev_start - prev_dur) / 1e3)
    graph.reset()

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2] if xs else math.nan

    return [(name, len(d) // (replays * len(fns)), median(d), median(gaps.get(name, [])))
            for name, d in durations.items()]
