"""How fast the build system answers: rejecting a bad value, a no-op rebuild against the full build,
and a sweep on 2 workers against the same jobs one after another. Every figure is the wall time of a
fresh `python -m pipeline` process (interpreter start and imports included), side by side in one run.

    python bench/build_system.py [--repeats 3] [--sweep kv=sequence,cell kv.max_seqs=1,2,4]
"""

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402

BAD = ("kv=foo", "model.dtype=int7", "kv.max_seqs=0", "backend=foo")


def pipeline(*args: str, check: bool = True) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - start
    if check and proc.returncode != 0:
        raise SystemExit(f"python -m pipeline {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return wall, proc


def sweep_rows(root: str) -> list[dict]:
    (summary,) = Path(root, "multirun").glob("*/summary.csv")
    with summary.open() as f:
        return list(csv.DictReader(f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", nargs="+", default=["kv=sequence,cell", "kv.max_seqs=1,2,4"])
    args = parser.parse_args()
    lines = ["| what | wall (median) | goal | met |", "|---|---|---|---|"]

    rejects = []
    for value in BAD:
        walls = []
        for _ in range(args.repeats):
            wall, proc = pipeline(value, check=False)
            assert proc.returncode == 2 and proc.stderr.startswith("error: "), (value, proc.stderr)
            walls.append(wall)
        rejects.append(statistics.median(walls))
        print(f"reject {value}: {rejects[-1]:.2f} s ({proc.stderr.strip()})")
    worst = max(rejects)
    lines.append(f"| rejecting a bad value (slowest of {', '.join(f'`{v}`' for v in BAD)}) | {worst:.2f} s | < 1 s | "
                 f"{'yes' if worst < 1 else 'no'} |")

    with tempfile.TemporaryDirectory() as root:
        full, _ = pipeline(f"output_root={root}")
        print(f"full default build: {full:.1f} s")
        noop = statistics.median(pipeline(f"output_root={root}")[0] for _ in range(args.repeats))
        print(f"no-op rebuild: {noop:.2f} s")
        validate_only, proc = pipeline(f"output_root={root}", "validate.decode_steps=30")
        assert "validate: building" in proc.stdout and "compile: cached" in proc.stdout
        print(f"validate.* changed (only validate reruns): {validate_only:.1f} s")
    lines.append(f"| default build from scratch | {full:.1f} s | | |")
    lines.append(f"| no-op rebuild of the default config (median of {args.repeats}) | {noop:.2f} s ({noop / full:.3f}x) | "
                 f"< 3 s | {'yes' if noop < 3 else 'no'} |")
    lines.append(f"| `validate.decode_steps` changed: validate alone reruns | {validate_only:.1f} s ({validate_only / full:.2f}x) | | |")

    walls = {}
    built_export = {}
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as root:
            wall, proc = pipeline("-m", f"output_root={root}", f"hydra.launcher.n_jobs={workers}", "measure_decode_steps=0",
                                  *args.sweep)
            rows = sweep_rows(root)
            assert len(rows) >= 2 and all(r["status"] == "ok" for r in rows), rows
            walls[workers] = wall
            built_export[workers] = sum("export" in r["stages_built"].split() for r in rows)
            print(f"sweep of {len(rows)} jobs on {workers} worker(s): {wall:.1f} s, export built {built_export[workers]}x")
    ratio = walls[2] / walls[1]
    jobs = len(rows)
    lines.append(f"| sweep of {jobs} jobs (`{' '.join(args.sweep)}`), one after another (n_jobs=1) | {walls[1]:.1f} s | | |")
    lines.append(f"| the same sweep on 2 workers (n_jobs=2) | {walls[2]:.1f} s ({ratio:.2f}x) | <= 0.7x | {'yes' if ratio <= 0.7 else 'no'} |")
    lines.append(f"| `export` built, per sweep | {built_export[1]}x / {built_export[2]}x | once | "
                 f"{'yes' if built_export[1] == built_export[2] == 1 else 'no'} |")
    table = "\n".join(lines)
    print(table)
    cmd = "python bench/build_system.py " + " ".join([f"--repeats {args.repeats}", "--sweep", *args.sweep])
    write_section("build_system", "## Build system: rejecting, no-op rebuilds, sweeps (CPU)\n\n"
                  f"`{cmd}` on {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}. Wall time of whole "
                  "`python -m pipeline` processes (interpreter start and imports included), side by side in one run; "
                  "the default config (tiny, XNNPACK), each sweep in a fresh output root and stage cache.\n\n" + table)


if __name__ == "__main__":
    main()
