"""Model roles: the models an artifact may hold, one row each.

| role   | config  | built by      | KV stores        | methods                                            |
|--------|---------|---------------|------------------|----------------------------------------------------|
| target | model   | export        | kv_store.*       | embed_text, target_forward_from_embeddings         |
| draft  | draft   | export        | draft_kv_store.* | draft_forward                                      |
| vision | vision  | export_vision | none             | vision_encoder                                     |

A role answers, from the config alone (no torch): whether the build has it (``present``), its
settings (``args``) and their checks, its KV layout's rule (``kv_rule``: causality, step width), its
methods and their bounds, its manifest section and its constant methods; and at build time (torch):
its eager module, the views ``torch.export`` traces and their example inputs. The plan
(``pipeline/build/plan.py``) holds one ``ModelPart`` per present role; stages, the manifest and the
session go through the parts, so a new role (a second draft, an audio encoder) is one class here
(``register``) plus its config group.

Role names are defined here (``TARGET``, ``DRAFT``, ``VISION``) and written into the manifest; the
rest of the package refers to them through these constants.
"""

from dataclasses import dataclass
from typing import ClassVar

from pipeline.errors import ConfigError

TARGET, DRAFT, VISION = "target", "draft", "vision"
ABSENT = "none"  # a config group's option for "this artifact has no such model"

# the artifact's method names (Muse Glimmer's), by the role that runs them
EMBED = "embed_text"
TARGET_STEP = "target_forward_from_embeddings"
DRAFT_STEP = "draft_forward"
VISION_ENCODER = "vision_encoder"

EXPORT_WIDTH = 64  # the export's token axes' upper bound (any width > 1 traces the same graph)
STORE_MODULE = "kv_store"  # the target's stores are buffers kv_store.k_<layer>, kv_store.v_<layer>


@dataclass(frozen=True)
class MethodSpec:
    """One method of a role: its name and bounds (``width``: most tokens of a step, ``rows``: most
    logit rows); ``example_inputs`` makes its torch inputs from these."""

    name: str
    width: int = 0
    rows: int = 0


@dataclass(frozen=True)
class KVRule:
    """What a role's KV layout needs beyond the ``kv`` config: its attention's causality, the widest
    step its layout bounds (``max_step_tokens``) and its step method's token axis (``step_width``)."""

    causal: bool
    max_step_tokens: int
    step_width: int


class Role:
    """One row of the role table; subclasses fill in what differs."""

    name: ClassVar[str]
    section: ClassVar[str]  # its config section (and Hydra group)
    stage: ClassVar[str]  # the stage that builds and exports it
    required: ClassVar[bool] = False  # every artifact has it (the target)
    store: ClassVar[str | None] = None  # prefix of its KV store buffers; None: it keeps no KV
    constant_prefix: ClassVar[str] = "get_"  # its KV constant methods' prefix

    def __repr__(self) -> str:
        return f"<role {self.name}>"

    # --- from the config (torch-free) ---

    def present(self, cfg) -> bool:
        """The one place a config's ``none`` option means "no such model"."""
        return self.required or cfg[self.section].name != ABSENT

    def preset(self, cfg) -> str:
        return cfg[self.section].name

    def impose(self, cfg, given: set[str]) -> None:
        """Write into ``cfg`` (a copy) the settings this role's family or checkpoint imply; an override
        (``given``: the command line's keys) that contradicts one is an error naming both values."""

    def args(self, cfg, parts: dict):
        raise NotImplementedError

    def check(self, cfg, part, parts: dict, stages: set[str]) -> None:
        """Refusals of this role's settings (after its args are derived, before any layout)."""

    def check_with_layouts(self, cfg, part, parts: dict, stages: set[str]) -> None:
        """Refusals that need the layouts (an image's tokens against a sequence's context)."""

    def kv_rule(self, cfg, part, parts: dict) -> KVRule | None:
        return None

    def methods(self, cfg, part, parts: dict, width: dict, max_seqs: int) -> list[MethodSpec]:
        """Its methods with their bounds, ``width[role]`` being each attending role's step width."""
        raise NotImplementedError

    def manifest_section(self, cfg, part, parts: dict) -> dict:
        raise NotImplementedError

    def constants(self, section: dict, sections: dict) -> dict:
        """Its constant methods of the program, from the manifest's sections."""
        return {}

    def episode_spill(self, part) -> int:
        """Tokens a validation sequence may carry beyond its prompt and decodes because of this role."""
        return 0

    # --- at build time (torch) ---

    def build(self, cfg, part, built: dict, workdir) -> tuple:
        """The eager module (random from its seed or loaded) and what the stage gives beside it."""
        raise NotImplementedError

    def views(self, part, built: dict) -> dict:
        """{method: nn.Module} that ``torch.export`` traces."""
        raise NotImplementedError

    def example_inputs(self, spec: MethodSpec, part, parts: dict, dtype, view):
        """``MethodInputs`` of ``spec`` (``pipeline/passes/lower_offgraph_kv.py``); ``view``: the module traced."""
        raise NotImplementedError


def _dim(name: str, upper: int):
    # A dimension that can only be 1 is exported static: torch.export rejects min == max.
    from torch.export import Dim

    return Dim(name, min=1, max=upper) if upper > 1 else Dim.STATIC


def kv_section(layout, vocab_size: int) -> dict:
    """The manifest's KV facts of one attending role."""
    return {
        "layout": layout.layout,
        "vocab_size": vocab_size,  # token ids a step takes: [0, vocab_size)
        "max_seqs": layout.max_seqs,
        "max_seq_len": layout.max_seq_len,
        "max_segments": layout.max_segments,
        "causal": layout.causal,
        "columns": layout.columns,
        "capacity": layout.capacity,
        "max_step_tokens": layout.max_step_tokens,
        "step_width": layout.step_width,
        "dtype": layout.dtype,
        "n_kv_heads": layout.n_kv_heads,
        "head_dim": layout.head_dim,
        "layers": [
            {"kind": layer.kind, "rows": layer.rows, "window": layer.window, "store_shape": list(layout.store_shape(layer))}
            for layer in layout.layers
        ],
        "step_buffers": [{"name": b.name, "shape": list(b.shape), "dtype": b.dtype} for b in layout.step_buffers()],
        "kv_bytes_per_layer": layout.kv_bytes_per_layer(),
        "kv_bytes_total": sum(layout.kv_bytes_per_layer()),
    }


class Target(Role):
    name, section, stage, required, store = TARGET, "model", "export", True, STORE_MODULE

    def impose(self, cfg, given):
        from pipeline.models.families import family

        def impose(settings: dict, source: str) -> None:
            for key, value in settings.items():
                if f"model.{key}" in given and cfg.model[key] != value:
                    raise ConfigError(f"model.{key}={cfg.model[key]} contradicts {source}, which has {key}={value}; "
                                      "drop the override")
            cfg.model.merge_with(settings)

        if cfg.model.checkpoint:
            from pipeline.models.loaders import checkpoint_config

            name, implied = checkpoint_config(cfg.model.checkpoint)
            impose({"family": name, **implied}, f"model.checkpoint={cfg.model.checkpoint}")
        impose(family(cfg.model.family).options, f"model.family={cfg.model.family}")

    def args(self, cfg, parts):
        from pipeline.build.feasibility import check_model
        from pipeline.models.args import model_args

        args = model_args(cfg.model)
        check_model(args)
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

        from pipeline.models.methods import build_target
        from pipeline.quant import quantize, scheme

        model, tokenizer = build_target(cfg.model, workdir)
        model = model.to(getattr(torch, cfg.model.dtype))
        report = quantize(model, cfg.quant, cfg.model)
        if scheme(cfg.quant.scheme).quantized:
            print(f"  quantized {len(report['tensors'])} tensors: {report['describe']} (max relative rms error "
                  f"{report['max_relative_rms_error']:.2e})", flush=True)
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
            got = implied.pop(key)
            if got != want:
                setting = "model.dim" if key == "hidden_size" else "model.vocab_size"
                raise ConfigError(f"{source} has {key}={got}, but the target has {setting}={want}: the draft shares the "
                                  "target's embeddings and head; choose a draft trained for this target")
        for key, value in implied.items():
            if f"draft.{key}" in given and cfg.draft[key] != value:
                raise ConfigError(f"draft.{key}={cfg.draft[key]} contradicts {source}, which has {key}={value}; "
                                  "drop the override")
        cfg.draft.merge_with(implied)

    def args(self, cfg, parts):
        from pipeline.models.args import draft_args

        return draft_args(cfg.draft, parts[TARGET].args)

    def check(self, cfg, part, parts, stages):
        from pipeline.build.feasibility import check_draft
        from pipeline.kv.layouts import KVConfigError

        check_draft(part.args, parts[TARGET].args, cfg.draft)
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

        return build_draft_model(cfg.draft, built[TARGET].args).to(getattr(torch, cfg.model.dtype)), {}

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


class Vision(Role):
    """A vision encoder for one fixed square image size; its tokens replace placeholder embeddings."""

    name, section, stage = VISION, "vision", "export_vision"
    processor_dir = "image_processor"

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
        return build_vision_model(cfg.vision, cfg.model), {}

    def views(self, part, built):
        return {VISION_ENCODER: built[VISION]}

    def example_inputs(self, spec, part, parts, dtype, view):
        from pipeline.passes.lower_offgraph_kv import MethodInputs

        return MethodInputs((view.example_input().to(dtype),), None, None, None)


ROLES: dict[str, Role] = {}


def register(role: Role) -> Role:
    """Add a role to the table (in build order: a role may use the parts of those before it)."""
    if role.name in ROLES:
        raise ValueError(f"role {role.name!r} is already registered")
    ROLES[role.name] = role
    return role


def unregister(name: str) -> None:
    ROLES.pop(name)


for _role in (Target(), Draft(), Vision()):
    register(_role)
