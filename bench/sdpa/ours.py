"""Our kernel's calls as the benchmark times them: one layer's attention along a plan computed
once (a lowered model plans once per step and layer kind), the plan alone, and another version
of the kernel on the same inputs (``--compare``, the sweep's variants)."""

import inspect
import math

from bench.sdpa.timing import n_rot, time_fn
from pipeline.kernels import sdpa_varlen as K


def ours_calls(w, mod=None, tuning=None, inputs=None):
    """One layer's attention calls on w (one per rotated K/V copy) along a plan computed once,
    the plan call itself, and that plan.  mod: another version (``versions.load_module``; tuning: its
    own ``Tuning``, or None for its defaults); inputs: w's (``w.ours_inputs``), when already built."""
    q, kvs, q_pos, q_cols, seq_info, cols = inputs or w.ours_inputs(n_rot(w.kv_read))
    scale = 1 / math.sqrt(w.d)
    if mod is None:
        geo = K.geometry_of(q, kvs[0][0], kvs[0][1], cols, tuning)
        plan_impl, attend_impl, pre = K.plan_impl, K.attend_impl, ()
    else:
        k0, v0 = kvs[0]  # a one-file version's _geometry_of takes no tuning
        geo = mod._geometry_of(q, k0, v0, cols) if tuning is None else mod._geometry_of(q, k0, v0, cols, tuning)
        plan_impl, attend_impl = mod.plan_impl, mod.attend_impl
        pre = (q_pos,) if "q_pos" in inspect.signature(mod.attend_impl).parameters else ()  # earlier versions took it

    def plan_call():
        return plan_impl(q_pos, q_cols, seq_info, cols, w.causal, w.window, geo)

    plan = plan_call()
    fns = [lambda k=k, v=v: attend_impl(q, k, v, *pre, plan, cols, scale, w.causal, w.window, geo) for k, v in kvs]
    return fns, plan_call, plan


PLAN_REPS = 16  # plan launches per graph for its in-graph time


def run_ours(w, mod=None, tuning=None):
    """(µs per layer: attention along a plan computed once, µs of the plan alone).  A lowered
    model plans once per step and layer kind; every layer of the kind reuses it.  The plan's
    time is per launch of PLAN_REPS in one graph: what it adds to a step's graph (its kernel and
    the gap to the next), as the attention's is over its rotations."""
    fns, plan_call, _ = ours_calls(w, mod, tuning)
    return time_fn(fns), time_fn([plan_call] * PLAN_REPS)


def plan_only(w, tuning=None, mod=None):
    """The plan call alone on w's inputs (``mod``: another version, with its own geometry)."""
    q, kvs, q_pos, q_cols, seq_info, cols = w.ours_inputs(1)
    if mod is None:
        geo, plan_impl = K.geometry_of(q, kvs[0][0], kvs[0][1], cols, tuning), K.plan_impl
    else:
        geo, plan_impl = mod._geometry_of(q, kvs[0][0], kvs[0][1], cols), mod.plan_impl
    return lambda: plan_impl(q_pos, q_cols, seq_info, cols, w.causal, w.window, geo)


def plan_times(w, tuning=None, prev=None):
    """The plan alone, side by side: ours per launch of PLAN_REPS in one graph, ours as the one
    launch of a graph (the graph's launch included), and (prev) an earlier version's plan both
    ways, under its own defaults.  Each timed twice, alternating; the lower of each kept."""
    calls = {"ours": plan_only(w, tuning)}
    if prev is not None:
        calls["prev"] = plan_only(w, mod=prev)
    best = {}
    for _ in range(2):
        for name, call in calls.items():
            for reps in (PLAN_REPS, 1):
                t = time_fn([call] * reps)
                best[name, reps] = min(best.get((name, reps), t), t)
    return best
