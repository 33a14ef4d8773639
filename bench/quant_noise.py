"""How chaotic a quantized model is under its own dynamic activation rounding: the eager quantized
model against itself with its input embeddings multiplied by ``1 + eps * noise`` (fp32-rounding-sized
perturbations), on one text prompt. No implementation of the scheme that is not bit-identical to the
oracle can be held closer than this; validate measures the same floor on each episode
(``pipeline.quant.validation.noise_floor``, every quantized linear's input perturbed) and holds the ``.pte`` to it
(docs/design.md, Weight quantization).

    python bench/quant_noise.py                        # SmolLM2 int4 and int8
    python bench/quant_noise.py --schemes int4 --eps 1e-7

Per scheme and eps: the max and median over positions of |logits - unperturbed| / (logit range),
and the fraction of positions whose greedy token changes.
"""

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _results import write_section  # noqa: E402
from conftest import compose_config  # noqa: E402
from smollm2_decode import TEXT  # noqa: E402

warnings.filterwarnings("ignore")


def perturbed_logits(model, tokens: list[int], eps: float, seed: int = 1) -> torch.Tensor:
    from pipeline.kv.op import ReferenceCache, reference_cache

    with reference_cache(ReferenceCache(model.args.layer_kv(), causal=True)), torch.no_grad():
        e = model.embed(torch.tensor(tokens))  # [1, T, dim]
        if eps:
            e = e * (1 + eps * torch.randn(e.shape, generator=torch.Generator().manual_seed(seed)))
        return model.logits(model.hidden(e, torch.arange(len(tokens))))  # [T, vocab]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", nargs="+", default=["int4", "int8"])
    parser.add_argument("--eps", nargs="+", type=float, default=[1e-7, 1e-6])
    parser.add_argument("--tokens", type=int, default=48, help="prompt length (positions measured)")
    args = parser.parse_args()

    from pipeline.build.plan import resolve_model
    from pipeline.models.methods import build_target
    from pipeline.models.tokenizer import load_tokenizer
    from pipeline.quant.apply import quantize

    rows = []
    for scheme in ["none", *args.schemes]:
        overrides = ["model=smollm2_135m", f"quant={scheme}"]
        cfg = resolve_model(compose_config(*overrides), overrides)
        model, _ = build_target(cfg.model, None)
        quantize(model, cfg.quant, cfg.model)
        tokens = load_tokenizer(cfg.model.checkpoint)(TEXT).input_ids[: args.tokens]
        base = perturbed_logits(model, tokens, 0.0)
        for eps in args.eps:
            got = perturbed_logits(model, tokens, eps)
            rel = (got - base).abs().amax(-1) / (base.amax(-1) - base.amin(-1))
            flips = float((got.argmax(-1) != base.argmax(-1)).float().mean())
            rows.append((scheme, eps, float(rel.max()), float(rel.median()), flips))
            print(f"{scheme:5s} eps={eps:.0e}: max {rel.max():.2e}, median {rel.median():.2e}, greedy changed at {flips:.1%}",
                  flush=True)
    table = ["| scheme | eps | max rel. logit change | median | greedy tokens changed |", "|---|---|---|---|---|"]
    table += [f"| {s} | {e:.0e} | {mx:.2e} | {md:.2e} | {f:.1%} |" for s, e, mx, md, f in rows]
    write_section("quant_noise", "## Quantized SmolLM2 against itself under fp32-sized input perturbations (CPU)\n\n"
                  f"`python bench/quant_noise.py --schemes {' '.join(args.schemes)} --eps {' '.join(f'{e:g}' for e in args.eps)}`, "
                  f"{time.strftime('%Y-%m-%d')}: the eager model (the oracle of validate) on {len(tokens)} tokens of one text "
                  "prompt, its input embeddings multiplied by `1 + eps * N(0, 1)`; change of each position's logits over "
                  "their range. `none` is the float model: the same perturbation moves it by fp32 rounding only.\n\n"
                  + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
