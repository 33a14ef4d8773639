"""export_vision: the vision encoder, traced as the artifact's ``vision_encoder`` method for the
exported image size (``vision.image_size``); nothing without a vision encoder (``vision=none``).

gives: vision (the eager encoder, or None), vision_exported ({"vision_encoder": ExportedProgram}),
       vision_section (the manifest's ``vision`` section), image_processor/ (its settings, transformers' format)

The method takes the image processor's pixels [1, 3, image_size, image_size] (smolvlm) or their
patches [1, P, patch_dim] (muse_glimmer: ExecuTorch's ``patchify_image`` on the host) and returns the
image tokens [1, n_image_tokens, target width]; the session splices them over a prompt's placeholders.
"""

import torch

from pipeline.config import ModelConfig, VisionConfig
from pipeline.kv.manifest import VISION
from pipeline.models.args import model_args, vision_args


def build_vision_model(vision_cfg: VisionConfig, model_cfg: ModelConfig):
    """The encoder random from its seed, at the target's width and dtype; None without one."""
    if vision_cfg.name == "none":
        return None
    from pipeline.models.vision import build_vision

    return build_vision(vision_args(vision_cfg, model_args(model_cfg)), vision_cfg.seed).to(getattr(torch, model_cfg.dtype))


def run(vision_cfg: VisionConfig, model_cfg: ModelConfig, inputs: dict, workdir) -> dict:
    vision = build_vision_model(vision_cfg, model_cfg)
    if vision is None:
        return {"vision": None, "vision_exported": {}, "vision_section": None}
    a = vision.args
    example = vision.example_input().to(next(vision.parameters()).dtype)
    print(f"  export {VISION} ({vision_cfg.family}, {a.image_size}x{a.image_size} -> {a.n_image_tokens} image tokens)",
          flush=True)
    with torch.no_grad():
        ep = torch.export.export(vision, (example,), strict=False)
    section = {"family": vision_cfg.family, "image_size": a.image_size, "num_channels": vision_cfg.num_channels,
               "n_image_tokens": a.n_image_tokens, "image_token_id": vision_cfg.image_token_id,
               "out_dim": vision_cfg.out_dim or model_args(model_cfg).dim, "dtype": model_cfg.dtype,
               "patch_size": vision_cfg.patch_size, "patch_temporal": vision_cfg.patch_temporal, "image_processor": None}
    if workdir is not None:
        from pipeline.runtime.images import image_processor

        image_processor(a.image_size).save_pretrained(str(workdir / "image_processor"))
        section["image_processor"] = "image_processor"
    return {"vision": vision, "vision_exported": {VISION: ep}, "vision_section": section}
