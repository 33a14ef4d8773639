"""Aggregate decode throughput of built artifacts through the ExecuTorch runtime (CPU).

For S in --seqs and each layout: build (or reuse) `kv=<layout> kv.max_seqs=S`, prefill S
sequences to --context tokens, then time decode steps of one token per sequence.
`session step` is the whole Python serving step (embed_text + decode + step buffers);
`method` is target_forward_from_embeddings.execute alone on the same inputs.

    python bench/decode_throughput.py [--seqs 1 2 4 8] [--layouts sequence cell] [--context 64]
"""

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402

warnings.filterwarnings("ignore")


def build(layout: str, seqs: int, root: str) -> Path:
    from hydra import compose, initialize_config_dir

    from pipeline.build.runner import build as run_build
    from pipeline.config import register

    register()
    conf = str(Path(__file__).resolve().parent.parent / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        overrides = [f"kv={layout}", f"kv.max_seqs={seqs}", f"output_root={root}", f"experiment_name={layout}{seqs}",
                     "stages=[export,lower_kv,compile]"]
        if layout == "cell":
            overrides.append(f"kv.capacity={max(512, seqs * 160)}")
        return run_build(compose("config", overrides=overrides))


def measure(version: Path, seqs: int, context: int, steps: int) -> dict:
    from pipeline.runtime.session import Session

    s = Session(version)
    for i in range(seqs):
        s.add(i)
        for start in range(0, context, s.max_step_tokens):
            s.step({i: [7] * min(s.max_step_tokens, context - start)})
    step_times, method_times = [], []
    decode = s.method("target_forward_from_embeddings")
    rows = torch.arange(seqs)
    for _ in range(steps):
        t0 = time.perf_counter()
        s.step({i: [11] for i in range(seqs)})
        step_times.append(time.perf_counter() - t0)
    # the method alone, on inputs of the same shape (one more position per sequence each call)
    emb = s.method("embed_text").execute([torch.full((seqs,), 11, dtype=torch.int64)])[0]
    order = [(s.seqs[i], 1) for i in range(seqs)]
    for _ in range(steps):
        cells = s.pool.choose(seqs)
        buffers = s._step_buffers(order, cells)
        pos = torch.tensor([s.seqs[i].length for i in range(seqs)])
        t0 = time.perf_counter()
        decode.execute([emb, pos, rows, *buffers])
        method_times.append(time.perf_counter() - t0)
        s._commit(order, cells)
    step, method = statistics.median(step_times), statistics.median(method_times)
    return {"step_ms": step * 1e3, "step_tok_s": seqs / step, "method_ms": method * 1e3, "method_tok_s": seqs / method}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layouts", nargs="+", default=["sequence", "cell"])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--root", default="outputs/bench")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    results = {}
    for layout in args.layouts:
        for seqs in args.seqs:
            version = build(layout, seqs, args.root)
            results[layout, seqs] = measure(version, seqs, args.context, args.steps)
            r = results[layout, seqs]
            print(f"{layout:8s} S={seqs}: step {r['step_ms']:.2f} ms ({r['step_tok_s']:.0f} tok/s), "
                  f"method {r['method_ms']:.2f} ms ({r['method_tok_s']:.0f} tok/s)", flush=True)
    lines = ["| layout | S | session step ms | tokens/s | vs S=1 | method ms | tokens/s | vs S=1 |", "|---|---|---|---|---|---|---|---|"]
    for (layout, seqs), r in results.items():
        base = results.get((layout, 1)) or results.get(("sequence", 1))
        ratio = lambda k: f"{r[k] / base[k]:.2f}x" if base else "n/a"  # noqa: E731
        lines.append(f"| {layout} | {seqs} | {r['step_ms']:.2f} | {r['step_tok_s']:.0f} | {ratio('step_tok_s')} "
                     f"| {r['method_ms']:.2f} | {r['method_tok_s']:.0f} | {ratio('method_tok_s')} |")
    table = "\n".join(lines)
    print(table)
    cmd = f"python bench/decode_throughput.py --seqs {' '.join(map(str, args.seqs))} --layouts {' '.join(args.layouts)} --context {args.context}"
    write_section("decode_throughput", f"## Aggregate decode throughput, tiny model, XNNPACK, CPU\n\n"
                  f"`{cmd}` on {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}. Every sequence holds "
                  f"{args.context} tokens of context; median of {args.steps} decode steps of one token per sequence. "
                  f"`vs S=1` compares with the solo artifact (for cell, with the cell artifact at S=1). The cell pool "
                  f"holds max(512, 160 S) cells, and the ATen cell attention reads the pool's cells up to the last one in use.\n\n{table}")


if __name__ == "__main__":
    main()
