"""The CPU attention's forms side by side on SmolLM2: decode and prefill steps of artifacts built by
different revisions, each driven by its own revision's ``Session`` (a child process with that checkout on
``PYTHONPATH``), in turn, in one run.

    python bench/attention_forms.py --runs 3b73f6f:/tmp/base/v0001 this:outputs/smollm2_q41_s8/v0001 \
        8e76d6d:/tmp/inplace/v0001

Each ``REV:ARTIFACT`` names a revision (``this``: the working tree) and an artifact built by it (the
artifacts must hold ``kv.max_seqs=8`` and at least 1,100 tokens a sequence). Per artifact: decode tokens/s
of S=1 and S=8 sequences at 64, 256 and 1,024 tokens of context (median of 12 steps), the prefill of a
770-token prompt alone in 64-token chunks (best of 2), and the same prompt while 7 sequences of 256 tokens
decode (7 decodes + 57 prompt tokens a step). Writes the "attention_forms" section of docs/benchmarks.md.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _results import REPO, RESULTS, checkout, write_section

# the child: times one artifact through the Session of the code on its PYTHONPATH
CHILD = r"""
import json, statistics, sys, time
import torch
from pipeline.runtime.session import Session

torch.set_num_threads(2)
s = Session(sys.argv[1])
gen = torch.Generator().manual_seed(0)
tokens = lambda n: torch.randint(100, 40000, (n,), generator=gen).tolist()
out = {}

def prefill(seq, ids, chunk=64):
    for i in range(0, len(ids), chunk):
        s.step({seq: ids[i:i + chunk]})

for ctx in (64, 256, 1024):
    for n in (1, 8):
        for q in range(n):
            s.add(q)
            prefill(q, tokens(ctx))
        times = []
        for _ in range(12):
            t = time.perf_counter()
            s.step({q: [5] for q in range(n)})
            times.append(time.perf_counter() - t)
        out[f"decode S={n} ctx={ctx}"] = n / statistics.median(times)
        for q in range(n):
            s.release(q)
best = 0.0
for _ in range(2):
    s.add(0)
    ids = tokens(770)
    t = time.perf_counter()
    prefill(0, ids)
    best = max(best, 770 / (time.perf_counter() - t))
    s.release(0)
out["prefill 770 alone"] = best
for q in range(1, 8):
    s.add(q)
    prefill(q, tokens(256))
s.add(0)
ids, i, steps = tokens(770), 0, []
t0 = time.perf_counter()
while i < len(ids):
    t = time.perf_counter()
    s.step({**{q: [5] for q in range(1, 8)}, 0: ids[i:i + 57]})
    steps.append(time.perf_counter() - t)
    i += 57
out["prefill 770 beside 7 decodes"] = 770 / (time.perf_counter() - t0)
out["mixed step ms"] = 1000 * statistics.median(steps)
print(json.dumps(out))
"""

ROWS = ["decode S=1 ctx=64", "decode S=8 ctx=64", "decode S=1 ctx=256", "decode S=8 ctx=256", "decode S=1 ctx=1024",
        "decode S=8 ctx=1024", "prefill 770 alone", "prefill 770 beside 7 decodes", "mixed step ms"]


def measure(source: Path, artifact: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(source), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", CHILD, artifact], cwd=source, env=env, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode:
        raise SystemExit(f"{artifact} through {source}'s Session failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[str, dict]) -> list[str]:
    labels = list(results)
    first = labels[0]
    lines = ["| measure | " + " | ".join(labels) + " | " + " | ".join(f"{k} / {first}" for k in labels[1:]) + " |",
             "|---|" + "---|" * (2 * len(labels) - 1)]
    for row in ROWS:
        unit = "ms" if row.endswith("ms") else "tok/s"
        values = [results[k][row] for k in labels]
        lines.append(f"| {row} ({unit}) | " + " | ".join(f"{v:.1f}" for v in values) + " | "
                     + " | ".join(f"{v / values[0]:.2f}x" for v in values[1:]) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="REV:ARTIFACT pairs; REV 'this' is the working tree")
    parser.add_argument("--root", default="/tmp/attention_forms", help="where the revisions are checked out")
    parser.add_argument("--out", type=Path, help="the file whose section is written (default: docs/benchmarks.md)")
    args = parser.parse_args()
    results = {}
    for run in args.runs:
        rev, artifact = run.split(":", 1)
        source = REPO if rev == "this" else checkout(rev, Path(args.root))
        results[rev] = measure(source, artifact)
        print(rev, json.dumps({k: round(v, 1) for k, v in results[rev].items()}), flush=True)
    lines = table(results)
    print("\n".join(lines))
    head = (f"## CPU attention forms on SmolLM2 (Q4_1 blocks, kv.max_seqs=8), {time.strftime('%Y-%m-%d')}\n\n"
            f"`python bench/attention_forms.py --runs {' '.join(args.runs)}` on {os.cpu_count()} CPU cores, one run, "
            "each artifact through its own revision's Session in turn (the script's docstring says what each row "
            "does).\n\n")
    write_section("attention_forms", head + "\n".join(lines), args.out or RESULTS)


if __name__ == "__main__":
    main()
