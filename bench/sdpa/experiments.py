"""The benchmark's experiments beside the table: the ``Tuning`` sweep (``--sweep``), the plan alone
(``--plan-compare``) and per-launch GPU times (``--profile``)."""

import dataclasses

import torch

from bench.sdpa.ours import PLAN_REPS, ours_calls, plan_only, plan_times, run_ours
from bench.sdpa.removed import REMOVED_AT, removed_paths_package
from bench.sdpa.timing import log, time_fn
from bench.sdpa.versions import load_module
from bench.sdpa.workloads import guard_cases, small_cases, sweep_cases, wave_cases
from pipeline.kernels import sdpa_varlen as K
from pipeline.kernels.sdpa_varlen import attention as K_attention

# A group that times the paths since removed from ours (off by default, no win measured: two launches,
# the merge launch, descriptor loads) loads the kernel package of bench/sdpa/removed.py's commit.
REMOVED_PATHS = "removed paths"
ADOPT_MARGIN = 0.02  # a variant displaces its group's first only if 2% faster on the mean of its cases
GUARD_MARGIN = 0.03  # ... and slows none of the guard cases (the other paths') by more than 3%

# the sweep: groups of variants of Tuning, each group on top of the winners of the groups before (each
# group's first variant is the running choice, the reference of its ratios).  A group with a package times
# that package (its own Tuning: the running choice's fields and the variant's); its winner is reported,
# never carried to the groups after (ours has no such field)
SWEEP = [
    ("launches", "all", [dict(split_launch=False), dict(split_launch=True),
                         dict(split_launch=True, dec_warps=2)], REMOVED_PATHS),
    ("decode tile", "dec", [dict(dec_block_n=128), dict(dec_block_n=64)], None),
    ("multi-token tile", "pre", [dict(pre_block_m=64, pre_warps=4), dict(pre_block_m=128, pre_warps=8)], None),
    ("multi-token splits", "pre", [dict(min_chunk_multi=2048), dict(min_chunk_multi=1024)], None),
    ("merge levels", "small", [dict(merge_group=8), dict(merge_group=0)], None),
    ("multi-token merge", "pre", [dict(merge_launch=False), dict(merge_launch=True, min_chunk_multi=2048),
                                  dict(merge_launch=True, min_chunk_multi=1024),
                                  dict(merge_launch=True, min_chunk_multi=512)], REMOVED_PATHS),
    ("multi-token pipeline", "pre", [dict(pre_stages=3), dict(pre_stages=4), dict(pre_stages=2)], None),
    ("split target", "dec", [dict(target_ctas=528), dict(target_ctas=264), dict(target_ctas=792)], None),
    ("decode pipeline", "dec", [dict(dec_stages=3), dict(dec_stages=4), dict(dec_stages=2)], None),
    ("long blocks", "pre", [dict(long_block_m=128), dict(long_block_m=0), dict(long_block_m=128, long_stages=4),
                            dict(long_block_m=128, long_block_n=128, long_stages=2)], None),
    ("item cap", "dec", [dict(item_cap=1.5), dict(item_cap=0.0), dict(item_cap=1.25), dict(item_cap=1.0)], None),
    ("descriptor loads", "all", [dict(tma_paths=0), dict(tma_paths=7), dict(tma_paths=6), dict(tma_paths=4)],
     REMOVED_PATHS),
    # issue 42: split sizes for one wave (fewer, longer items for small decodes), draft blocks' splits,
    # merge loads and tiles, the long (prefill) blocks' key tile
    ("one wave", "wave", [dict(target_ctas=264), dict(target_ctas=132), dict(target_ctas=132, min_chunk=512),
                          dict(target_ctas=66, min_chunk=1024), dict(target_ctas=66, min_chunk=1024, dec_stages=4),
                          dict(item_cap=1.25)], None),
    ("draft splits", "draft", [dict(min_chunk_multi=1024), dict(min_chunk_multi=2048), dict(merge_tile=16384),
                               dict(merge_group=4), dict(min_chunk_multi=512)], None),
    ("draft tile", "draft", [dict(pre_block_n=64), dict(pre_block_n=128, pre_stages=2), dict(pre_warps=8)], None),
    ("prefill tile", "prefill", [dict(long_block_n=64), dict(long_block_n=128, long_stages=2),
                                 dict(long_block_n=128, long_stages=3)], None),
    ("draft warps", "draft", [dict(noncausal_warps=8), dict(noncausal_warps=4),
                              dict(noncausal_warps=4, min_chunk_multi=1024), dict(min_chunk_multi=1024)], None),
    # issue 42, fourth session: split decode blocks merged by a launch of their own (the fused merge's ticket
    # and one-program merge ran ~8 µs at B=1, bench/sdpa/probe.py), its columns over 1, 4 or 8 programs
    ("decode merge", "wave", [dict(dec_merge_launch=True), dict(dec_merge_launch=False),
                              dict(dec_merge_split=8), dict(dec_merge_split=1)], None),
    ("plan warps", "plan", [dict(plan_lanes=4), dict(plan_lanes=2), dict(plan_lanes=1), dict(plan_lanes=1, plan_warps=16),
                            dict(plan_lanes=8)], None),
]


def load_variant(package):
    """The package a sweep group times: None (ours) or the kernel package with the removed paths."""
    return load_module(removed_paths_package(), "sdpa_varlen_variant") if package == REMOVED_PATHS else None


def _variant_tuning(mod, chosen, var):
    """The package's own Tuning: the running choice's fields it has, then the variant's."""
    fields = {f.name for f in dataclasses.fields(mod.Tuning)}
    return mod.Tuning(**{**{k: v for k, v in dataclasses.asdict(chosen).items() if k in fields}, **var})


def choose(totals: list[float], guards: list[dict[str, float]], n_cases: int) -> int:
    """The index of a group's winner among its variants (the first is the running choice): the lowest
    sum of time ratios to the first over the group's cases, a later variant only when it is below
    ``n_cases * (1 - ADOPT_MARGIN)`` (so a run's noise does not move the choice) and when it slows no
    guard case (µs per case, ``guards[i]``) by more than GUARD_MARGIN against the first: a knob that
    helps the group's path cannot be adopted at the cost of another path sharing its launch."""
    best = 0
    for i in range(1, len(totals)):
        slower = any(t > guards[0][name] * (1 + GUARD_MARGIN) for name, t in guards[i].items() if name in guards[0])
        missing = set(guards[0]) - set(guards[i])  # a guard case that failed under the variant
        if not slower and not missing and totals[i] < min(totals[best], n_cases * (1 - ADOPT_MARGIN)):
            best = i
    return best


def _time(w, which, mod, tuning) -> float:
    if which == "plan":  # the plan alone
        return time_fn([plan_only(w, tuning)] * PLAN_REPS)
    return run_ours(w, mod=mod, tuning=tuning)[0]


def _line(w, us) -> str:
    return f"{w.name}: {us:8.1f} us {w.bytes / us / 1e6:5.2f} TB/s {w.flops / us / 1e6:6.1f} TF"


def sweep(groups=None):
    """Each group's variants timed on its cases (decode; multi-token; all; "plan": the plan
    alone on all) and on the guard cases of the other paths (``guard_cases``), on top of the winners
    of the groups before; ``choose`` picks each group's winner."""
    dec_cases, pre_cases = sweep_cases()
    chosen = K.Tuning()
    lines = []
    for group, which, variants, package in SWEEP:
        if groups and group not in groups:
            continue
        cases = {"dec": dec_cases, "pre": pre_cases, "all": dec_cases + pre_cases, "plan": dec_cases + pre_cases,
                 "small": small_cases(), "wave": wave_cases(), "draft": pre_cases[:3], "prefill": pre_cases[3:]}[which]
        guards = [] if which == "plan" else [g for g in guard_cases() if g.name not in {w.name for w in cases}]
        mod = load_variant(package)
        tunings, totals, guard_us, ref = [], [], [], {}
        for var in variants:
            tuning = _variant_tuning(mod, chosen, var) if mod else dataclasses.replace(chosen, **var)
            line, tot, gus = [], 0.0, {}
            for w in cases + guards:
                try:
                    us = _time(w, which, mod, tuning)
                    if w in guards:
                        gus[w.name] = us
                        line.append("guard " + _line(w, us))
                    else:
                        tot += us / ref.setdefault(w.name, us)
                        line.append(_line(w, us))
                except Exception as e:  # noqa: BLE001  (the variant is out: reported, never chosen)
                    tot = tot if w in guards else float("inf")
                    line.append(f"{w.name}: err {type(e).__name__} {str(e)[:120]}")
                torch.cuda.empty_cache()
            tunings.append(tuning)
            totals.append(tot)
            guard_us.append(gus)
            where = f" ({package} of {REMOVED_AT})" if package else ""
            log(f"sweep {group}{where} {var}: sum of ratios {tot:.3f} | " + " | ".join(line))
            lines.append(f"| {group}{where} `{var}` | {tot:.3f} | " + "; ".join(x.replace("|", "/") for x in line) + " |")
        if mod is None and tunings:
            chosen = tunings[choose(totals, guard_us, len(cases))]
    log(f"fastest on the sweep cases: {chosen}; defaults: {K.Tuning()}")
    return chosen, K.Tuning(), lines


def plan_section(prev_path=None):
    """The plan alone on the sweep cases, ours beside an earlier version's (``--plan-compare``: a
    package directory or a one-file module, as ``--compare`` takes)."""
    prev = load_module(prev_path) if prev_path else None
    dec_cases, pre_cases = sweep_cases()
    head = "| case | ours µs (16 per graph) | ours µs (1 per graph) |" + (
        " prev µs (16 per graph) | prev µs (1 per graph) | prev/ours (16) |" if prev else "")
    lines = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for w in dec_cases + pre_cases:
        try:
            t = plan_times(w, prev=prev)
            cells = [t["ours", PLAN_REPS], t["ours", 1]]
            if prev:
                cells += [t["prev", PLAN_REPS], t["prev", 1]]
            line = f"| {w.name} | " + " | ".join(f"{c:.1f}" for c in cells) + (
                f" | {t['prev', PLAN_REPS] / t['ours', PLAN_REPS]:.2f}x |" if prev else " |")
        except Exception as e:  # noqa: BLE001
            line = f"| {w.name} | err {type(e).__name__}: {str(e)[:120]} |"
        log("plan " + line)
        lines.append(line)
        torch.cuda.empty_cache()
    return lines


def kernel_stats(fn) -> str:
    """Registers, spills and shared memory of each compiled specialisation of a Triton kernel."""
    seen = []
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for kern in cache.values():
            try:
                seen.append(f"{kern.n_regs} regs, {kern.n_spills} spills, {kern.metadata.shared} B shared")
            except Exception as e:  # noqa: BLE001  (attribute names differ between Triton versions)
                seen.append(f"stats n/a ({type(e).__name__})")
    return "; ".join(sorted(set(seen))) or "no compiled specialisation"


def profile():
    """Per-launch GPU time of one layer's attention (eager launches under torch.profiler,
    rotated K/V), next to the CUDA-graph time of the whole call: where the time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    dec_cases, pre_cases = sweep_cases()
    lines = []
    for w in dec_cases + pre_cases:
        try:
            fns, _, plan = ours_calls(w)
            graph_us = time_fn(fns)
            for f in fns:
                f()
            torch.cuda.synchronize()
            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    for f in fns:
                        f()
                torch.cuda.synchronize()
            kern = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA]
            period = len(kern) // (3 * len(fns))
            parts = []
            for i in range(period):
                ds = sorted(d for _, d in kern[i::period])
                parts.append(f"{kern[i][0][:24]} {ds[len(ds) // 2]:.1f}")
            hdr = plan[:6].tolist()
            line = (f"{w.name}: graph {graph_us:.1f} us = " + " + ".join(parts)
                    + f" (+ gaps) | plan: blocks {hdr[0]} items {hdr[1]} split blocks {hdr[2]} chunk {hdr[3]}")
        except Exception as e:  # noqa: BLE001
            line = f"{w.name}: profile failed: {type(e).__name__}: {str(e)[:160]}"
        log("profile " + line)
        lines.append(line)
        torch.cuda.empty_cache()
    lines.append("compiled attention kernel: " + kernel_stats(K_attention._sdpa_varlen_fwd))
    log("profile " + lines[-1])
    return lines
