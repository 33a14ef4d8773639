"""Benchmark of the Triton ``sdpa_varlen`` kernels (plan + attention) on one CUDA GPU.

    PYTHONUNBUFFERED=1 python bench/sdpa_varlen.py [--quick] [--sweep] [--profile] [--out PATH]
                                                  [--compare OLD_MODULE.py|OLD_DIR] [--plan-compare [OLD]]
                                                  [--step | --step-only] [--layers 16 32] [--step-flex CASE ...]

Times (median over CUDA-graph replays, K/V rotated over several buffers so the working set
is far above L2) our kernel on the column store [rows * columns, Hkv, D] and, on the same
workload, PyTorch's ``F.scaled_dot_product_attention`` on padded contiguous [B, H, L, D]
tensors, ``torch.nn.attention.varlen.varlen_attn`` on packed K/V (KV heads repeated when the
installed torch has no ``enable_gqa``; packing not timed), FlexAttention with a block mask
(compiled; only on a few shapes: compile time) and ExecuTorch's Triton SDPA when importable.
Imports neither executorch's exporter nor hydra.  ``--compare`` times another version of
the kernel (a single-file module, e.g. ``git show 04d2c43:pipeline/kernels/sdpa_varlen.py >
old.py``, or a package directory: ``bench/sdpa/versions.py``) on the same inputs in the same run, a column beside ours.  ``--sweep`` times
variants of ``Tuning`` first (reported; the table uses the defaults); its groups for the paths removed
from ours (two launches, the merge launch, descriptor loads) time the package that still has them
(``bench/sdpa/removed.py``: e06a1ce's, from git history).  ``--plan-compare`` times the plan alone (16
launches per graph and 1), beside an earlier version's (what ``--compare`` takes) if given.
``--step`` then times a model's decode step (``bench/sdpa/step.py``): the plan once + L attends
(``--layers``), beside each peer's L calls with its per-step setup, each step one CUDA graph, in the
same time budget; ``--step-only`` skips the per-call table.

Parts: ``bench/sdpa/timing.py`` (graph timing), ``workloads.py`` (cases), ``ours.py`` (our
calls as timed), ``peers.py``, ``versions.py`` (earlier versions of the kernel, for ``--compare`` /
``--plan-compare``, and the sweep's variants), ``experiments.py`` (sweep, plan alone, profile),
``step.py`` (the model-level step), ``report.py`` (the markdown, with the issue's goals marked met or not).
"""

import argparse
import math
import os
import shlex
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.sdpa import peers, report  # noqa: E402
from bench.sdpa.experiments import plan_section, profile, sweep  # noqa: E402
from bench.sdpa.ours import ours_calls, run_ours  # noqa: E402
from bench.sdpa.step import LAYERS, STEP_FLEX, case_name, row_line, run_case, step_cases  # noqa: E402
from bench.sdpa.timing import DEV, DT, GB, log, n_rot, time_fn  # noqa: E402
from bench.sdpa.versions import load_module  # noqa: E402
from bench.sdpa.workloads import FLEX_CASES, Work, build_cases  # noqa: E402
from pipeline.kernels import sdpa_varlen as K  # noqa: E402


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



def step_table(args, step: dict, tuning: K.Tuning, t_start: float, write_report) -> None:
    """The model-level step table: every case started within the budget, its rows (one per L) logged
    and the report rewritten after each; the cases not started are listed as not run."""
    layers = tuple(args.layers)
    log(f"step table: L in {layers}, Flex on {sorted(step['flex']) or 'none'}")
    for kind, w in step_cases():
        name, t0 = case_name(w), time.time()
        if t0 - t_start > args.budget_s:
            step["skipped"].append(name)
            continue
        for r in run_case(kind, w, layers, flex=name in step["flex"] or w.name in step["flex"], tuning=tuning,
                          prior=step["rows"]):
            step["rows"].append(r)
            log(f"[{time.time() - t_start:6.1f}s] {row_line(r)}  ({time.time() - t0:.1f}s)")
            write_report()


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
    ap.add_argument("--plan-compare", nargs="?", const="", metavar="OLD",
                    help="the plan alone on the sweep cases (16 and 1 launches per graph), beside an earlier version's "
                         "(a .py file or a package directory, as --compare) if given")
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting new cases after this many seconds")
    ap.add_argument("--step", action="store_true", help="after the per-call table: the model-level step table (plan once + L attends)")
    ap.add_argument("--step-only", action="store_true", help="the step table alone (no per-call table or numerics)")
    ap.add_argument("--layers", type=int, nargs="+", default=list(LAYERS), help="with --step: the layers per step (default 16 32)")
    ap.add_argument("--step-flex", nargs="*", default=list(STEP_FLEX), metavar="CASE",
                    help="with --step: the cases Flex is timed on (a compile per shape; --no-flex: none)")
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
    step = dict(rows=[], skipped=[], flex=set() if args.no_flex else set(args.step_flex)) if args.step or args.step_only else None

    history = report.kept_history(args.out)  # the file's sections after its report (earlier sweeps, tuning history)

    def write_report(final: bool = False) -> str:
        """The report so far, written after every row: a run cut short keeps what it measured."""
        text = report.markdown(cmd="PYTHONUNBUFFERED=1 python bench/sdpa_varlen.py " + shlex.join(sys.argv[1:]), prop=prop,
                               read_tbs=read_tbs, mm_tf=mm_tf, rows=rows, num=num, compare=args.compare,
                               sweep=sweep_result, table_tuning=table_tuning, profile=profile_lines, plan=plan_lines, skipped=skipped,
                               budget_s=args.budget_s, wall_s=time.time() - t_start, final=final, step=step,
                               per_call=not args.step_only)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + history)
        return text

    cases = [] if args.sweep_only or args.step_only else build_cases(args.quick)
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
    for hq, hkv, d, n, nq, b in [] if args.step_only else [(32, 8, 128, 8192, 1, 4), (32, 8, 128, 2048, 512, 1), (16, 2, 256, 4096, 16, 2)]:
        try:
            eo, ep = numerics(hq, hkv, d, n, nq, b)
            num.append((f"{hq}/{hkv} D{d} B={b} keys={n} q/seq={nq}", eo, ep))
            log(f"  {num[-1]}")
        except Exception as e:  # noqa: BLE001
            log(f"  numerics failed: {type(e).__name__}: {e}")

    if step is not None:
        step_table(args, step, table_tuning, t_start, write_report)
    log(write_report(True))


if __name__ == "__main__":
    main()
