"""The models of a build plan's parts, built and their methods traced: what the export stages do,
each for the parts its role assigns to it (``BuildPlan.built_by``)."""

from pathlib import Path

import torch


def build_target(model_cfg, workdir: Path | None) -> tuple:
    """The target in float32, random from its seed or loaded from its checkpoint, and the checkpoint's
    tokenizer, or ``model.tokenizer``'s (saved into ``workdir``; None without either or without a workdir)."""
    from pipeline.models.args import model_args
    from pipeline.models.families import family
    from pipeline.models.loaders import load_into
    from pipeline.models.tokenizer import save_tokenizer
    from pipeline.models.transformer import build_model

    model = build_model(model_args(model_cfg), model_cfg.seed)
    tokenizer = None
    if model_cfg.checkpoint:
        print(f"  load {model_cfg.checkpoint}", flush=True)
        load_into(model, model_cfg.checkpoint, family(model_cfg.family))
    source = model_cfg.tokenizer or model_cfg.checkpoint
    if source and workdir is not None:
        setting = "model.tokenizer" if model_cfg.tokenizer else "model.checkpoint"
        tokenizer = save_tokenizer(source, Path(workdir), setting)
    return model, tokenizer


def build_draft_model(draft_cfg, target_args):
    """The DFlash draft over the target, random from its seed or loaded from its checkpoint directory."""
    from pipeline.models.args import draft_args
    from pipeline.models.dflash import build_draft

    draft = build_draft(draft_args(draft_cfg, target_args), draft_cfg.seed)
    if draft_cfg.checkpoint:
        from pipeline.models.loaders.dflash import load_draft

        print(f"  load draft {draft_cfg.checkpoint}", flush=True)
        load_draft(draft, draft_cfg.checkpoint)
    return draft


def build_vision_model(vision_cfg, model_cfg):
    """The vision encoder random from its seed, at the target's width and dtype."""
    from pipeline.models.args import model_args, vision_args
    from pipeline.models.vision import build_vision

    return build_vision(vision_args(vision_cfg, model_args(model_cfg)), vision_cfg.seed).to(getattr(torch, model_cfg.dtype))


def build_models(plan, stage: str, workdir: Path | None) -> tuple[dict, dict]:
    """The eager modules of the parts ``stage`` builds, in the role table's order, and what their
    roles give beside them (the tokenizer, the quantization report: a later role's entries of a report
    are added to an earlier role's, as a quantized draft's to the target's)."""
    built, extras = {}, {}
    for part in plan.built_by(stage):
        built[part.name], given = part.role.build(plan.config, part, built, workdir)
        for key, value in given.items():
            extras[key] = extras[key] | value if isinstance(value, dict) and isinstance(extras.get(key), dict) else value
    return built, extras


def export_methods(plan, stage: str, built: dict) -> dict:
    """Every method of the parts ``stage`` builds, traced over the export's bounds."""
    dtype = getattr(torch, plan.config.model.dtype)
    exported = {}
    for part in plan.built_by(stage):
        views = part.role.views(part, built)
        for spec in plan.export_methods(part):
            inputs = part.role.example_inputs(spec, part, plan.parts, dtype, views[spec.name])
            print(f"  export {spec.name}", flush=True)
            with torch.no_grad():
                exported[spec.name] = torch.export.export(views[spec.name], inputs.args, dynamic_shapes=inputs.dynamic_shapes,
                                                          strict=False)
    return exported


def lower_methods(plan, exported: dict) -> dict:
    """Every exported method again with its part's bounds (``ModelPart.methods``); those that attend
    through ``LowerOffGraphKVPass`` over their part's layout, with the backend's attention kernel."""
    from pipeline.passes.lower_offgraph_kv import count_neutral, lower_offgraph_kv, unlifted

    kernel = plan.backend.attention_kernel()
    dtype = getattr(torch, plan.config.model.dtype)
    owner = plan.method_owner()
    lowered = {}
    for name, ep in exported.items():
        part = owner[name]
        spec = part.role.example_inputs(next(m for m in part.methods if m.name == name), part, plan.parts, dtype, None)
        if count_neutral(ep) == 0:  # embed_text reads no cache: only the layout's bounds
            with torch.no_grad():
                lowered[name] = torch.export.export(unlifted(ep), spec.args, dynamic_shapes=spec.dynamic_shapes, strict=False)
            continue
        print(f"  lower {name}: {count_neutral(ep)} update_and_attend -> {part.name} {part.layout.layout} store + attention",
              flush=True)
        lowered[name] = lower_offgraph_kv(ep, part.layout, spec, kernel)
    return lowered


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's elements as raw bytes, for hashing: any dtype (numpy has no bfloat16), any device."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def weights_sha256(module) -> str:
    """sha256 of a module's state, name by name (a quantized weight: its integers and scales)."""
    import hashlib

    digest = hashlib.sha256()
    for tensor_name, tensor in sorted(module.state_dict().items()):
        digest.update(tensor_name.encode())
        if hasattr(tensor, "__tensor_flatten__"):  # a quantized weight (torchao)
            for inner in tensor.__tensor_flatten__()[0]:
                digest.update(tensor_bytes(getattr(tensor, inner)))
        else:
            digest.update(tensor_bytes(tensor))
    return digest.hexdigest()
