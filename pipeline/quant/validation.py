"""What validate reports of a quantized artifact (``validation.json``'s ``quant``) and the bounds it
holds: each thing measured once, in a statistic that does not swing from one episode to the next.

- **exactness** (the lowering): the ``.pte`` against the eager model quantized the same way, every
  step of the episode. Each linear of that oracle is the ``.pte``'s to fp32 rounding (the activations'
  8-bit integers and zero points, the bfloat16 scales: docs/design.md "What the whole-model maximum
  measures"), but a deep model amplifies a single flipped activation rounding, so the two are two
  draws of that noise and no fp32-sized bound holds. Held: the median and the 90th percentile of the
  ``.pte``'s errors within ``validate.noise_margin`` times the same statistics of the oracle against
  itself under fp32-sized perturbations (``noise_floor``), or within ``validate.tolerance``;
  the maximum is reported.
- **quality** (the scheme): KL divergence, top-1 agreement and the perplexity ratio against the
  unquantized model on a fixed text (``pipeline.validation.quality``), each under its own bound.

The episode's free-running agreement with the unquantized model is reported, not held."""

import torch

PERCENTILES = {"median": 0.5, "p90": 0.9}


def _stats(errors: list[float]) -> dict[str, float]:
    t = torch.tensor(errors, dtype=torch.float64)
    return {**{name: float(torch.quantile(t, q)) for name, q in PERCENTILES.items()}, "max": float(t.max()), "count": len(errors)}


def noise_floor(model, scripts: list, metric: str, copies: int, seed: int, kv_rounding=None) -> list[float]:
    """The quantized oracle against itself: each sequence's oracle rows again with the input of every
    linear whose activations are quantized perturbed at fp32 rounding's size (each value times
    ``1 + e``, ``e ~ N(0, 2^-21)``: a few ulps, the size of the differences XNNPACK's float ops show
    against torch's, within 2e-6 of the largest value in tests/backends/test_elementwise.py), ``copies``
    times, each row's error against the unperturbed rows. A rounding-sized change flips
    some of the activations' 8-bit roundings, which a deep model amplifies: this is the size of the
    difference two exact computations of the same artifact show (docs/design.md, "Weight
    quantization"). The rows: the episode's own (a step's last token) where the oracle ran once per
    sequence, else every token after the prompt's last; images are not spliced (the floor is the
    model's, on the same tokens). With an 8-bit KV cache (``kv_rounding``), the oracle's caches round as the
    store does, and what they round is perturbed the same way."""
    from pipeline.quant.oracle import DequantizedLinear
    from pipeline.validation.episode import relative_error
    from pipeline.validation.quality import eager_logits

    gen = torch.Generator().manual_seed(seed)
    active = [False]

    def noisy(x):
        return x * (1 + torch.randn(x.shape, generator=gen, dtype=x.dtype) * 2.0 ** -21)

    def perturb(_module, args):
        return (noisy(args[0]), *args[1:]) if active[0] else None

    def rounds(x):  # the KV store's rounding of a perturbed value, once the perturbed copies run
        return kv_rounding(noisy(x) if active[0] else x)

    hooks = [m.register_forward_pre_hook(perturb) for m in model.modules() if isinstance(m, DequantizedLinear) and m.per_token]
    errors = []
    try:
        for s in scripts:
            if s.step_rows:
                toks, rows = s.fed_tokens, s.step_rows
            else:
                toks = s.prompt + s.generated[:-1]
                rows = list(range(len(s.prompt) - 1, len(toks)))
            cache_rounding = rounds if kv_rounding is not None else None
            clean = eager_logits(model, toks, cache_rounding)[rows]
            active[0] = True
            for _ in range(copies):
                errors += [relative_error(g, w, metric)
                           for g, w in zip(eager_logits(model, toks, cache_rounding)[rows], clean, strict=True)]
            active[0] = False
    finally:
        for hook in hooks:
            hook.remove()
    return errors


def exactness(errors: list[float], floor: list[float], validate_cfg) -> tuple[dict, list[str]]:
    """The ``.pte``'s errors against the quantized oracle held to the oracle's own noise floor."""
    got, noise = _stats(errors), _stats(floor)
    bounds = {name: max(validate_cfg.noise_margin * noise[name], validate_cfg.tolerance) for name in PERCENTILES}
    report = {"pte_vs_oracle": got, "oracle_vs_perturbed_oracle": noise,
              "perturbation": ("each value rounded to 8 bits (a quantized linear's input; an 8-bit KV cache's keys and values) "
                               f"times 1 + N(0, 2^-21), {validate_cfg.noise_copies} copies"),
              "bounds": bounds, "noise_margin": validate_cfg.noise_margin}
    failures = [f"the {name} relative logit error against the quantized eager model {got[name]:.3e} exceeds "
                f"{bounds[name]:.3e} (validate.noise_margin={validate_cfg.noise_margin} x the oracle's own {noise[name]:.3e} "
                f"under fp32-sized perturbations, or validate.tolerance={validate_cfg.tolerance})"
                for name in PERCENTILES if got[name] > bounds[name]]
    return report, failures


def quant_report(scripts: list, floor: list[float], quality: dict, quality_failures: list[str], quant_cfg,
                 validate_cfg, kv_dtype: str = "float32") -> tuple[dict, list[str]]:
    """``validation.json``'s ``quant`` and every bound broken; ``scripts``: the episode's sequences
    (``pipeline.validation.episode.Script``) with their errors against both oracles."""
    exact, failures = exactness([e for s in scripts for e in s.errors], floor, validate_cfg)
    report = {
        "scheme": str(quant_cfg.scheme),
        "kv_dtype": str(kv_dtype),  # int8: the KV cache rounds too (kv/quantize.py), and so do the oracle's caches
        "exactness": {"oracle": "the eager target quantized the same way (torchao's reference"
                                + ("; its caches rounded per token and KV head as the 8-bit store)" if kv_dtype == "int8" else ")"),
                      **exact},
        "quality": quality,
        "greedy_equals_oracle": {s.seq_id: all(s.oracle_agree) for s in scripts},
        # on the same tokens (each step feeds the .pte's token to both): a rate, not a rule
        "greedy_agreement_with_oracle": _rate([a for s in scripts for a in s.oracle_agree]),
        "episode_against_unquantized": {  # reported: the episode's free-running steps (quality holds the scheme)
            "max_relative_error": max(e for s in scripts for e in s.float_errors),
            "token_agreement": _rate([a for s in scripts for a in s.float_agree]),
        },
    }
    return report, failures + quality_failures


def _rate(flags: list[bool]) -> float:
    return sum(flags) / len(flags)
