"""The build plan: the composed config resolved once into a frozen value that everything downstream
reads (the stages, the cache keys' stage list, the dry run, build.json, the manifest, validation).

``resolve(cfg)`` makes every check that can be made from the config alone, each in one place and in
this order: unknown settings, the stage order, the closed sets (family, backend), the memory budget's
value, each role's settings (``roles/``: the target's shapes, the quantization, the draft against
the target, the vision encoder's), each attending role's KV layout (built here and only here), the
checks that need the layouts (an image against a sequence's context, the validation episode, the
build's memory) and the GPU a CUDA build needs. Torch is not imported (but for backend=cuda's GPU check).

``parts`` is the role table of this artifact: ``{role name: ModelPart}``, in build order. A model
is present by being in it.
"""

import copy
import dataclasses
from dataclasses import dataclass, field

from omegaconf import DictConfig

from pipeline.backends import Backend, backend, quantizing
from pipeline.build.roles import DRAFT, EXPORT_WIDTH, ROLES, TARGET, MethodSpec, Role
from pipeline.errors import ConfigError
from pipeline.kv.layouts import KVLayout, build_layout
from pipeline.quant import Scheme, scheme
from pipeline.stages import Stage, check_order


@dataclass(frozen=True, eq=False)
class ModelPart:
    """One model of the artifact: its role, its settings (``args``), its KV layout (None: it keeps no
    KV) and its methods with their bounds."""

    role: Role
    args: object
    layout: KVLayout | None = None
    methods: tuple[MethodSpec, ...] = ()

    @property
    def name(self) -> str:
        return self.role.name

    @property
    def store(self) -> str | None:
        return self.role.store


@dataclass(frozen=True, eq=False)
class BuildPlan:
    config: DictConfig  # the resolved config (the family's options and the checkpoint's settings imposed)
    stages: tuple[Stage, ...]
    parts: dict[str, ModelPart]
    backend: Backend
    quant: Scheme  # the target's weight quantization (pipeline/quant)
    memory: dict = field(default_factory=dict)  # the build's estimate (feasibility.memory_estimate)

    @property
    def target(self) -> ModelPart:
        return self.parts[TARGET]

    @property
    def stage_names(self) -> set[str]:
        return {s.name for s in self.stages}

    def built_by(self, stage: str) -> list[ModelPart]:
        return [p for p in self.parts.values() if p.role.stage == stage]

    def attending(self) -> list[ModelPart]:
        return [p for p in self.parts.values() if p.layout is not None]

    def method_owner(self) -> dict[str, ModelPart]:
        return {m.name: p for p in self.parts.values() for m in p.methods}

    def export_methods(self, part: ModelPart) -> list[MethodSpec]:
        """``part``'s methods as the export traces them: every token axis bounded by ``EXPORT_WIDTH``
        (no layout: lower_kv exports each method again with its layout's bounds, ``part.methods``)."""
        width = {name: EXPORT_WIDTH for name in self.parts}
        return part.role.methods(self.config, part, self.parts, width, EXPORT_WIDTH)

    def manifest_sections(self) -> dict[str, dict]:
        """Each model's section of manifest.json, from the plan alone."""
        return {name: p.role.manifest_section(self.config, p, self.parts) for name, p in self.parts.items()}


def resolve(cfg: DictConfig) -> BuildPlan:
    """Check ``cfg`` (already through ``resolve_model``) and resolve it into the build plan."""
    from pipeline.build.feasibility import check_episode, check_memory
    from pipeline.config import unknown_settings
    from pipeline.models.families import family
    from pipeline.quant import check as check_quant

    if unknown := unknown_settings(cfg):
        raise ConfigError(unknown[0])
    stages = check_order(list(cfg.stages))
    names = {s.name for s in stages}
    family(cfg.model.family)
    chosen = backend(cfg.backend.name)  # model.dtype, kv.dtype, validate.metric and .runtime: the schema's enums
    if cfg.memory_budget_gb is not None and not cfg.memory_budget_gb > 0:
        raise ConfigError(f"memory_budget_gb={cfg.memory_budget_gb} must be a positive number of GB (null: this machine's memory)")

    parts: dict[str, ModelPart] = {}
    for role in ROLES.values():
        if not role.present(cfg):
            continue
        part = ModelPart(role, role.args(cfg, parts))
        if role.name == TARGET:  # the target's quantization (a draft's: the draft role's check)
            draft = ROLES.get(DRAFT)
            check_quant(cfg.quant, part.args, cfg.model, chosen, quantizing(),
                        draft.preset(cfg) if draft is not None and draft.present(cfg) else None, cfg.validate)
        role.check(cfg, part, parts, names)
        parts[role.name] = part
    for name, part in parts.items():  # the one place layouts are built from the config
        rule = part.role.kv_rule(cfg, part, parts)
        if rule is not None:
            layout = build_layout(cfg.kv, part.args, rule.causal, rule.max_step_tokens, rule.step_width)
            parts[name] = dataclasses.replace(part, layout=layout)
    width = {name: p.layout.step_width for name, p in parts.items() if p.layout is not None}
    for name, part in parts.items():
        methods = tuple(part.role.methods(cfg, part, parts, width, cfg.kv.max_seqs))
        parts[name] = dataclasses.replace(part, methods=methods)
    for part in parts.values():
        part.role.check_with_layouts(cfg, part, parts, names)

    layouts = [p.layout for p in parts.values() if p.layout is not None]
    target = parts[TARGET]
    if "validate" in names:
        check_episode(cfg.validate, target.layout, sum(p.role.episode_spill(p) for p in parts.values()))
    memory = {}
    if "lower_kv" in names:  # the KV stores exist from lower_kv on
        memory = check_memory(layouts, target.args, cfg.model.dtype, cfg.memory_budget_gb)
    needs_gpu = {"compile", "validate"} & names
    if chosen.needs_gpu and needs_gpu:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"backend={chosen.name} needs a CUDA GPU for {' and '.join(sorted(needs_gpu))} (torch.cuda.is_available() "
                "is False); build on a GPU machine, stop after lower_kv (stages=[export,lower_kv]), or choose backend=xnnpack")
    return BuildPlan(cfg, tuple(stages), parts, chosen, scheme(cfg.quant.scheme), memory)


def resolve_model(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The config with the options of ``model.family`` and the settings ``model.checkpoint`` (and a
    draft's ``draft.checkpoint``) imply; an override that contradicts either is an error naming both values."""
    given = {o.lstrip("+").partition("=")[0] for o in overrides}
    cfg = copy.deepcopy(cfg)
    for role in ROLES.values():
        if role.present(cfg):
            role.impose(cfg, given)
        elif cfg[role.section].get("checkpoint"):
            raise ConfigError(f"{role.section}.checkpoint={cfg[role.section].checkpoint} is set but {role.section}=none: "
                              "choose one of its presets to build it (conf/" + role.section + "/), or drop the checkpoint")
    return cfg


def plan_of(cfg: DictConfig, overrides: list[str] | None = None) -> BuildPlan:
    """``resolve(resolve_model(cfg))``: a composed config's plan."""
    return resolve(resolve_model(cfg, overrides or []))
