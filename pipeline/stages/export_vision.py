"""export_vision: the vision encoder (the plan's parts whose role says ``export_vision``), traced as
the artifact's ``vision_encoder`` method for the exported image size (``vision.image_size``);
nothing without one (``vision=none``).

gives: vision_models ({role: the eager encoder}), vision_exported ({"vision_encoder": ExportedProgram}),
       image_processor/ (its settings, transformers' format)

The method takes the image processor's pixels [1, 3, image_size, image_size] (smolvlm) or their
patches [1, P, patch_dim] (muse_glimmer: ExecuTorch's ``patchify_image`` on the host) and returns the
image tokens [1, n_image_tokens, target width]; the session splices them over a prompt's placeholders.
"""

from pipeline.build.plan import BuildPlan
from pipeline.models.methods import build_models, export_methods


def run(plan: BuildPlan, inputs: dict, workdir) -> dict:
    built, _ = build_models(plan, "export_vision", workdir)
    return {"vision_models": built, "vision_exported": export_methods(plan, "export_vision", built)}
