"""Build the default config from scratch, in a fresh process per run, and print per-stage wall time.

    python bench/build_time.py [--runs 1] [overrides ...]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as root:
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "pipeline", f"output_root={root}", *args.overrides],
                           check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True)
            wall = time.perf_counter() - start
            record = json.loads(next(Path(root).glob("*/v0001/build.json")).read_text())
        rows.append({**record["stage_seconds"], "stages total": record["total_seconds"], "process wall": wall})
        print(f"run {run + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in rows[-1].items()))
    keys = list(rows[0])
    table = "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n"
    table += "| " + " | ".join(f"{statistics.median(r[k] for r in rows):.1f} s" for k in keys) + " |\n"
    print(table)
    cmd = "python bench/build_time.py " + " ".join([f"--runs {args.runs}", *args.overrides])
    write_section("build_time", f"## Default build, per-stage wall time (CPU)\n\n"
                  f"`{cmd}` on {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}; median of {args.runs} "
                  f"from-scratch builds (process wall includes Python and library imports).\n\n{table}")


if __name__ == "__main__":
    main()
