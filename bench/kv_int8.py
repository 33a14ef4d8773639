"""An 8-bit KV cache (``kv.dtype=int8``) beside a float32 one on the same model and layout: memory per
sequence and decode speed as the context grows.

    python bench/kv_int8.py outputs/smollm2_q41_s8/v0005 outputs/smollm2_q41_s8_kv8/v0001 [--contexts 64 256 1000]

The two artifacts differ only in ``kv.dtype``. For each context and S (1 and 8 sequences, every one
holding the context), ``--steps`` decode steps of all of them (``smollm2_decode.ours``), the two
artifacts in turn, ``--runs`` times: medians, and the int8 / float32 ratio from the same runs. Memory:
the KV stores' bytes per sequence (the manifest's), and the peak resident memory of a process that
loads the artifact and fills every sequence to the longest context (a child process per artifact:
after loading, after filling, and its peak: VmHWM, the address space's own; Linux keeps ``ru_maxrss``
across ``execve``, so a child's would include the parent's size when it was forked).
Writes the "kv_int8" section of docs/benchmarks.md (``--out`` another file)."""

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _results import RESULTS, write_section
from smollm2_decode import TEXT, interleaved

FILL = """
import sys
from pipeline.runtime.session import Session
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 // 2**20
s = Session(sys.argv[1]); ids = [int(t) for t in sys.argv[2].split(",")]
loaded = rss()
for i in range(s.max_seqs):
    s.add(i)
    for start in range(0, len(ids), s.max_step_tokens):
        s.step({i: ids[start: start + s.max_step_tokens]})
s.step({i: [ids[0]] for i in range(s.max_seqs)})
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) // 1024
print(loaded, rss(), peak)
"""


def rss_mb(version: Path, ids: list[int]) -> tuple[int, int, int]:
    """Resident memory of a process that loads ``version`` (MB), then once every sequence holds ``ids`` and
    decoded a token, and its peak."""
    out = subprocess.run([sys.executable, "-c", FILL, str(version), ",".join(map(str, ids))], capture_output=True,
                         text=True, check=True)
    loaded, filled, peak = map(int, out.stdout.strip().splitlines()[-1].split())
    return loaded, filled, peak


def quality_against_float_cache(versions: dict, count: int) -> dict:
    """(b) with the float32-cache artifact as the reference: both ``.pte`` teacher-forced over the fixed
    text (``pipeline/validation/quality.py``'s windows and measures)."""
    import torch

    from pipeline.runtime.session import Session
    from pipeline.validation import quality

    sessions = {n: Session(v) for n, v in versions.items()}
    tokens, source = quality.text_tokens(sessions["float32"], count, 0)
    parts = []
    for window in quality.windows(tokens, sessions["float32"].max_length):
        want, got = (quality.pte_logits(sessions[n], window)[:-1] for n in ("float32", "int8"))
        parts.append(quality.compare(got, want, torch.tensor(window[1:])))
    return {"text": source, "window": min(sessions["float32"].max_length or quality.WINDOW, quality.WINDOW),
            **quality.summarize(parts)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("float32", type=Path, help="the artifact with kv.dtype=float32")
    parser.add_argument("int8", type=Path, help="the same build with kv.dtype=int8")
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1000])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quality-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from pipeline.build.manifest import read
    from pipeline.build.roles import TARGET
    from pipeline.runtime.session import Session

    versions = {"float32": args.float32, "int8": args.int8}
    kv = {name: read(v)[TARGET] for name, v in versions.items()}
    for name, section in kv.items():
        if section["dtype"] != name:
            raise SystemExit(f"{versions[name]}: its kv.dtype is {section['dtype']}, not {name}")
    ids = Session(args.float32).tokenizer(TEXT * (max(args.contexts) // 8 + 8)).input_ids
    lines = [f"`python bench/kv_int8.py {shlex.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}), SmolLM2 on CPU: every "
             f"sequence holds the context, then {args.steps} decode steps of all of them; the two artifacts in turn, "
             f"medians of {args.runs} runs.", ""]
    per_seq = {n: kv[n]["kv_bytes_total"] / kv[n]["max_seqs"] / 1e6 for n in versions}
    rss = {n: rss_mb(v, ids[: max(args.contexts)]) for n, v in versions.items()}
    lines += ["| KV cache | KV stores per sequence | per token | RSS loaded | RSS, every sequence at "
              f"{max(args.contexts)} tokens | peak RSS |", "|---|---|---|---|---|---|"]
    for n in versions:
        per_token = kv[n]["kv_bytes_total"] / kv[n]["max_seqs"] / kv[n]["capacity"] / 1e3
        lines.append(f"| {n} | {per_seq[n]:.1f} MB ({kv[n]['capacity']} tokens) | {per_token:.1f} KB | {rss[n][0]} MB | "
                     f"{rss[n][1]} MB | {rss[n][2]} MB |")
    q = quality_against_float_cache(versions, args.quality_tokens)
    lines += ["", f"Quality, the int8 artifact against the float32 one ({q['text']}, teacher-forced in windows of "
              f"{q['window']} as validate measures, the float32 artifact's distribution the reference): mean KLD "
              f"{q['mean_kld']:.5f}, p99 {q['p99_kld']:.4f}, max {q['max_kld']:.3f}, top-1 agreement "
              f"{q['top1_agreement']:.2%}, perplexity ratio {q['ppl_ratio']:.4f}."]
    lines += ["", "| context | S | float32 tok/s | int8 tok/s | int8 / float32 |", "|---|---|---|---|---|"]
    for c in args.contexts:
        for s in args.seqs:
            rates = interleaved(versions, s, ids[:c], args.steps, args.runs)
            med = {n: statistics.median(r) for n, r in rates.items()}
            ratio = statistics.median([i / f for i, f in zip(rates["int8"], rates["float32"], strict=True)])
            lines.append(f"| {c} | {s} | {med['float32']:.1f} | {med['int8']:.1f} | {ratio:.2f} |")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    print(json.dumps({"rss_mb": rss, "kv_mb_per_sequence": per_seq}))
    write_section("kv_int8", "\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
