"""CPU attention of the sequence layouts against a base revision's, side by side in one run.

Builds `kv=sequence kv.capacity=<C> kv.max_seqs=S` (tiny, XNNPACK, stages export..compile) from this
checkout and from a git worktree of each --base revision, then times decode steps of one token per
sequence through this checkout's Session on every artifact, interleaved, for every S and context
length. b29facf's step method reads every row of the store and writes the store out of place (a
copy of the whole store and a copy back per layer); 0f9b356 reads the rows the step's sequences hold
(`read_rows_<kind>`); this checkout also writes the stores in place (ExecuTorch's reinplace pass).
Artifacts of revisions before c7f1bb0 (manifest schema 2: other step buffers) are refused by this
checkout's Session: compare such revisions with `bench/attention_forms.py`, which drives each artifact
through its own revision's Session.

    python bench/cpu_attention.py [--base REV ...] [--capacity 1024] [--seqs 1 8] [--contexts 64 512]
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

from _results import REPO, checkout, write_section  # noqa: E402

warnings.filterwarnings("ignore")


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
    parser.add_argument("--base", nargs="+", default=["b29facf", "0f9b356"], help="revisions to compare with")
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
    sources = {**{rev: checkout(rev, root) for rev in args.base}, "this": REPO}
    versions = {(label, s): build(src, root / label, args.capacity, s) for label, src in sources.items() for s in args.seqs}
    results = {}
    for seqs in args.seqs:
        for context in args.contexts:
            runs = {label: [] for label in sources}
            for _ in range(args.rounds):
                for label in sources:
                    runs[label].append(measure(versions[label, seqs], seqs, context, args.steps)["method_tok_s"])
            results[seqs, context] = {label: statistics.median(v) for label, v in runs.items()}
            print(f"S={seqs} context={context}: " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in
                                                              results[seqs, context].items()), flush=True)
    first = args.base[0]
    labels = list(sources)
    lines = ["| S | context | " + " | ".join(f"{k} tok/s" for k in labels) + f" | this / {first} | "
             + " | ".join(f"{k} vs its S=1" for k in labels) + " |", "|---|---|" + "---|" * (2 * len(labels) + 1)]
    for (seqs, context), r in results.items():
        solo = results.get((1, context))
        vs = [f"{r[k] / solo[k]:.2f}x" if solo else "n/a" for k in labels]
        lines.append(f"| {seqs} | {context} | " + " | ".join(f"{r[k]:.0f}" for k in labels)
                     + f" | {r['this'] / r[first]:.2f}x | " + " | ".join(vs) + " |")
    table = "\n".join(lines)
    print(table)
    cmd = (f"python bench/cpu_attention.py --base {' '.join(args.base)} --capacity {args.capacity} --seqs "
           f"{' '.join(map(str, args.seqs))} --contexts {' '.join(map(str, args.contexts))}")
    section = "cpu_attention" if args.capacity == 1024 else f"cpu_attention_c{args.capacity}"  # one per capacity
    write_section(section, f"## CPU attention at kv.capacity={args.capacity}: rows read per step, tiny model, XNNPACK, CPU\n\n"
                  f"`{cmd}` on {torch_threads} CPU cores, {time.strftime('%Y-%m-%d')}: `kv.capacity={args.capacity}`, "
                  f"every sequence holds `context` tokens; decode tokens/s of the step method alone (one token per "
                  f"sequence), median of {args.steps} steps, median of {args.rounds} interleaved rounds; each column is "
                  f"the artifact built by that revision's code (see the script's docstring for what each "
                  f"changes).\n\n{table}")


if __name__ == "__main__":
    main()
