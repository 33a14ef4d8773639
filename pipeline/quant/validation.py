"""What validate reports of a quantized artifact (``validation.json``'s ``quant``) and the bounds it holds."""


def quant_report(scripts: list, quant_cfg, validate_cfg) -> tuple[dict, list[str]]:
    """A quantized artifact against the unquantized eager model, step by step (the scheme's cost);
    ``scripts``: the validation episode's sequences (``pipeline.validation.episode.Script``), their errors and agreements
    recorded step by step."""
    agreement = _rate([a for s in scripts for a in s.float_agree])
    worst = max(e for s in scripts for e in s.float_errors)
    report = {
        "scheme": str(quant_cfg.scheme),
        "oracle": "the eager target quantized the same way (torchao's reference; validate holds validate.quant_tolerance)",
        "tolerance": validate_cfg.quant_tolerance,
        "greedy_equals_oracle": {s.seq_id: all(s.oracle_agree) for s in scripts},
        # on the same tokens (each step feeds the .pte's token to both): the dynamic activation
        # rounding makes a deep model chaotic, so this is a rate, not a rule (docs/design.md)
        "greedy_agreement_with_oracle": _rate([a for s in scripts for a in s.oracle_agree]),
        "against_unquantized": {
            "max_relative_error": worst,
            "token_agreement": agreement,
            "min_token_agreement": validate_cfg.min_token_agreement,
            "max_logit_error": validate_cfg.max_logit_error,
            "per_step": {s.seq_id: {"relative_error": s.float_errors, "greedy_agrees": s.float_agree} for s in scripts},
        },
    }
    failures = []
    if agreement < validate_cfg.min_token_agreement:
        failures.append(f"greedy tokens agree with the unquantized model on {agreement:.1%} of steps, under "
                        f"validate.min_token_agreement={validate_cfg.min_token_agreement}")
    if worst > validate_cfg.max_logit_error:
        failures.append(f"the max relative logit error against the unquantized model {worst:.3e} exceeds "
                        f"validate.max_logit_error={validate_cfg.max_logit_error}")
    return report, failures


def _rate(flags: list[bool]) -> float:
    return sum(flags) / len(flags)
