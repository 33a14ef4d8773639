"""export: the eager models the ``export`` stage builds (the target and, with one, the draft: the
plan's parts whose role says ``export``) and their methods, traced with the neutral KV op.

gives: models ({role: eager module}: the oracle; the target quantized as ``quant`` says),
       exported ({method: ExportedProgram}),
       tokenizer (the checkpoint's, saved as tokenizer/; None without a checkpoint),
       quant (the quantization's report: scheme, group size, every quantized tensor's error)

With ``quant`` (``pipeline/quant``), the target's weights are quantized before it is traced, so the
methods carry torchao's quantized linears (dequantize + dynamic activation quantization, which
XNNPACK's quantized kernels take) and ExecuTorch's quantized embedding op.

Methods (Muse Glimmer's names, ``build/roles/``): ``embed_text``; ``target_forward_from_embeddings``,
one step of any width (prefill chunks, decodes, verification of draft blocks; with a draft it also
returns the tapped features); with a draft, ``draft_forward`` (context rows and blocks of every
sequence in one step). A separate prefill method (Muse Glimmer's ``target_prefill_from_embeddings``)
would be the same graph at another width compiled twice: the compile stage's time and memory double
for no speed (measured for the target in docs/benchmarks.md), so the one method takes both.

The export does not depend on the KV layout: its token axes are traced over ``EXPORT_WIDTH`` (a
symbolic bound only, ``BuildPlan.export_methods``), and lower_kv exports each method again with the
bounds of the layout it lowers to. So one export serves every ``kv.*`` of a sweep (the stage cache's
key for export holds no ``kv`` section).
"""

from pipeline.build.plan import BuildPlan
from pipeline.models.methods import build_models, export_methods


def run(plan: BuildPlan, inputs: dict, workdir) -> dict:
    built, extras = build_models(plan, "export", workdir)
    exported = export_methods(plan, "export", built)
    return {"models": built, "exported": exported, "tokenizer": extras.get("tokenizer"), "quant": extras["quant"]}
