"""Quantization quality of built artifacts on several texts: what ``validate`` measures
(``pipeline/validation/quality.py``: mean / p99 / max KL divergence against the unquantized eager model,
top-1 agreement, the perplexity ratio), on the validation text and on other fixed texts, the
calibration of the per-scheme bounds in ``conf/quant/``; with ``--decode``, each artifact's decode
speed too (one sequence, 64 tokens after a 64-token prompt).

    python bench/quant_quality.py outputs/cal_int4/v0001 outputs/cal_int8/v0001 [--texts project types comparisons]

The texts: ``project``, the validation text (``pipeline/validation/text.py``); the others, sections of
the Python documentation shipped in the standard library (``pydoc_data.topics``), fixed for a given
Python. Prints a table and writes the "quant_quality" section of docs/benchmarks.md (``--out``)."""

import argparse
import statistics
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from _results import write_section


def texts(names: list[str]) -> dict[str, str]:
    from pydoc_data.topics import topics

    from pipeline.validation.text import TEXT

    return {name: TEXT if name == "project" else topics[name] for name in names}


def decode_tok_s(session, steps: int = 64) -> float:
    session.add("speed")
    logits = session.step({"speed": list(range(100, 164))})["speed"]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = session.step({"speed": [int(logits.argmax())]})["speed"]
        times.append(time.perf_counter() - start)
    session.release("speed")
    return 1 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--texts", nargs="+", default=["project", "types", "comparisons"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--decode", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="write the docs section to this file (default: docs/benchmarks.md)")
    args = parser.parse_args()

    from pipeline.models.methods import build_target
    from pipeline.runtime.session import Session
    from pipeline.validation.quality import measure, pte_logits

    rows = []
    for art in args.artifacts:
        cfg = OmegaConf.load(art / ".hydra" / "config.yaml")
        session = Session(art, prefix_cache=False)
        reference = build_target(cfg.model, None)[0].float().eval()
        size = (art / "model.pte").stat().st_size / 2**20
        speed = decode_tok_s(session) if args.decode else None
        for name, text in texts(args.texts).items():
            tokens = session.tokenizer(text)["input_ids"][: args.tokens]
            m = measure(lambda w, session=session: pte_logits(session, w), reference, tokens, session.max_length)
            rows.append((cfg.quant.scheme, str(art), name, m, size, speed))
            print(f"{cfg.quant.scheme:16} {name:12} tokens {m['tokens_scored']:5d}  mean KLD {m['mean_kld']:.4f}  p99 "
                  f"{m['p99_kld']:.3f}  max {m['max_kld']:.3f}  top-1 {m['top1_agreement']:.3f}  ppl ratio {m['ppl_ratio']:.4f}"
                  f"  (ppl {m['ppl']:.2f} / {m['ppl_unquantized']:.2f})", flush=True)
    table = ["| scheme | artifact | text | tokens | mean KLD | p99 KLD | max KLD | top-1 | ppl ratio | .pte MiB | decode tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for scheme, art, name, m, size, speed in rows:
        table.append(f"| {scheme} | `{art}` | {name} | {m['tokens_scored']} | {m['mean_kld']:.4f} | {m['p99_kld']:.3f} | "
                     f"{m['max_kld']:.3f} | {m['top1_agreement']:.3f} | {m['ppl_ratio']:.4f} | {size:.1f} | "
                     f"{'' if speed is None else f'{speed:.1f}'} |")
    print("\n".join(table))
    command = "python bench/quant_quality.py " + " ".join(sys.argv[1:])
    body = ("## Quantization quality against the unquantized model (CPU)\n\n"
            f"`{command}` ({time.strftime('%Y-%m-%d')}): each text through the `.pte` and the unquantized eager "
                  "model, teacher-forced in windows of 512 tokens; KL divergence in nats per token (the unquantized "
                  "distribution first).\n\n" + "\n".join(table))
    write_section("quant_quality", body, *([args.out] if args.out else []))


if __name__ == "__main__":
    main()
