"""A DFlash draft over the target (config section ``draft``; built by ``export``)."""

from pipeline.build.roles.base import (
    DRAFT,
    DRAFT_STEP,
    STORE_MODULE,
    TARGET,
    KVRule,
    MethodSpec,
    Role,
    _dim,
    impose_settings,
    kv_section,
)
from pipeline.errors import ConfigError


class Draft(Role):
    """A DFlash draft over the target: its width, embeddings and output head are the target's."""

    name, section, stage, store, constant_prefix = DRAFT, "draft", "export", f"{DRAFT}_{STORE_MODULE}", "get_draft_"

    def impose(self, cfg, given):
        if not cfg.draft.checkpoint:
            return
        from pipeline.models.loaders.dflash import read_config

        implied = read_config(cfg.draft.checkpoint)
        source = f"draft.checkpoint={cfg.draft.checkpoint}"
        for key, want in (("hidden_size", cfg.model.dim), ("vocab_size", cfg.model.vocab_size)):
            got = implied.pop(key, want)  # a DFlash GGUF does not say its vocabulary
            if got != want:
                setting = "model.dim" if key == "hidden_size" else "model.vocab_size"
                raise ConfigError(f"{source} has {key}={got}, but the target has {setting}={want}: the draft shares the "
                                  "target's embeddings and head; choose a draft trained for this target")
        impose_settings(cfg, "draft", implied, given, source)

    def args(self, cfg, parts):
        from pipeline.models.args import draft_args

        return draft_args(cfg.draft, parts[TARGET].args)

    def check(self, cfg, part, parts, stages):
        from pipeline.build.feasibility import check_draft
        from pipeline.kv.layouts import KVConfigError
        from pipeline.quant import check_draft as check_quant
        from pipeline.quant import scheme

        check_draft(part.args, parts[TARGET].args, cfg.draft)
        check_quant(cfg.quant, part.args, cfg.draft)
        if cfg.quant.draft and scheme(cfg.quant.scheme).quantized and cfg.kv.layout == "cell":
            # measured: XNNPACK's partitioner finds a dependency cycle in the cell layout's quantized draft step
            raise ConfigError("quant.draft=true with kv=cell cannot be compiled: XNNPACK's partitioner finds a "
                              "dependency cycle in the quantized draft's step; use kv=sequence, or drop quant.draft "
                              "(the draft's linears stay in float)")
        block, step = part.args.block_size, cfg.kv.max_step_tokens
        if block > step:
            raise KVConfigError(f"draft.block_size={block} is more than kv.max_step_tokens={step}: a verification step "
                                "feeds a block per sequence; raise kv.max_step_tokens or lower draft.block_size")

    def kv_rule(self, cfg, part, parts):
        # a step holds each sequence's new context rows (at most a block) and its block; non-causal
        width = max(cfg.kv.max_step_tokens, 2 * cfg.kv.max_seqs * part.args.block_size)
        return KVRule(False, width, width)

    def methods(self, cfg, part, parts, width, max_seqs):
        return [MethodSpec(DRAFT_STEP, width[DRAFT], width[DRAFT])]

    def manifest_section(self, cfg, part, parts):
        a = part.args
        return kv_section(part.layout, parts[TARGET].args.vocab_size) | {
            "block_size": a.block_size, "mask_token_id": a.mask_token_id, "target_layer_ids": list(a.target_layer_ids),
            "feature_dim": a.feature_dim, "feature_dtype": cfg.model.dtype}

    def constants(self, section, sections):
        from pipeline.kv.layouts import layout_from_manifest

        kv = {f"{self.constant_prefix}{name.removeprefix('get_')}": value
              for name, value in layout_from_manifest(section).constants().items()}
        return kv | {f"{self.constant_prefix}offgraph_kv_causal": int(section["causal"]),
                     "get_block_size": section["block_size"], "get_mask_token_id": section["mask_token_id"],
                     "get_n_target_layers": len(section["target_layer_ids"]),
                     "get_target_layer_ids": list(section["target_layer_ids"])}

    def episode_spill(self, part):
        return part.args.block_size - 1  # a speculative round may write a block past the last token it keeps

    def build(self, cfg, part, built, workdir):
        import torch

        from pipeline.models.methods import build_draft_model

        draft = build_draft_model(cfg.draft, built[TARGET].args).to(getattr(torch, cfg.model.dtype))
        if not cfg.quant.draft:  # its own linears stay in float; its embedding and head are the target's
            return draft, {}
        from pipeline.quant.apply import quantize_draft

        report = quantize_draft(draft, cfg.quant)
        print(f"  quantized {len(report['tensors'])} draft tensors: {report['describe']} (max relative rms error "
              f"{report['max_relative_rms_error']:.2e})", flush=True)
        return draft, {"quant": {DRAFT: report}}  # added to the target's report (build_models)

    def views(self, part, built):
        from pipeline.models.dflash import DraftForward

        return {DRAFT_STEP: DraftForward(built[TARGET], built[DRAFT])}

    def example_inputs(self, spec, part, parts, dtype, view):
        import torch

        from pipeline.passes.lower_offgraph_kv import MethodInputs

        rows = spec.width
        n_draft = _dim("n_draft_tokens", rows)  # at least 2 rows: a context row and a block row
        return MethodInputs(
            (torch.zeros(1, rows, part.args.feature_dim, dtype=dtype), torch.zeros(rows, dtype=torch.int64),
             torch.zeros(rows, dtype=torch.int64), torch.arange(rows), torch.arange(2)),
            ({1: n_draft}, {0: n_draft}, {0: n_draft}, {0: n_draft}, {0: _dim("n_draft_rows", spec.rows)}),
            n_draft, self.store, positions_arg=3)
