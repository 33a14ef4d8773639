"""The README's quantized SmolLM2 builds, validated three times in a row on three prompt sets (three
episodes; the quality text is fixed, so its measures repeat): every measure validate holds, from
validation.json.

    python bench/quant_validate.py [--schemes int4 from_checkpoint] [--sets 0 1 2]

Each build is ``python -m pipeline model=smollm2_135m quant=SCHEME kv=sequence kv.max_seqs=8`` (the
README's commands); the stage cache makes the second and third only a validation. Prints a table and
writes the "quant_validate" section of docs/benchmarks.md."""

import argparse
import json
import re
import subprocess
import sys
import time

from _results import REPO, write_section

# set 0: validate.prompts' defaults; the others, five prompts each
PROMPT_SETS = [None,
               ["Tell me about the history of tea.", "import numpy as np", "My favourite season is",
                "The best way to learn a language is", "Dear team, thank you for"],
               ["What is the tallest mountain in Europe?", "class Stack:", "It was a dark and stormy night,",
                "Photosynthesis is the process by which", "To make a cup of coffee, first"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", nargs="+", default=["int4", "from_checkpoint"])
    parser.add_argument("--sets", nargs="+", type=int, default=[0, 1, 2], help="prompt sets (0: the defaults)")
    parser.add_argument("--output-root", default="outputs")
    args = parser.parse_args()
    rows = []
    for scheme in args.schemes:
        for seed in args.sets:
            name = f"readme_{scheme}"
            command = [sys.executable, "-m", "pipeline", "model=smollm2_135m", f"quant={scheme}", "kv=sequence",
                       "kv.max_seqs=8", f"experiment_name={name}", f"output_root={args.output_root}"]
            if PROMPT_SETS[seed]:
                command.append("validate.prompts=" + json.dumps(PROMPT_SETS[seed]))
            start = time.perf_counter()
            proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            # the version it built (or reused), or where a failed build's outputs were kept
            where = re.search(r"^built (\S+) in |partial outputs kept for inspection in (\S+) ", proc.stdout, re.M)
            d = REPO / (where.group(1) or where.group(2)) / "validation.json" if where else None
            if d is None or not d.exists():
                sys.exit(f"{' '.join(command)} wrote no validation:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            report = json.loads(d.read_text())
            q = report["quant"]
            e, n, m = q["exactness"]["pte_vs_oracle"], q["exactness"]["oracle_vs_perturbed_oracle"], q["quality"]
            rows.append(f"| {scheme} | {seed} | {'passed' if report['passed'] else 'FAILED'} | {e['median']:.3f} / {n['median']:.3f} "
                        f"| {e['p90']:.3f} / {n['p90']:.3f} | {e['max']:.3f} / {n['max']:.3f} | {m['mean_kld']:.4f} | "
                        f"{m['p99_kld']:.3f} | {m['top1_agreement']:.3f} | {m['ppl_ratio']:.4f} | {seconds:.0f} |")
            print(rows[-1], flush=True)
    table = ["| scheme | prompt set | validation | median error, .pte / floor | p90 | max | mean KLD | p99 KLD | "
             "top-1 | ppl ratio | s |", "|---|---|---|---|---|---|---|---|---|---|---|", *rows]
    body = ("## The README's quantized builds validated three times (SmolLM2-135M, kv.max_seqs=8, CPU)\n\n"
            f"`python bench/quant_validate.py {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}): `python -m pipeline "
            "model=smollm2_135m quant=SCHEME kv=sequence kv.max_seqs=8` with validate.prompts the defaults (set 0) or "
            "five others (sets 1, 2: `PROMPT_SETS`). Exactness: the `.pte`'s relative "
            "logit errors against the quantized eager model over the episode, beside the same model's against itself "
            "under fp32-sized perturbations (held: median and p90 within validate.noise_margin=1.5x). Quality: the fixed "
            "text against the unquantized model (the same every seed). Seconds: the whole command (the first builds).\n\n"
            + "\n".join(table))
    print("\n".join(table))
    write_section("quant_validate", body)


if __name__ == "__main__":
    main()
