"""The CPU attention's two kernels on the same build: ``kv.cpu_kernel=aten`` (ATen ops, copying the rows a step
reads) against ``kv.cpu_kernel=native`` (pipeline/kernels/cpu/sdpa_gather.cpp, reading them in place).

    python bench/cpu_kernel.py outputs/smollm2_q41_s8/v0005 outputs/smollm2_q41_s8_native/v0001 [--contexts 64 256 1000]

The two artifacts differ only in ``kv.cpu_kernel``. Decode: for each context and S (every sequence holding
the context), ``--steps`` decode steps of all of them (``smollm2_decode.ours``), the artifacts in turn,
``--runs`` times: medians and the native / aten ratio from the same runs. Prefill: a 770-token prompt in
steps of the artifact's ``max_step_tokens`` (the best of ``--runs``). Writes the "cpu_kernel" section of
docs/benchmarks.md (``--out`` another file)."""

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

from _results import RESULTS, write_section
from smollm2_decode import TEXT, interleaved


def prefill(version: Path, ids: list[int]) -> float:
    """Prompt tokens/s of one prompt prefilled alone."""
    from pipeline.runtime.session import Session

    s = Session(version)
    s.add(0)
    start = time.perf_counter()
    for at in range(0, len(ids), s.max_step_tokens):
        s.step({0: ids[at: at + s.max_step_tokens]})
    return len(ids) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("aten", type=Path, help="the artifact with kv.cpu_kernel=aten")
    parser.add_argument("native", type=Path, help="the same build with kv.cpu_kernel=native")
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1000])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=770)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from pipeline.build.manifest import read
    from pipeline.build.roles import TARGET
    from pipeline.runtime.session import Session

    versions = {"aten": args.aten, "native": args.native}
    for name, v in versions.items():
        if read(v)[TARGET].get("cpu_kernel", "aten") != name:
            raise SystemExit(f"{v}: its kv.cpu_kernel is not {name}")
    ids = Session(args.aten).tokenizer(TEXT * (max(args.contexts + [args.prompt]) // 8 + 8)).input_ids
    lines = [f"`python bench/cpu_kernel.py {shlex.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}), SmolLM2 on 2 CPU "
             f"cores: every sequence holds the context, then {args.steps} decode steps of all of them; the two "
             f"artifacts in turn, medians of {args.runs} runs.", "",
             "| context | S | aten tok/s | native tok/s | native / aten |", "|---|---|---|---|---|"]
    rates = {}
    for c in args.contexts:
        for s in args.seqs:
            got = interleaved(versions, s, ids[:c], args.steps, args.runs)
            med = {n: statistics.median(r) for n, r in got.items()}
            rates[c, s] = med
            ratio = statistics.median([b / a for a, b in zip(got["aten"], got["native"], strict=True)])
            lines.append(f"| {c} | {s} | {med['aten']:.1f} | {med['native']:.1f} | {ratio:.2f} |")
            print(lines[-1], flush=True)
    if len(args.seqs) > 1:
        base, top = args.seqs[0], args.seqs[-1]
        lines += ["", f"| context | S={top} / S={base}, aten | native |", "|---|---|---|"]
        lines += [f"| {c} | {rates[c, top]['aten'] / rates[c, base]['aten']:.2f} | "
                  f"{rates[c, top]['native'] / rates[c, base]['native']:.2f} |" for c in args.contexts]
    fill = {n: max(prefill(v, ids[: args.prompt]) for _ in range(args.runs)) for n, v in versions.items()}
    lines += ["", f"Prefill of a {args.prompt}-token prompt alone (best of {args.runs}): aten {fill['aten']:.0f} tok/s, "
              f"native {fill['native']:.0f} tok/s ({fill['native'] / fill['aten']:.2f}x)."]
    print("\n".join(lines))
    write_section("cpu_kernel", "## The CPU attention's kernels: aten against native (SmolLM2, CPU)\n\n" + "\n".join(lines),
                  args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
