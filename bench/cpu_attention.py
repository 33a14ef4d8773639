"""CPU attention of the sequence layouts against a base revision's, side by side in one run.

Builds `kv=sequence kv.capacity=<C> kv.max_seqs=S` (tiny, XNNPACK, stages export..compile) from this
checkout and from a git worktree of --base, then times decode steps of one token per sequence through
this checkout's Session on both artifacts, interleaved, for every S and context length. The base
artifact's step method reads every row of the store; this one reads the rows the step's sequences
hold (`read_rows_<kind>`), so its cost per sequence follows the context, not the capacity.

    python bench/cpu_attention.py [--base REV] [--capacity 1024] [--seqs 1 8] [--contexts 64 512]
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_throughput import measure  # noqa: E402

from _results import write_section  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
warnings.filterwarnings("ignore")


def checkout(rev: str, root: Path) -> Path:
    src = root / f"src-{rev}"
    if not src.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(src), rev], check=True,
                       capture_output=True)
    return src


def build(src: Path, out: Path, capacity: int, seqs: int) -> Path:
    """The newest complete version of the config, built in ``src``'s code (reused when present)."""
    exp = out / f"s{seqs}"
    done = sorted(p.parent for p in exp.glob("v*/manifest.json")) if exp.exists() else []
    if not done:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pipeline", f"kv.capacity={capacity}", f"kv.max_seqs={seqs}",
                        "stages=[export,lower_kv,compile]", f"output_root={out}", f"experiment_name=s{seqs}"],
                       cwd=src, env={**os.environ, "PYTHONPATH": str(src), "PYTHONWARNINGS": "ignore"}, check=True,
                       capture_output=True)
        print(f"built {exp} from {src} in {time.perf_counter() - t0:.0f} s", flush=True)
        done = sorted(p.parent for p in exp.glob("v*/manifest.json"))
    return done[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="b29facf", help="the revision to compare with (default: before read_rows)")
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each pair; the median is kept")
    parser.add_argument("--root", default="/tmp/cpu_attention")
    args = parser.parse_args()
    torch_threads = os.cpu_count() or 1
    import torch

    torch.set_num_threads(torch_threads)
    root = Path(args.root)
    sources = {"base": checkout(args.base, root), "this": REPO}
    versions = {(label, s): build(src, root / label, args.capacity, s) for label, src in sources.items() for s in args.seqs}
    results = {}
    for seqs in args.seqs:
        for context in args.contexts:
            runs = {label: [] for label in sources}
            for _ in range(args.rounds):
                for label in sources:
                    runs[label].append(measure(versions[label, seqs], seqs, context, args.steps)["method_tok_s"])
            results[seqs, context] = {label: statistics.median(v) for label, v in runs.items()}
            r = results[seqs, context]
            print(f"S={seqs} context={context}: base {r['base']:.0f} tok/s, this {r['this']:.0f} tok/s "
                  f"({r['this'] / r['base']:.2f}x)", flush=True)
    lines = ["| S | context | base tok/s | this tok/s | this / base | this vs its S=1 | base vs its S=1 |",
             "|---|---|---|---|---|---|---|"]
    for (seqs, context), r in results.items():
        solo = results.get((1, context))
        vs = (lambda k: f"{r[k] / solo[k]:.2f}x") if solo else (lambda k: "n/a")
        lines.append(f"| {seqs} | {context} | {r['base']:.0f} | {r['this']:.0f} | {r['this'] / r['base']:.2f}x "
                     f"| {vs('this')} | {vs('base')} |")
    table = "\n".join(lines)
    print(table)
    cmd = (f"python bench/cpu_attention.py --base {args.base} --capacity {args.capacity} --seqs "
           f"{' '.join(map(str, args.seqs))} --contexts {' '.join(map(str, args.contexts))}")
    write_section("cpu_attention", f"## CPU attention: rows read per step, tiny model, XNNPACK, CPU\n\n"
                  f"`{cmd}` on {torch_threads} CPU cores, {time.strftime('%Y-%m-%d')}: `kv.capacity={args.capacity}`, "
                  f"every sequence holds `context` tokens; decode tokens/s of the step method alone (one token per "
                  f"sequence), median of {args.steps} steps, median of {args.rounds} interleaved rounds. `base` is "
                  f"{args.base}'s artifact (its attention reads all {args.capacity} rows of every query's column), "
                  f"`this` reads the rows its sequences hold.\n\n{table}")


if __name__ == "__main__":
    main()
