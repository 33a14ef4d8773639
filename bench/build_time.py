"""Build the default config from scratch, in a fresh process per run, and print per-stage wall time.

With --base REV the same build also runs from a git worktree of REV, alternating with this
checkout's, so the two are measured side by side on the same machine in one run; the table then
gives each side's median, the ratio, and the backend partitions of each method (from the
compile stage's log).

    python bench/build_time.py [--runs 1] [--base 980406c] [overrides ...]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import REPO, checkout, write_section  # noqa: E402

PARTITIONS = re.compile(r"^\s+(\w+): (\d+) \w+ partitions?$", re.M)


def one_build(src: Path, overrides: list[str]) -> tuple[dict, dict]:
    """Per-stage seconds (and process wall) of one from-scratch build in ``src``'s code, and the
    partitions of each method."""
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pipeline", f"output_root={root}", *overrides], cwd=src,
                              check=True, env={**os.environ, "PYTHONPATH": str(src), "PYTHONWARNINGS": "ignore"},
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        record = json.loads(next(Path(root).glob("*/v0001/build.json")).read_text())
    times = {**record["stage_seconds"], "stages total": record["total_seconds"], "process wall": wall}
    return times, {m: int(n) for m, n in PARTITIONS.findall(done.stdout + done.stderr)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--base", help="a revision to build side by side with this checkout")
    parser.add_argument("--worktrees", default="/tmp/build_time", help="where the --base worktree goes")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    sources = {"this": REPO}
    if args.base:
        sources = {args.base: checkout(args.base, Path(args.worktrees)), "this": REPO}
    rows = {label: [] for label in sources}
    partitions = {}
    for run in range(args.runs):
        for label, src in sources.items():
            times, partitions[label] = one_build(src, args.overrides)
            rows[label].append(times)
            print(f"run {run + 1} {label}: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()), flush=True)
    keys = list(dict.fromkeys(k for runs in rows.values() for r in runs for k in r))  # a revision may lack a stage
    median = {label: {k: statistics.median(r[k] for r in runs) for k in keys if k in runs[0]}
              for label, runs in rows.items()}
    lines = ["| build | " + " | ".join(keys) + " | partitions per method |", "|---|" + "---|" * (len(keys) + 1)]
    for label in sources:
        parts = ", ".join(f"{m} {n}" for m, n in partitions[label].items())
        lines.append(f"| {label} | " + " | ".join(f"{median[label][k]:.1f} s" if k in median[label] else "—" for k in keys) + f" | {parts} |")
    if args.base:
        def ratio(k):
            both = median["this"].get(k) is not None and median[args.base].get(k)
            return f"{median['this'][k] / median[args.base][k]:.2f}x" if both else "—"

        lines.append("| this / base | " + " | ".join(ratio(k) for k in keys) + " | |")
    table = "\n".join(lines)
    print(table)
    cmd = " ".join(["python bench/build_time.py", f"--runs {args.runs}", *([f"--base {args.base}"] if args.base else []),
                    *args.overrides])
    side = (f", alternating with builds of {args.base} (a git worktree) on the same machine" if args.base else "")
    write_section("build_time", f"## Default build, per-stage wall time (CPU)\n\n"
                  f"`{cmd}` on {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}; median of {args.runs} "
                  f"from-scratch builds{side} (process wall includes Python and library imports).\n\n{table}")


if __name__ == "__main__":
    main()
