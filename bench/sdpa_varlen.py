"""Benchmark of the Triton ``sdpa_varlen`` kernels (plan + attention) on one CUDA GPU.

    PYTHONUNBUFFERED=1 python bench/sdpa_varlen.py [--quick] [--sweep] [--profile] [--out PATH]
                                                  [--compare OLD_MODULE.py|OLD_DIR] [--plan-compare [OLD_PLAN.py]]

Times (median over CUDA-graph replays, K/V rotated over several buffers so the working set
is far above L2) our kernel on the column store [rows * columns, Hkv, D] and, on the same
workload, PyTorch's ``F.scaled_dot_product_attention`` on padded contiguous [B, H, L, D]
tensors, ``torch.nn.attention.varlen.varlen_attn`` on packed K/V (KV heads repeated when the
installed torch has no ``enable_gqa``; packing not timed), FlexAttention with a block mask
(compiled; only on a few shapes: compile time) and ExecuTorch's Triton SDPA when importable.
Imports neither executorch's exporter nor hydra.  ``--compare`` times another version of
the kernel (a single-file module, e.g. ``git show 04d2c43:pipeline/kernels/sdpa_varlen.py >
old.py``, or a package directory: ``bench/sdpa/versions.py``) on the same inputs in the same run, a column beside ours.  ``--sweep`` times
variants of ``Tuning`` first (reported; the table uses the defaults).  ``--plan-compare``
times the plan alone (16 launches per graph and 1), beside an earlier ``plan.py`` if given.

Parts: ``bench/sdpa/timing.py`` (graph timing), ``workloads.py`` (cases), ``peers.py``,
``versions.py`` (earlier versions of the kernel, for ``--compare`` / ``--plan-compare``),
``report.py`` (the markdown, with the issue's goals marked met or not).
"""

import argparse
import dataclasses
import inspect
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.sdpa import peers, report  # noqa: E402
from bench.sdpa.timing import DEV, DT, GB, log, n_rot, time_fn  # noqa: E402
from bench.sdpa.versions import load_module, load_plan  # noqa: E402
from bench.sdpa.workloads import FLEX_CASES, Work, build_cases, small_cases, sweep_cases  # noqa: E402
from pipeline.kernels import sdpa_varlen as K  # noqa: E402
from pipeline.kernels.sdpa_varlen import attention as K_attention  # noqa: E402


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


def numerics(hq, hkv, d, n_keys, n_q, B):
    """Max abs error vs an fp32 reference (math SDPA on fp32): ours (bf16) and
    PyTorch's bf16 SDPA on the same data."""
    w = Work("num", hq, hkv, d, [(n_keys, n_q, (7 * i) % n_keys) for i in range(B)], causal=True)
    q, kvs, q_pos, q_cols, seq_info, cols = w.ours_inputs(1)
    k, v = kvs[0]
    scale = 1 / math.sqrt(d)
    out = K.sdpa_varlen_triton_impl(q, k, v, q_pos, q_cols, seq_info, cols, scale, True, 0)
    # padded views in key-position order
    kk = k.view(w.rows, cols, hkv, d)
    vv = v.view(w.rows, cols, hkv, d)
    rows_of = []
    for n, _, r0 in w.seqs:
        idx = [(r0 + j) % w.rows for j in range(n)]
        rows_of.append(idx)
    idx = torch.tensor(rows_of, device=DEV)  # [B, n]
    kp = kk[idx, torch.arange(cols, device=DEV)[:, None]].permute(0, 2, 1, 3)  # [B, hkv, n, d]
    vp = vv[idx, torch.arange(cols, device=DEV)[:, None]].permute(0, 2, 1, 3)
    qp = q.view(B, n_q, hq, d).permute(0, 2, 1, 3)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    rep = hq // hkv
    kf, vf = kp.float().repeat_interleave(rep, 1), vp.float().repeat_interleave(rep, 1)
    mask = causal_lower_right(n_q, n_keys) if n_q > 1 else None
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(qp.float(), kf, vf, attn_mask=mask)
    ours = out.view(B, n_q, hq, d).permute(0, 2, 1, 3).float()
    if n_q > 1:
        pt = F.scaled_dot_product_attention(qp, kp.repeat_interleave(rep, 1), vp.repeat_interleave(rep, 1), attn_mask=mask)
    else:
        pt = F.scaled_dot_product_attention(qp, kp, vp, enable_gqa=True)
    return (ours - ref).abs().max().item(), (pt.float() - ref).abs().max().item()



# the sweep: groups of variants of Tuning, each group on top of the winners of the groups before
# (each group's first variant is the running choice, the reference of its ratios)
SWEEP = [
    ("launches", "all", [dict(split_launch=False), dict(split_launch=True),
                         dict(split_launch=True, dec_warps=2)]),
    ("decode tile", "dec", [dict(dec_block_n=128), dict(dec_block_n=64)]),
    ("multi-token tile", "pre", [dict(pre_block_m=64, pre_warps=4), dict(pre_block_m=128, pre_warps=8)]),
    ("multi-token splits", "pre", [dict(min_chunk_multi=2048), dict(min_chunk_multi=1024)]),
    ("merge levels", "small", [dict(merge_group=8), dict(merge_group=0)]),
    ("multi-token merge", "pre", [dict(merge_launch=False, min_chunk_multi=2048), dict(merge_launch=True),
                                  dict(merge_launch=True, min_chunk_multi=1024),
                                  dict(merge_launch=True, min_chunk_multi=512)]),
    ("multi-token pipeline", "pre", [dict(pre_stages=3), dict(pre_stages=4), dict(pre_stages=2)]),
    ("split target", "dec", [dict(target_ctas=528), dict(target_ctas=264), dict(target_ctas=792)]),
    ("decode pipeline", "dec", [dict(dec_stages=3), dict(dec_stages=4), dict(dec_stages=2)]),
    ("long blocks", "pre", [dict(long_block_m=128), dict(long_block_m=0), dict(long_block_m=128, long_stages=4),
                            dict(long_block_m=128, long_block_n=128, long_stages=2)]),
    ("descriptor loads", "all", [dict(tma_paths=0), dict(tma_paths=7), dict(tma_paths=6), dict(tma_paths=4)]),
    ("plan warps", "plan", [dict(plan_lanes=4), dict(plan_lanes=2), dict(plan_lanes=1), dict(plan_lanes=1, plan_warps=16),
                            dict(plan_lanes=8)]),
]


def sweep(groups=None):
    """Each group's variants timed on its cases (decode; multi-token; all; "plan": the plan
    alone on all) on top of the winners of the groups before; the lowest sum of time ratios to
    the group's first wins."""
    dec_cases, pre_cases = sweep_cases()
    chosen = K.Tuning()
    lines = []
    for group, which, variants in SWEEP:
        if groups and group not in groups:
            continue
        cases = {"dec": dec_cases, "pre": pre_cases, "all": dec_cases + pre_cases, "plan": dec_cases + pre_cases,
                 "small": small_cases()}[which]
        best, best_t, ref = None, float("inf"), {}
        for var in variants:
            tuning = dataclasses.replace(chosen, **var)
            line, tot = [], 0.0
            for w in cases:
                try:
                    if which == "plan":  # the plan alone
                        us = time_fn([plan_only(w, tuning)] * PLAN_REPS)
                    else:
                        us = run_ours(w, tuning=tuning)[0]
                    tot += us / ref.setdefault(w.name, us)
                    line.append(f"{w.name}: {us:8.1f} us {w.bytes / us / 1e6:5.2f} TB/s {w.flops / us / 1e6:6.1f} TF")
                except Exception as e:  # noqa: BLE001  (the variant is out: reported, never chosen)
                    tot = float("inf")
                    line.append(f"{w.name}: err {type(e).__name__} {str(e)[:120]}")
                torch.cuda.empty_cache()
            log(f"sweep {group} {var}: sum of ratios {tot:.3f} | " + " | ".join(line))
            lines.append(f"| {group} `{var}` | {tot:.3f} | " + "; ".join(x.replace("|", "/") for x in line) + " |")
            if tot < best_t:
                best, best_t = tuning, tot
        chosen = best or chosen
    log(f"fastest on the sweep cases: {chosen}; defaults: {K.Tuning()}")
    return chosen, K.Tuning(), lines


def plan_section(prev_path=None):
    """The plan alone on the sweep cases, ours beside an earlier plan.py (``--plan-compare``)."""
    prev = load_plan(prev_path) if prev_path else None
    dec_cases, pre_cases = sweep_cases()
    head = "| case | ours µs (16 per graph) | ours µs (1 per graph) |" + (
        " prev µs (16 per graph) | prev µs (1 per graph) | prev/ours (16) |" if prev else "")
    lines = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for w in dec_cases + pre_cases:
        try:
            t = plan_times(w, prev_plan=prev)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a dozen cases (those of the issue's goals among them)")
    ap.add_argument("--out", default="docs/benchmarks_gpu_sdpa.md")
    ap.add_argument("--sweep", action="store_true", help="time Tuning variants first (reported; the table keeps the defaults)")
    ap.add_argument("--sweep-group", action="append", help="with --sweep: only this group (repeatable)")
    ap.add_argument("--sweep-only", action="store_true", help="with --sweep: no table after it")
    ap.add_argument("--adopt", action="store_true", help="with --sweep: time the table with the sweep's winner (the report says which)")
    ap.add_argument("--profile", action="store_true", help="per-launch GPU times of our kernel on the sweep cases")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--compare", help="another version of the kernel (a .py file or a package directory), timed beside ours")
    ap.add_argument("--plan-compare", nargs="?", const="", metavar="OLD_PLAN.py",
                    help="the plan alone on the sweep cases (16 and 1 launches per graph), beside an earlier plan.py if given")
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting new cases after this many seconds")
    args = ap.parse_args()
    t_start = time.time()
    torch.manual_seed(0)
    prop = torch.cuda.get_device_properties(0)
    log(f"GPU {prop.name}, {prop.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {__import__('triton').__version__}")

    # ceilings
    big = {"x": torch.randn(2 * 1024 ** 3, device=DEV, dtype=DT)}  # 4 GiB
    read_tbs = big["x"].numel() * 2 / time_fn([lambda: big["x"].sum()], reps=10) / 1e6
    big = {"a": torch.randn(8192, 8192, device=DEV, dtype=DT), "b": torch.randn(8192, 8192, device=DEV, dtype=DT)}
    mm_tf = 2 * 8192 ** 3 / time_fn([lambda: big["a"] @ big["b"]], reps=10) / 1e6
    big.clear()
    torch.cuda.empty_cache()
    log(f"read bandwidth (sum over 4 GiB bf16): {read_tbs:.2f} TB/s; bf16 matmul 8192^3: {mm_tf:.0f} TFLOP/s")

    prev = load_module(args.compare) if args.compare else None
    profile_lines = profile() if args.profile else []
    plan_lines = plan_section(args.plan_compare or None) if args.plan_compare is not None else []
    sweep_result = sweep(args.sweep_group) if args.sweep else None
    table_tuning = sweep_result[0] if (args.adopt and sweep_result) else K.Tuning()
    rows, skipped, num = [], [], []

    def write_report(final: bool = False) -> str:
        """The report so far, written after every row: a run cut short keeps what it measured."""
        text = report.markdown(cmd="PYTHONUNBUFFERED=1 python bench/sdpa_varlen.py " + " ".join(sys.argv[1:]), prop=prop,
                               read_tbs=read_tbs, mm_tf=mm_tf, rows=rows, num=num, compare=args.compare,
                               sweep=sweep_result, table_tuning=table_tuning, profile=profile_lines, plan=plan_lines, skipped=skipped,
                               budget_s=args.budget_s, wall_s=time.time() - t_start, final=final)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        return text

    cases = [] if args.sweep_only else build_cases(args.quick)
    log(f"{len(cases)} cases; ours timed with {table_tuning}")
    for kind, w in cases:
        t0 = time.time()
        name = f"{w.hq}/{w.hkv} D{w.d} {w.name}"
        if t0 - t_start > args.budget_s:
            skipped.append(name)
            continue
        try:
            ours, plan_us = run_ours(w, tuning=table_tuning)
        except Exception as e:  # noqa: BLE001  (the row says it failed; the run goes on)
            log(f"  ours failed on {w.name}: {type(e).__name__}: {e}")
            ours = plan_us = None
        torch.cuda.empty_cache()
        prev_us = None
        if prev is not None:
            try:  # on the same inputs, timed twice around a second time of ours: the two versions side by side
                inputs = w.ours_inputs(n_rot(w.kv_read))
                ours_fns, prev_fns = ours_calls(w, tuning=table_tuning, inputs=inputs)[0], ours_calls(w, prev, inputs=inputs)[0]
                prev_us = time_fn(prev_fns)
                ours = min(ours, time_fn(ours_fns)) if ours else ours
                prev_us = min(prev_us, time_fn(prev_fns))
                del inputs, ours_fns, prev_fns
            except Exception as e:  # noqa: BLE001
                log(f"  --compare failed on {w.name}: {type(e).__name__}: {e}")
            torch.cuda.empty_cache()
        found = {}
        for pname, fn in (("sdpa", peers.run_sdpa), ("varlen", peers.run_varlen), ("flex", peers.run_flex),
                          ("et", peers.run_et)):
            if pname == "flex" and (name not in FLEX_CASES or args.no_flex):
                found[pname] = (None, "not run")
                continue
            if kind == "wrap":
                found[pname] = (None, "= uniform")
                continue
            try:
                found[pname] = fn(w)
            except Exception as e:  # noqa: BLE001
                found[pname] = (None, f"err {type(e).__name__}")
                log(f"  {pname} failed on {w.name}: {type(e).__name__}: {str(e)[:200]}")
            torch.cuda.empty_cache()
        row = dict(kind=kind, name=name, kv=w.kv_read / GB, ours=ours, plan=plan_us, prev=prev_us,
                   tbs=w.bytes / ours / 1e6 if ours else None, tf=w.flops / ours / 1e6 if ours else None, peers=found)
        rows.append(row)
        ps = "  ".join(f"{k}={report.fmt(v[0])}{'(' + v[1] + ')' if v[1] else ''}" for k, v in found.items())
        log(f"[{time.time() - t_start:6.1f}s] {name}: KV {row['kv']:.3f} GB  ours {report.fmt(ours)} us"
            f" (+ plan {report.fmt(plan_us)} us per step)" + (f" prev {report.fmt(prev_us)} us" if prev is not None else "")
            + f"  {row['tbs'] or 0:.2f} TB/s  {row['tf'] or 0:.1f} TFLOP/s | {ps}  ({time.time() - t0:.1f}s)")
        write_report()

    log("numerics ...")
    for hq, hkv, d, n, nq, b in [(32, 8, 128, 8192, 1, 4), (32, 8, 128, 2048, 512, 1), (16, 2, 256, 4096, 16, 2)]:
        try:
            eo, ep = numerics(hq, hkv, d, n, nq, b)
            num.append((f"{hq}/{hkv} D{d} B={b} keys={n} q/seq={nq}", eo, ep))
            log(f"  {num[-1]}")
        except Exception as e:  # noqa: BLE001
            log(f"  numerics failed: {type(e).__name__}: {e}")

    log(write_report(True))


if __name__ == "__main__":
    main()
