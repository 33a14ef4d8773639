"""SmolLM2 decode at S=1 and S=8 sequences as the context grows: where the batched CPU attention's
cost per sequence goes (every query gathers its column's rows, then the attention copies them again
into its matmul layout), the reason the server's 8-client rate falls short.

    python bench/smollm2_contexts.py outputs/smollm2_int4_s8/v0001 [--contexts 64 256 1024] [--seqs 1 8]

Medians of 3 runs of 24 decode steps each (``smollm2_decode.ours``). The artifact must hold the longest
context plus the decode steps in a sequence (kv.capacity) and the most sequences (kv.max_seqs). Writes
the "smollm2_contexts" section of docs/benchmarks.md (``--out`` another file)."""

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

from _results import RESULTS, write_section
from smollm2_decode import TEXT, ours


def check_artifact(version: Path, kv: dict, contexts: list[int], seqs: list[int], steps: int) -> None:
    """Refuse, naming the artifact's figures, a run it cannot hold: every sequence reaches its context
    plus ``steps`` tokens, and S sequences are live at once."""
    need = max(contexts) + steps
    if kv["max_seq_len"] is not None and kv["max_seq_len"] < need:
        raise SystemExit(f"{version}: its kv.capacity is {kv['max_seq_len']} tokens a sequence; a {max(contexts)}-token "
                         f"context plus --steps {steps} needs {need}: build it with kv.capacity>={need} or pass smaller --contexts")
    if kv["max_seqs"] < max(seqs):
        raise SystemExit(f"{version}: its kv.max_seqs is {kv['max_seqs']}; --seqs {max(seqs)} needs kv.max_seqs>={max(seqs)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", type=Path)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8], help="sequences decoding together (the first: the base)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS, help="the file whose section is written (default: docs/benchmarks.md)")
    args = parser.parse_args()
    if min(args.contexts + args.seqs) < 1 or args.steps < 1 or args.runs < 1:
        parser.error("--contexts, --seqs, --steps and --runs take positive integers")
    from pipeline.build.manifest import read
    from pipeline.build.roles import TARGET
    from pipeline.runtime.session import Session

    check_artifact(args.version, read(args.version)[TARGET], args.contexts, args.seqs, args.steps)
    ids = Session(args.version).tokenizer(TEXT * (max(args.contexts) // 8 + 8)).input_ids
    if len(ids) < max(args.contexts):
        raise SystemExit(f"the text gives {len(ids)} tokens, fewer than --contexts {max(args.contexts)}")
    base = args.seqs[0]
    lines = [f"## SmolLM2 decode by context, S={' and S='.join(map(str, args.seqs))} ({args.version.parent.name}, CPU)", "",
             f"`python bench/smollm2_contexts.py {shlex.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}): every sequence "
             "holds the context, then "
             f"{args.steps} decode steps of all of them; medians of {args.runs} runs.", "",
             "| context | " + " | ".join(f"S={s} tok/s" for s in args.seqs) + " | "
             + " | ".join(f"S={s} / S={base}" for s in args.seqs[1:]) + " |",
             "|---|" + "---|" * (2 * len(args.seqs) - 1)]
    for c in args.contexts:
        rate = {s: statistics.median([ours(args.version, s, ids[:c], args.steps) for _ in range(args.runs)]) for s in args.seqs}
        lines.append(f"| {c} | " + " | ".join(f"{rate[s]:.1f}" for s in args.seqs) + " | "
                     + " | ".join(f"{rate[s] / rate[base]:.2f}" for s in args.seqs[1:]) + " |")
        print(lines[-1], flush=True)
    print("\n".join(lines))
    write_section("smollm2_contexts", "\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
