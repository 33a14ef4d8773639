"""The target: the model the artifact serves (config section ``model``; built by ``export``)."""

from pipeline.build.roles.base import (
    DRAFT,
    EMBED,
    STORE_MODULE,
    TARGET,
    TARGET_STEP,
    KVRule,
    MethodSpec,
    Role,
    _dim,
    impose_settings,
    kv_section,
)


class Target(Role):
    name, section, stage, required, store = TARGET, "model", "export", True, STORE_MODULE

    def impose(self, cfg, given):
        from pipeline.models.families import family

        def impose(settings: dict, source: str) -> None:
            impose_settings(cfg, "model", settings, given, source)

        if cfg.model.checkpoint:
            from pipeline.models.loaders import checkpoint_config

            name, implied = checkpoint_config(cfg.model.checkpoint)
            impose({"family": name, **implied}, f"model.checkpoint={cfg.model.checkpoint}")
        if cfg.model.tokenizer:  # random weights (or a checkpoint's) speaking another file's tokenizer
            from pipeline.models.tokenizer import vocabulary_size

            impose({"vocab_size": vocabulary_size(cfg.model.tokenizer)}, f"model.tokenizer={cfg.model.tokenizer}")
        fam = family(cfg.model.family)
        impose(fam.options, f"model.family={cfg.model.family}")
        if fam.derive is not None:  # settings the family derives where the config leaves them 0
            cfg.model.merge_with(fam.derive(cfg.model))

    def args(self, cfg, parts):
        from pipeline.build.feasibility import check_model
        from pipeline.models.args import model_args

        args = model_args(cfg.model)
        check_model(args, cfg.kv.capacity)  # None: derived after the roles' checks, its RoPE checked then (plan)
        return args

    def kv_rule(self, cfg, part, parts):
        kv = cfg.kv
        width = max(kv.max_step_tokens, kv.max_seqs)
        if DRAFT in parts:  # a step also verifies a block of every sequence
            width = max(width, kv.max_seqs * parts[DRAFT].args.block_size)
        return KVRule(bool(cfg.model.causal), kv.max_step_tokens, width)

    def methods(self, cfg, part, parts, width, max_seqs):
        # logits for the sampler's rows: one per sequence, or every row of a verification step
        rows = max(max_seqs, width[TARGET] if DRAFT in parts else 1)
        return [MethodSpec(EMBED, width[TARGET]), MethodSpec(TARGET_STEP, width[TARGET], rows)]

    def manifest_section(self, cfg, part, parts):
        return kv_section(part.layout, part.args.vocab_size)

    def constants(self, section, sections):
        from pipeline.kv.layouts import layout_from_manifest

        layout = layout_from_manifest(section)
        return {"get_vocab_size": section["vocab_size"], "get_offgraph_kv_max_segments": layout.max_segments,
                "get_offgraph_kv_causal": int(layout.causal), "get_max_step_tokens": layout.max_step_tokens
                } | layout.constants()

    def build(self, cfg, part, built, workdir):
        import torch

        from pipeline.models.fuse import fuse_projections
        from pipeline.models.methods import build_target
        from pipeline.quant import scheme
        from pipeline.quant.apply import quantize

        model, tokenizer = build_target(cfg.model, workdir)
        model = model.to(getattr(torch, cfg.model.dtype))
        report = quantize(model, cfg.quant, cfg.model)
        if scheme(cfg.quant.scheme).quantized:
            print(f"  quantized {len(report['tensors'])} tensors: {report['describe']} (max relative rms error "
                  f"{report['max_relative_rms_error']:.2e})", flush=True)
        fused = fuse_projections(model)  # q/k/v and gate/up as one linear each: the input read (and quantized) once
        if fused:
            print(f"  fused {fused} projections (q/k/v, gate/up) into one linear each", flush=True)
        return model, {"tokenizer": tokenizer, "quant": report}

    def views(self, part, built):
        from pipeline.models.transformer import EmbedText, TargetForward

        model = built[TARGET]
        taps = built[DRAFT].args.target_layer_ids if DRAFT in built else ()
        return {EMBED: EmbedText(model), TARGET_STEP: TargetForward(model, taps)}

    def example_inputs(self, spec, part, parts, dtype, view):
        import torch

        from pipeline.passes.lower_offgraph_kv import MethodInputs

        n_tokens = _dim("n_tokens", spec.width)
        if spec.name == EMBED:
            return MethodInputs((torch.zeros(spec.width, dtype=torch.int64),), ({0: n_tokens},), n_tokens, self.store)
        return MethodInputs(
            (torch.zeros(1, spec.width, part.args.dim, dtype=dtype), torch.arange(spec.width), torch.arange(spec.rows)),
            ({1: n_tokens}, {0: n_tokens}, {0: _dim("n_rows", spec.rows)}), n_tokens, self.store)
