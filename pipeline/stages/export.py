"""export: the eager models and their methods, traced with the neutral KV op.

gives: model (the target: the eager oracle and its args; quantized as ``quant`` says), draft (the eager
       DFlash draft, or None), exported ({method: ExportedProgram}),
       tokenizer (the checkpoint's, saved as tokenizer/; None without a checkpoint),
       quant (the quantization's report: scheme, group size, every quantized tensor's error)

With ``quant`` (``pipeline/quant``), the target's weights are quantized before it is traced, so the
methods carry torchao's quantized linears (dequantize + dynamic activation quantization, which
XNNPACK's quantized kernels take) and ExecuTorch's quantized embedding op.

Methods (Muse Glimmer's names): ``embed_text``; ``target_forward_from_embeddings``, one step of any
width (prefill chunks, decodes, verification of draft blocks; with a draft it also returns the tapped
features); with a draft, ``draft_forward`` (context rows and blocks of every sequence in one step).
A separate prefill method (Muse Glimmer's ``target_prefill_from_embeddings`` / ``draft_prefill``)
would be the same graph at another width compiled twice: the compile stage's time and memory double
for no speed (measured for the target in docs/benchmarks.md), so the one method takes both.

The export does not depend on the KV layout: its token axes are traced over ``EXPORT_WIDTH`` (a
symbolic bound only), and lower_kv exports each method again with the bounds of the layout it
lowers to (``method_inputs``). So one export serves every ``kv.*`` of a sweep (the stage cache's key
for export holds no ``kv`` section).
"""

from pathlib import Path

import torch
from torch.export import Dim

from pipeline.config import DraftConfig, ModelConfig, QuantConfig
from pipeline.kv.manifest import DRAFT_STEP, EMBED, TARGET_STEP
from pipeline.models.args import DraftArgs, ModelArgs, draft_args, model_args
from pipeline.models.families import family
from pipeline.models.loaders import load_into
from pipeline.models.tokenizer import save_tokenizer
from pipeline.models.transformer import EmbedText, TargetForward, build_model
from pipeline.passes.lower_offgraph_kv import MethodInputs

EXPORT_WIDTH = 64  # the traced token axes' upper bound: any width > 1 traces the same graph


def _dim(name: str, upper: int):
    # A dimension that can only be 1 is exported static: torch.export rejects min == max.
    return Dim(name, min=1, max=upper) if upper > 1 else Dim.STATIC


def method_inputs(args: ModelArgs, widths: dict[str, int], max_seqs: int, dtype=torch.float32,
                  draft: DraftArgs | None = None) -> dict[str, MethodInputs]:
    """Example inputs and dynamic shapes of every method; ``widths``: each attending model's step width."""
    width = widths["target"]
    n_tokens = _dim("n_tokens", width)
    # logits for the sampler's rows: one per sequence, or every row of a verification step
    rows = max(max_seqs, width if draft else 1)
    n_rows = _dim("n_rows", rows)
    methods = {
        EMBED: MethodInputs((torch.zeros(width, dtype=torch.int64),), ({0: n_tokens},), n_tokens),
        TARGET_STEP: MethodInputs(
            (torch.zeros(1, width, args.dim, dtype=dtype), torch.arange(width), torch.arange(rows)),
            ({1: n_tokens}, {0: n_tokens}, {0: n_rows}), n_tokens),
    }
    if draft is not None:
        rows = widths["draft"]
        n_draft = _dim("n_draft_tokens", rows)  # at least 2 rows: a context row and a block row
        methods[DRAFT_STEP] = MethodInputs(
            (torch.zeros(1, rows, draft.feature_dim, dtype=dtype), torch.zeros(rows, dtype=torch.int64),
             torch.zeros(rows, dtype=torch.int64), torch.arange(rows), torch.arange(2)),
            ({1: n_draft}, {0: n_draft}, {0: n_draft}, {0: n_draft}, {0: _dim("n_draft_rows", rows)}),
            n_draft, model="draft", positions_arg=3)
    return methods


def build_target(model_cfg: ModelConfig, workdir) -> tuple:
    """The target, random from its seed or loaded from its checkpoint, and the checkpoint's tokenizer."""
    model = build_model(model_args(model_cfg), model_cfg.seed)
    tokenizer = None
    if model_cfg.checkpoint:
        print(f"  load {model_cfg.checkpoint}", flush=True)
        load_into(model, model_cfg.checkpoint, family(model_cfg.family))
        if workdir is not None:
            tokenizer = save_tokenizer(model_cfg.checkpoint, Path(workdir))
    return model, tokenizer


def build_draft_model(draft_cfg: DraftConfig, target_args: ModelArgs):
    """The draft over the target, random from its seed or loaded from its DFlash checkpoint; None without one."""
    if draft_cfg.name == "none":
        return None
    from pipeline.models.dflash import build_draft

    draft = build_draft(draft_args(draft_cfg, target_args), draft_cfg.seed)
    if draft_cfg.checkpoint:
        from pipeline.models.loaders.dflash import load_draft

        print(f"  load draft {draft_cfg.checkpoint}", flush=True)
        load_draft(draft, draft_cfg.checkpoint)
    return draft


def export_inputs(args: ModelArgs, dtype=torch.float32, draft: DraftArgs | None = None) -> dict[str, MethodInputs]:
    """``method_inputs`` of no layout: every token axis dynamic up to ``EXPORT_WIDTH``."""
    return method_inputs(args, {"target": EXPORT_WIDTH, "draft": EXPORT_WIDTH}, EXPORT_WIDTH, dtype, draft)


def run(model_cfg: ModelConfig, draft_cfg: DraftConfig, quant_cfg: QuantConfig, inputs: dict, workdir) -> dict:
    from pipeline.quant import quantize

    dtype = getattr(torch, model_cfg.dtype)
    model, tokenizer = build_target(model_cfg, workdir)
    model = model.to(dtype)
    report = quantize(model, quant_cfg, model_cfg)
    if report["scheme"] != "none":
        print(f"  quantized {len(report['tensors'])} tensors: {report['describe']} (max relative rms error "
              f"{report['max_relative_rms_error']:.2e})", flush=True)
    draft = build_draft_model(draft_cfg, model.args)
    draft = draft.to(dtype) if draft is not None else None
    views = {EMBED: EmbedText(model),
             TARGET_STEP: TargetForward(model, draft.args.target_layer_ids if draft else ())}
    if draft is not None:
        from pipeline.models.dflash import DraftForward

        views[DRAFT_STEP] = DraftForward(model, draft)
    exported = {}
    for name, spec in export_inputs(model.args, dtype, draft.args if draft else None).items():
        print(f"  export {name}", flush=True)
        with torch.no_grad():
            exported[name] = torch.export.export(views[name], spec.args, dynamic_shapes=spec.dynamic_shapes, strict=False)
    return {"model": model, "draft": draft, "exported": exported, "tokenizer": tokenizer, "quant": report}
