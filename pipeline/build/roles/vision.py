"""A vision encoder (config section ``vision``; built by ``export_vision``)."""

from pipeline.build.roles.base import (
    TARGET,
    VISION,
    VISION_ENCODER,
    MethodSpec,
    Role,
    impose_settings,
)
from pipeline.errors import ConfigError


class Vision(Role):
    """A vision encoder for one fixed square image size; its tokens replace placeholder embeddings."""

    name, section, stage = VISION, "vision", "export_vision"
    processor_dir = "image_processor"

    def impose(self, cfg, given):
        if not cfg.vision.checkpoint:
            return
        from pipeline.models.loaders.glimmer_vision import check_patches, read_config

        implied, out_dim = read_config(cfg.vision.checkpoint)
        source = f"vision.checkpoint={cfg.vision.checkpoint}"
        if out_dim != cfg.model.dim:
            raise ConfigError(f"{source} makes image tokens of width {out_dim}, but the target has model.dim={cfg.model.dim}: "
                              "image tokens replace token embeddings; choose the mmproj of this target")
        impose_settings(cfg, "vision", implied, given, source)
        check_patches(cfg.vision, cfg.vision.checkpoint)

    def args(self, cfg, parts):
        from pipeline.build.feasibility import check_vision

        return check_vision(cfg.vision, parts[TARGET].args)

    def check(self, cfg, part, parts, stages):
        if "export" in stages and self.stage not in stages:
            raise ConfigError(f"vision={cfg.vision.name} needs the export_vision stage: add it to stages "
                              "(stages=[export_vision,export,...]) or choose vision=none")

    def check_with_layouts(self, cfg, part, parts, stages):
        context = parts[TARGET].layout.max_seq_len
        if context is not None and part.args.n_image_tokens > context:
            raise ConfigError(f"an image is {part.args.n_image_tokens} tokens (vision.image_size={cfg.vision.image_size}), "
                              f"more than a sequence's context kv.capacity={context}; raise kv.capacity or lower "
                              "vision.image_size")

    def methods(self, cfg, part, parts, width, max_seqs):
        return [MethodSpec(VISION_ENCODER)]

    def manifest_section(self, cfg, part, parts):
        v, a = cfg.vision, part.args
        return {"family": v.family, "image_size": a.image_size, "num_channels": v.num_channels,
                "n_image_tokens": a.n_image_tokens, "image_token_id": v.image_token_id,
                "out_dim": v.out_dim or parts[TARGET].args.dim, "dtype": cfg.model.dtype,
                "patch_size": v.patch_size, "patch_temporal": v.patch_temporal, "image_processor": self.processor_dir}

    def constants(self, section, sections):
        return {"has_vision_encoder": 1, "get_max_image_tokens": section["n_image_tokens"],
                "get_image_size": section["image_size"], "get_image_token_id": section["image_token_id"],
                "get_vision_hidden_size": section["out_dim"]}

    def episode_spill(self, part):
        return part.args.n_image_tokens  # image sequences carry an image's tokens

    def build(self, cfg, part, built, workdir):
        from pipeline.models.methods import build_vision_model

        a = part.args
        print(f"  {cfg.vision.family} encoder: {a.image_size}x{a.image_size} images -> {a.n_image_tokens} tokens", flush=True)
        if workdir is not None:
            from pipeline.runtime.images import image_processor

            image_processor(a.image_size).save_pretrained(str(workdir / self.processor_dir))
        model = build_vision_model(cfg.vision, cfg.model)
        if cfg.vision.checkpoint:
            from pipeline.models.loaders.glimmer_vision import load_vision

            print(f"  load vision {cfg.vision.checkpoint}", flush=True)
            load_vision(model, cfg.vision.checkpoint)
        return model, {}

    def views(self, part, built):
        return {VISION_ENCODER: built[VISION]}

    def example_inputs(self, spec, part, parts, dtype, view):
        from pipeline.passes.lower_offgraph_kv import MethodInputs

        return MethodInputs((view.example_input().to(dtype),), None, None, None)
