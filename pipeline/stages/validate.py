"""validate: drive the written .pte through a continuous-batching episode and
compare every step's logits with the oracle.

The oracle is the eager neutral model with one independent contiguous
ReferenceCache per sequence: batching and layout must not change any
sequence's logits. The episode: max_seqs + 1 sequences of different prompt
lengths, chunked prefill sharing steps with decodes, greedy decoding, one
sequence finishing and a new one taking its column (or cells), ring layers
wrapping.

The episode and the oracles are ``pipeline.validation.episode``; this stage builds the oracles' models, runs
the episode through the backend's session and writes the report.

needs: model, lowered, program    gives: validation (written to validation.json)

What runs the program is the backend's (``Backend.session``): ExecuTorch's runtime on CPU, the
same lowered graphs through Inductor on a GPU.
"""

import copy
import functools
import json
from pathlib import Path

import torch

from pipeline.build.plan import BuildPlan
from pipeline.build.roles import DRAFT, TARGET, VISION
from pipeline.errors import BuildError
from pipeline.kv.quantize import rounding
from pipeline.runtime.session import Session
from pipeline.validation.episode import Script, add_images, plan, run_episode


class ValidationFailed(BuildError):
    pass


def rebuild_programs(config: dict) -> dict:
    """The graphs the backend compiles, made again from the config alone by the same code as the export
    and lower_kv stages (``pipeline/models/methods.py``): the GPU validation's child process gets them
    this way, since graphs that went through ``torch.export.save``/``load`` compiled to wrong code under
    AOTInductor (``pipeline/runtime/aoti.py``), and a child cannot be handed live ones."""
    from omegaconf import OmegaConf

    from pipeline.build.plan import resolve
    from pipeline.config import SCHEMA
    from pipeline.models.methods import build_models, export_methods, lower_methods

    build = resolve(OmegaConf.merge(OmegaConf.structured(SCHEMA), OmegaConf.create(config)))
    exported = {}
    for stage in ("export_vision", "export"):  # no workdir: the graphs only (no tokenizer, no processor)
        built, _ = build_models(build, stage, None)
        exported[stage] = export_methods(build, stage, built)
    return build.backend.programs(lower_methods(build, exported["export"]) | exported["export_vision"])


def programs_recipe(build: BuildPlan):
    """``rebuild_programs`` for this plan's config as a picklable call (for a child process)."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(build.config, resolve=True)
    config["stages"] = ["export_vision", "export", "lower_kv"]
    return functools.partial(rebuild_programs, config)


def _text_prompts(scripts: list[Script], prompts: list[str], session: Session) -> bool:
    """The episode's prompts as text (``validate.prompts``, cycled), tokenized by the artifact's tokenizer; a chat
    model's (its tokenizer has a chat template) each as a user's message, templated as a server would. Returns
    whether the template was used."""
    tokenizer = session.tokenizer
    chat = bool(getattr(tokenizer, "chat_template", None))
    for i, s in enumerate(scripts):
        s.text = prompts[i % len(prompts)]
        if chat:
            templated = tokenizer.apply_chat_template([{"role": "user", "content": s.text}], tokenize=False,
                                                      add_generation_prompt=True)
            s.prompt = tokenizer(templated, add_special_tokens=False).input_ids
        else:
            s.prompt = tokenizer(s.text).input_ids
        end = len(s.prompt) + s.decode_steps
        if session.max_length is not None and end > session.max_length:
            raise ValidationFailed(f"validate.prompts[{i % len(prompts)}] is {len(s.prompt)} tokens"
                                   f"{' (chat-templated)' if chat else ''}; with {s.decode_steps} decode steps it "
                                   f"passes kv.capacity={session.max_length}")
    return chat


def run(build: BuildPlan, inputs: dict, workdir: Path) -> dict:
    cfg = build.config
    validate_cfg, quant_cfg = cfg.validate, cfg.quant
    models = {**inputs["models"], **(inputs.get("vision_models") or {})}
    model, draft, vision = models[TARGET], models.get(DRAFT), models.get(VISION)
    # lossy: quantized weights (quant != none) or an 8-bit KV cache (kv.dtype=int8), held by exactness against
    # the eager model that rounds the same way and by quality against the one that rounds nothing
    weights_quantized = build.quant.quantized
    kv_rounding = rounding(build.target.layout.dtype)
    quantized = weights_quantized or kv_rounding is not None
    unquantized = None
    if weights_quantized:  # the scheme's cost is measured against the model before quantization
        from pipeline.models.methods import build_target
        from pipeline.quant.oracle import with_dequantized_weights

        unquantized = build_target(cfg.model, None)[0].float()
        model = with_dequantized_weights(model)  # the same logits bit for bit, its weights dequantized once
        if draft is not None:  # its linears quantized too (quant.draft) or in float (then a copy)
            draft = with_dequantized_weights(draft)
    if next(model.parameters()).dtype != torch.float32:  # the oracle computes in fp32 from the same weights
        model = copy.deepcopy(model).float()
        draft = copy.deepcopy(draft).float() if draft is not None else None
        vision = copy.deepcopy(vision).float() if vision is not None else None
    if quantized and unquantized is None:  # the KV cache alone rounds: the same weights over float caches
        unquantized = model
    with build.backend.session(validate_cfg, inputs, workdir, programs_recipe(build)) as (session, runtime):
        scripts = plan(validate_cfg, session.max_seqs, model.args.vocab_size)
        chat = False
        if session.manifest.get("tokenizer") and validate_cfg.prompts:
            chat = _text_prompts(scripts, list(validate_cfg.prompts), session)
        if vision is not None:
            add_images(scripts, session.vision, session.vocab_size, validate_cfg.seed)
        how = ("speculatively (DFlash draft) " if draft is not None else "") + ("with images " if vision is not None else "")
        print(f"  episode: {len(scripts)} sequences {how}through {session.layout} (max_seqs={session.max_seqs})", flush=True)
        stats = run_episode(session, model, scripts, cfg.model.causal, validate_cfg.metric, draft, vision, unquantized,
                            kv_rounding=kv_rounding)
        if quantized:  # the scheme's cost on the fixed text, through the same session
            from pipeline.validation.quality import quality_report

            print("  quality: the fixed text through the .pte and the unquantized model", flush=True)
            quality, quality_failures = quality_report(session, unquantized, validate_cfg)
    worst = max(max(s.errors) for s in scripts)
    # a quantized target is held by its errors' distribution (quant.exactness); its draft's logits by quant_tolerance
    tolerance, bound = ((validate_cfg.quant_tolerance, "validate.quant_tolerance") if quantized
                        else (validate_cfg.tolerance, "validate.tolerance"))
    if scripts[0].text is not None:
        decode = session.tokenizer.decode
        text = {s.seq_id: {"prompt": s.text, "continuation": decode(s.generated, skip_special_tokens=True)} for s in scripts}
    passed = quantized or worst <= tolerance
    failures = [] if passed else [f"max relative logit error {worst:.3e} exceeds {bound}={tolerance}"]
    quant = {}
    if quantized:
        from pipeline.quant.validation import noise_floor, quant_report

        floor = noise_floor(model, scripts, validate_cfg.metric, validate_cfg.noise_copies, validate_cfg.seed, kv_rounding)
        quant, quant_failures = quant_report(scripts, floor, quality, quality_failures, quant_cfg, validate_cfg,
                                             build.target.layout.dtype)
        failures += quant_failures
        passed = not failures
    images = {}
    if vision is not None:
        vision_worst = max(s.vision_error for s in scripts if s.image is not None)
        images = {"sequences": [s.seq_id for s in scripts if s.image is not None], "vision_max_relative_error": vision_worst}
        if vision_worst > validate_cfg.tolerance:
            failures.append(f"the vision encoder's max relative error {vision_worst:.3e} exceeds validate.tolerance")
            passed = False
    speculative = {}
    if draft is not None:
        speculative, spec_failures = _speculative_report(model, scripts, tolerance, bound, quantized)
        failures += spec_failures
        passed = not failures
    report = {
        "scenario": {
            "layout": session.layout, "max_seqs": session.max_seqs,
            "sequences": [{"id": s.seq_id, "prompt_tokens": len(s.prompt), "decoded": s.decoded,
                           "reused": stats["reused"].get(s.seq_id, 0)} for s in scripts],
            **{key: value for key, value in stats.items() if key != "reused"},
        },
        **({"text": text, "chat_template": chat} if scripts[0].text is not None else {}),
        "runtime": runtime,
        "metric": {"range": "max |logits - oracle| / (oracle logit range)",
                   "norm": "||logits - oracle|| / ||oracle||"}[validate_cfg.metric] + ", every step of every sequence",
        "per_sequence": {s.seq_id: max(s.errors) for s in scripts},
        "metric_name": validate_cfg.metric,
        "max_relative_error": worst,
        **({"speculative": speculative} if speculative else {}),
        **({"images": images} if images else {}),
        **({"quant": quant} if quant else {}),
        "tolerance": None if quantized else tolerance,  # quantized: quant.exactness's bounds
        "passed": passed,
    }
    (workdir / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    if quantized:
        exact = quant["exactness"]
        got, noise = exact["pte_vs_oracle"], exact["oracle_vs_perturbed_oracle"]
        oracle = "the quantized eager model" + (" (its caches rounding to 8 bits as the store)" if kv_rounding else "")
        print(f"  against {oracle} over {stats['steps']} steps: relative error median {got['median']:.2e}, "
              f"p90 {got['p90']:.2e}, max {got['max']:.2e}; the oracle against itself perturbed: {noise['median']:.2e}, "
              f"{noise['p90']:.2e}, {noise['max']:.2e} (held: median and p90 within {validate_cfg.noise_margin}x)", flush=True)
    else:
        print(f"  max relative error ({validate_cfg.metric}) {worst:.2e} (tolerance {tolerance:.2g}) over {stats['steps']} "
              "steps", flush=True)
    if stats["reused"]:
        print("  prefix cache: " + ", ".join(f"{seq_id} adopted {n} prompt tokens of a released sequence's rows"
                                             for seq_id, n in stats["reused"].items()), flush=True)
    if quant:
        q = quant["quality"]
        print(f"  quality against the unquantized model ({q['text']}): mean KLD {q['mean_kld']:.4f} "
              f"(<= {validate_cfg.max_mean_kld}), p99 {q['p99_kld']:.3f} (<= {validate_cfg.max_p99_kld}), max {q['max_kld']:.3f}; "
              f"top-1 agreement {q['top1_agreement']:.1%} (>= {validate_cfg.min_top1_agreement:.0%}); perplexity ratio "
              f"{q['ppl_ratio']:.3f} (<= {validate_cfg.max_ppl_ratio})", flush=True)
    if images:
        print(f"  images: {', '.join(images['sequences'])}, vision encoder error {images['vision_max_relative_error']:.2e}",
              flush=True)
    if speculative:
        if quantized:
            output = (f"{'follows' if speculative['follows_target_greedy'] else 'DOES NOT FOLLOW'} the target's greedy "
                      f"choice every round, {'equals' if speculative['equals_greedy'] else 'differs from (near ties)'} "
                      "the quantized eager model's greedy decoding")
        else:
            output = f"{'equals' if speculative['equals_greedy'] else 'DIFFERS FROM'} greedy"
        print(f"  speculative: {stats['speculative_rounds']} rounds, mean acceptance {speculative['mean_acceptance']:.2f} "
              f"tokens/round, draft error {speculative['draft_max_relative_error']:.2e}, output {output}", flush=True)
    if failures:
        raise ValidationFailed("validation failed: " + "; ".join(failures))
    return {"validation": report}


def _speculative_report(model, scripts: list[Script], tolerance: float, bound: str,
                        quantized: bool) -> tuple[dict, list[str]]:
    """Acceptance per sequence, the draft's logit error (within the target's bound), and the output
    against plain greedy decoding of the eager target (a fresh cache per sequence).

    A quantized target: the free-running comparison with the quantized eager model is reported, not
    held (the .pte and the oracle are two draws of the dynamic activation rounding, so a near tie may
    go either way and the continuations part, as they do without a draft: docs/design.md); what is
    held is that every round gave the .pte target's own greedy tokens (the proposals its verification
    logits' greedy choice agrees with, then its next token: ``Script.off_greedy_rounds``), the
    logits themselves held to the quantized oracle by ``validate.quant_tolerance``."""
    from pipeline.runtime.speculative import greedy_generate

    greedy = {s.seq_id: greedy_generate(model, s.prompt, len(s.generated), s.image_embedding) for s in scripts}
    differs = [s.seq_id for s in scripts if s.generated != greedy[s.seq_id]]
    draft_worst = max((e for s in scripts for e in s.draft_errors), default=0.0)
    rounds = [n for s in scripts for n in s.acceptance]
    report = {
        "equals_greedy": not differs,
        "draft_max_relative_error": draft_worst,
        "proposal_mismatches": sum(s.proposal_mismatches for s in scripts),  # rounds whose proposals differ from the eager draft's
        "mean_acceptance": sum(rounds) / max(len(rounds), 1),
        "acceptance": {s.seq_id: s.acceptance for s in scripts},
    }
    failures = []
    if quantized:
        off = {s.seq_id: s.off_greedy_rounds for s in scripts if s.off_greedy_rounds}
        report |= {
            "follows_target_greedy": not off,  # held: each round's tokens are the .pte target's greedy choice
            "rounds_off_target_greedy": off,
            # reported: where the output first leaves the quantized eager model's free-running greedy decoding
            "differs_from_greedy_at": {s.seq_id: next(i for i, (a, b) in enumerate(zip(s.generated, greedy[s.seq_id], strict=True))
                                                      if a != b) for s in scripts if s.seq_id in differs},
        }
        if off:
            failures.append(f"the speculative output of {', '.join(off)} is not the target's greedy output: "
                            f"{sum(off.values())} rounds kept tokens its own verification logits do not choose")
    elif differs:
        failures.append(f"the speculative output of {', '.join(differs)} differs from greedy decoding of the target")
    if draft_worst > tolerance:
        failures.append(f"the draft's max relative logit error {draft_worst:.3e} exceeds {bound}={tolerance}")
    return report, failures
