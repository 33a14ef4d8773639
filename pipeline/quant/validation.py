"""What validate reports of a quantized artifact (``validation.json``'s ``quant``) and the bounds it
holds: each thing measured once, in a statistic that does not swing from one episode to the next.

- **exactness** (the lowering): the ``.pte`` against the eager model quantized the same way, every
  step of the episode. Each linear of that oracle is the ``.pte``'s to fp32 rounding (the activations'
  8-bit integers and zero points, the bfloat16 scales: docs/design.md "What the whole-model maximum
  measures"), but a deep model amplifies a single flipped activation rounding, so the two are two
  draws of that noise and no fp32-sized bound holds. Held: the median and the 90th percentile of the
  ``.pte``'s errors within ``validate.noise_margin`` times the same statistics of the oracle against
  itself under fp32-sized perturbations (``episode.noise_floor``), or within ``validate.tolerance``;
  the maximum is reported.
- **quality** (the scheme): KL divergence, top-1 agreement and the perplexity ratio against the
  unquantized model on a fixed text (``pipeline.validation.quality``), each under its own bound.

The episode's free-running agreement with the unquantized model is reported, not held."""

import torch

PERCENTILES = {"median": 0.5, "p90": 0.9}


def _stats(errors: list[float]) -> dict[str, float]:
    t = torch.tensor(errors, dtype=torch.float64)
    return {**{name: float(torch.quantile(t, q)) for name, q in PERCENTILES.items()}, "max": float(t.max()), "count": len(errors)}


def exactness(errors: list[float], floor: list[float], validate_cfg) -> tuple[dict, list[str]]:
    """The ``.pte``'s errors against the quantized oracle held to the oracle's own noise floor."""
    got, noise = _stats(errors), _stats(floor)
    bounds = {name: max(validate_cfg.noise_margin * noise[name], validate_cfg.tolerance) for name in PERCENTILES}
    report = {"pte_vs_oracle": got, "oracle_vs_perturbed_oracle": noise,
              "perturbation": f"each quantized linear's input times 1 + N(0, 2^-21), {validate_cfg.noise_copies} copies",
              "bounds": bounds, "noise_margin": validate_cfg.noise_margin}
    failures = [f"the {name} relative logit error against the quantized eager model {got[name]:.3e} exceeds "
                f"{bounds[name]:.3e} (validate.noise_margin={validate_cfg.noise_margin} x the oracle's own {noise[name]:.3e} "
                f"under fp32-sized perturbations, or validate.tolerance={validate_cfg.tolerance})"
                for name in PERCENTILES if got[name] > bounds[name]]
    return report, failures


def quant_report(scripts: list, floor: list[float], quality: dict, quality_failures: list[str], quant_cfg,
                 validate_cfg) -> tuple[dict, list[str]]:
    """``validation.json``'s ``quant`` and every bound broken; ``scripts``: the episode's sequences
    (``pipeline.validation.episode.Script``) with their errors against both oracles."""
    exact, failures = exactness([e for s in scripts for e in s.errors], floor, validate_cfg)
    report = {
        "scheme": str(quant_cfg.scheme),
        "exactness": {"oracle": "the eager target quantized the same way (torchao's reference)", **exact},
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
