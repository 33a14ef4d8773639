"""SmolLM2 decode at S=1 and S=8 sequences as the context grows: where the batched CPU attention's
cost per sequence goes (every query gathers its column's rows, then the attention copies them again
into its matmul layout), the reason the server's 8-client rate falls short.

    python bench/smollm2_contexts.py outputs/smollm2_int4_s8/v0001 [--contexts 64 256 512]

Medians of 3 runs of 24 decode steps each (``smollm2_decode.ours``). Writes the "smollm2_contexts"
section of docs/benchmarks.md."""

import argparse
import statistics
import sys
import time
from pathlib import Path

from _results import write_section
from smollm2_decode import TEXT, ours


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", type=Path)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from pipeline.runtime.session import Session

    ids = Session(args.version).tokenizer(TEXT * 80).input_ids
    lines = [f"## SmolLM2 decode by context, S=1 and S=8 ({args.version.parent.name}, CPU)", "",
             f"`python bench/smollm2_contexts.py {args.version}` ({time.strftime('%Y-%m-%d')}): every sequence holds the "
             "context, then 24 decode steps of all of them; medians of 3 runs.", "",
             "| context | S=1 tok/s | S=8 tok/s | S=8 / S=1 |", "|---|---|---|---|"]
    for c in args.contexts:
        rate = {s: statistics.median([ours(args.version, s, ids[:c], 24) for _ in range(args.runs)]) for s in (1, 8)}
        lines.append(f"| {c} | {rate[1]:.1f} | {rate[8]:.1f} | {rate[8] / rate[1]:.2f} |")
        print(lines[-1], flush=True)
    print("\n".join(lines))
    write_section("smollm2_contexts", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
