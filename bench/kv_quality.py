"""What an 8-bit KV cache costs, measured eagerly as ``validate`` measures a scheme
(``pipeline/validation/quality.py``: KL divergence, top-1 agreement and the perplexity ratio against
the same model with float32 caches, teacher-forced over the fixed texts), for SmolLM2-135M:

- ``int8``: the store's rounding (``pipeline/kv/quantize.py``: a scale per token and KV head);
- ``q8_0``: llama.cpp's ``-ctk q8_0 -ctv q8_0`` for comparison (a float16 scale per 32 values);
- ``per-layer``: the planted fault, one scale per layer for all tokens and heads a step writes;
- with ``--weights from_checkpoint``: the GGUF's kept blocks too (what the serving build computes),
  with each cache, against the unquantized model (the scheme's bounds hold the sum).

Every row rounds K and V as they enter the eager oracle's cache (``ReferenceCache.rounding``), which
the ``.pte`` computes to fp32 rounding (tests/passes/test_lower_offgraph_kv.py).

    python bench/kv_quality.py [--texts project types comparisons] [--weights none from_checkpoint]

Prints a table and writes the "kv_quality" section of docs/benchmarks.md. The calibration of
``conf/quant/none.yaml``'s bounds (which hold ``kv.dtype=int8`` with float weights)."""

import argparse
import os
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conftest.compose_config
from _results import write_section  # noqa: E402


def per_layer(x: torch.Tensor) -> torch.Tensor:
    """The planted fault: one scale for everything the step writes into the layer."""
    from pipeline.kv.quantize import QMAX, TINY

    scale = x.abs().amax().clamp_min(TINY) * (1.0 / QMAX)
    return (x / scale).round().clamp(-QMAX, QMAX) * scale


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q8_0 blocks: 32 values, a float16 scale max|x| / 127, round half away from zero."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.where(scale > 0, blocks / torch.where(scale > 0, scale, 1), 0)
    q = (q.sign() * (q.abs() + 0.5).floor()).clamp(-127, 127)
    return (q * scale).reshape(x.shape)


def smollm2():
    """SmolLM2-135M's GGUF: its config, the unquantized model (its blocks dequantized) and the
    quant=from_checkpoint oracle (the blocks kept, activations quantized per token as the .pte's)."""
    from conftest import compose_config
    from pipeline.build.plan import resolve_model
    from pipeline.models.methods import build_target
    from pipeline.quant.apply import quantize
    from pipeline.quant.oracle import with_dequantized_weights

    cfg = resolve_model(compose_config("model=smollm2_135m", "quant=from_checkpoint"), [])
    reference = build_target(cfg.model, None)[0].float().eval()
    model, _ = build_target(cfg.model, None)
    quantize(model, cfg.quant, cfg.model)
    return cfg, reference, with_dequantized_weights(model).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", nargs="+", default=["project", "types", "comparisons"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--weights", nargs="+", default=["none", "from_checkpoint"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from pydoc_data.topics import topics

    import transformers

    from pipeline.kv.quantize import rounding
    from pipeline.validation import quality
    from pipeline.validation.text import TEXT

    cfg, reference, oracle = smollm2()
    directory, name = os.path.split(cfg.model.checkpoint)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    caches = {"float32": None, "int8": rounding("int8"), "q8_0": q8_0, "per-layer": per_layer}
    models = {"none": reference, "from_checkpoint": oracle}
    rows = []
    for text in args.texts:
        ids = tokenizer(TEXT if text == "project" else topics[text])["input_ids"][: args.tokens]
        want = {}
        for weights in args.weights:
            for cache, fn in caches.items():
                if weights == "none" and cache == "float32":
                    continue  # the reference itself
                m = quality.measure(lambda w, fn=fn, model=models[weights]: quality.eager_logits(model, w, fn),
                                    reference, ids, None)
                want[(weights, cache)] = m
                rows.append((text, weights, cache, m))
                print(f"{text:12} weights={weights:15} cache={cache:10} mean KLD {m['mean_kld']:.5f}  p99 {m['p99_kld']:.4f}  "
                      f"max {m['max_kld']:.3f}  top-1 {m['top1_agreement']:.2%}  ppl ratio {m['ppl_ratio']:.4f}", flush=True)
    lines = [f"`{shlex.join(['python', 'bench/kv_quality.py', *sys.argv[1:]])}`; SmolLM2-135M eager, each cache's "
             f"rounding in the oracle's caches, against the unquantized model with float32 caches, {args.tokens} tokens of "
             "each text in windows of 512.", "",
             "| text | weights | KV cache | mean KLD | p99 KLD | max KLD | top-1 | ppl ratio |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {t} | {w} | {c} | {m['mean_kld']:.5f} | {m['p99_kld']:.4f} | {m['max_kld']:.3f} | {m['top1_agreement']:.2%} | "
              f"{m['ppl_ratio']:.4f} |" for t, w, c, m in rows]
    body = "\n".join(lines)
    print(body)
    write_section("kv_quality", body, *([args.out] if args.out else []))


if __name__ == "__main__":
    main()
