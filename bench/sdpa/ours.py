"""Our kernel's calls as the benchmark times them: one layer's attention along a plan computed
once (a lowered model plans once per step and layer kind), the plan alone, and an earlier
version of the kernel on the same inputs (``--compare``)."""

import dataclasses
import inspect
import math

from bench.sdpa.timing import n_rot, time_fn
from pipeline.kernels import sdpa_varlen as K


def ours_calls(w, mod=None, tuning=None, inputs=None):
    """One layer's attention calls on w (one per rotated K/V copy) along a plan computed once,
    the plan call itself, and that plan.  mod: an earlier version (--compare); inputs: w's
    (``w.ours_inputs``), when already built."""
    q, kvs, q_pos, q_cols, seq_info, cols = inputs or w.ours_inputs(n_rot(w.kv_read))
    scale = 1 / math.sqrt(w.d)
    if mod is None:
        geo = K.geometry_of(q, kvs[0][0], kvs[0][1], cols, tuning)
        plan_impl, attend_impl, pre = K.plan_impl, K.attend_impl, ()
    else:
        geo = mod._geometry_of(q, kvs[0][0], kvs[0][1], cols)
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


def plan_only(w, tuning=None, plan_impl=None, **geo_changes):
    """The plan call alone on w's inputs (``plan_impl``: an earlier version's; ``geo_changes``:
    fields of the geometry replaced for it)."""
    q, kvs, q_pos, q_cols, seq_info, cols = w.ours_inputs(1)
    geo = dataclasses.replace(K.geometry_of(q, kvs[0][0], kvs[0][1], cols, tuning), **geo_changes)
    plan_impl = plan_impl or K.plan_impl
    return lambda: plan_impl(q_pos, q_cols, seq_info, cols, w.causal, w.window, geo)


def plan_times(w, tuning=None, prev_plan=None, prev_warps=8):
    """The plan alone, side by side: ours per launch of PLAN_REPS in one graph, ours as the one
    launch of a graph (the graph's launch included), and (prev_plan) an earlier plan kernel
    both ways on ``prev_warps`` warps.  Each timed twice, alternating; the lower of each kept."""
    calls = {"ours": plan_only(w, tuning)}
    if prev_plan is not None:
        calls["prev"] = plan_only(w, tuning, prev_plan.plan_impl, plan_warps=prev_warps)
    best = {}
    for _ in range(2):
        for name, call in calls.items():
            for reps in (PLAN_REPS, 1):
                t = time_fn([call] * reps)
                best[name, reps] = min(best.get((name, reps), t), t)
    return best
