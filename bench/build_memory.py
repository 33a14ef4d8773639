"""Peak resident memory of whole builds against the estimate the config check holds them to.

Each config is built from scratch in a fresh process (no budget: memory_budget_gb=1e6); its peak
RSS (the kernel's ru_maxrss for that process) is printed next to ``feasibility.memory_estimate``,
whose coefficients this benchmark is for: the estimate must stay above every measured peak.

    python bench/build_memory.py [--quick] [extra overrides ...]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402

CONFIGS = [
    (),
    ("kv.max_seqs=8", "kv.capacity=32768"),
    ("kv.capacity=262144",),
    ("kv=cell", "kv.max_seqs=4", "kv.capacity=262144"),
    ("kv.max_seqs=8", "kv.capacity=131072"),
    ("model=smollm2_135m", "kv.max_seqs=4"),  # the real model: the weights' term (about 6 minutes)
]


def estimate(overrides) -> dict:
    from hydra import compose, initialize_config_dir

    from pipeline.build.plan import plan_of
    from pipeline.config import register

    register()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent.parent / "conf"), version_base="1.3"):
        plan = plan_of(compose("config", overrides=list(overrides)), list(overrides))
    return plan.memory


def peak_rss(overrides) -> tuple[float, float]:
    """(peak RSS in bytes, wall seconds) of one from-scratch build."""
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "pipeline", f"output_root={root}", "memory_budget_gb=1e6", *overrides],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"build {' '.join(overrides)} failed:\n{proc.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss * 1024, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the first two configs only")
    parser.add_argument("overrides", nargs="*", help="added to every config")
    args = parser.parse_args()
    configs = CONFIGS[:2] if args.quick else CONFIGS
    rows = []
    for overrides in configs:
        overrides = (*overrides, *args.overrides)
        est = estimate(overrides)
        peak, wall = peak_rss(overrides)
        rows.append((" ".join(overrides) or "(default)", est["kv"] / 1e6, est["peak"] / 1e9, peak / 1e9, peak / est["peak"], wall))
        print(f"{rows[-1][0]}: KV {rows[-1][1]:.0f} MB, estimate {rows[-1][2]:.2f} GB, peak {rows[-1][3]:.2f} GB, "
              f"{rows[-1][5]:.0f} s", flush=True)
    table = "| config | KV stores | estimated peak | measured peak | measured / estimate | build wall |\n|---|---|---|---|---|---|\n"
    table += "".join(f"| `{c}` | {kv:.0f} MB | {e:.2f} GB | {p:.2f} GB | {r:.2f} | {w:.0f} s |\n" for c, kv, e, p, r, w in rows)
    print(table)
    cmd = "python bench/build_memory.py" + (" --quick" if args.quick else "") + "".join(f" {o}" for o in args.overrides)
    write_section("build_memory", f"## Build peak memory against the config check's estimate (CPU)\n\n"
                  f"`{cmd}` on {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}: every stage of a from-scratch "
                  f"build (validate included), peak RSS of the build process. `pipeline/feasibility.py` refuses a "
                  f"config whose estimate exceeds `memory_budget_gb` (default: this machine's memory); the ratio must "
                  f"stay below 1.\n\n{table}")


if __name__ == "__main__":
    main()
