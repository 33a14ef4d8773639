"""The build plan: the composed config resolved once into a frozen value that everything downstream
reads (the stages, the cache keys' stage list, the dry run, build.json, the manifest, validation).

``resolve(cfg)`` makes every check that can be made from the config alone, each in one place and in
this order: unknown settings, the stage order, the closed sets (family, backend), the memory budget's
value, each role's settings (``roles/``: the target's shapes, the quantization, the draft against
the target, the vision encoder's), each attending role's KV layout (built here and only here, at the ``kv.max_step_tokens`` and
``kv.capacity`` that ``build/context.py`` derives where the config leaves them null), the
checks that need the layouts (an image against a sequence's context, the validation episode, the
build's memory) and the GPU a CUDA build needs. Torch is not imported (but for backend=cuda's GPU check).

``parts`` is the role table of this artifact: ``{role name: ModelPart}``, in build order. A model
is present by being in it.
"""

import copy
import dataclasses
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from pipeline.backends import Backend, backend, quantized_kv_backends, quantizing
from pipeline.build.context import Context
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
    context: Context | None = None  # kv.capacity and kv.max_step_tokens as built, and where they came from

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
    """Check ``cfg`` (already through ``resolve_model``) and resolve it into the build plan (its config with
    ``kv.capacity`` and ``kv.max_step_tokens`` filled in where they are null: ``build/context.py``)."""
    from pipeline.build.feasibility import check_episode, check_memory
    from pipeline.config import unknown_settings
    from pipeline.models.families import family

    if unknown := unknown_settings(cfg):
        raise ConfigError(unknown[0])
    stages = check_order(list(cfg.stages))
    names = {s.name for s in stages}
    family(cfg.model.family)
    chosen = backend(cfg.backend.name)  # model.dtype, kv.dtype, validate.metric and .runtime: the schema's enums
    if cfg.kv.dtype == "int8" and not chosen.quantized_kv:
        raise ConfigError(f"kv.dtype=int8: backend={chosen.name} has no 8-bit KV cache (its attention reads float stores); "
                          f"choose kv.dtype=float32, bfloat16 or float16, or backend={' or '.join(quantized_kv_backends())}")
    if cfg.kv.cpu_kernel == "native":
        if chosen.planned_attention:
            raise ConfigError(f"kv.cpu_kernel=native: backend={chosen.name} plans its attention on the GPU, the native "
                              "kernel is the CPU backends'; choose kv.cpu_kernel=aten")
        if cfg.kv.dtype not in ("float32", "int8") or cfg.model.dtype != "float32":
            raise ConfigError(f"kv.cpu_kernel=native reads float32 queries and float32 or int8 stores: kv.dtype={cfg.kv.dtype}, "
                              f"model.dtype={cfg.model.dtype}; choose kv.dtype=float32 or int8 with model.dtype=float32, or "
                              "kv.cpu_kernel=aten")
        from pipeline.kernels.native import compiler

        try:
            compiler()
        except RuntimeError as e:
            raise ConfigError(f"kv.cpu_kernel=native: {e}; or choose kv.cpu_kernel=aten") from None
    if cfg.memory_budget_gb is not None and not cfg.memory_budget_gb > 0:
        raise ConfigError(f"memory_budget_gb={cfg.memory_budget_gb} must be a positive number of GB (null: this machine's memory)")

    cfg, parts, context = _parts_in_context(cfg, names, chosen)
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
        memory = check_memory(layouts, target.args, cfg.model.dtype, cfg.memory_budget_gb,
                              lambda c: list(_layouts(cfg, parts, chosen, c).values()), _least_capacity(cfg, parts))
    needs_gpu = {"compile", "validate"} & names
    if chosen.needs_gpu and needs_gpu:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"backend={chosen.name} needs a CUDA GPU for {' and '.join(sorted(needs_gpu))} (torch.cuda.is_available() "
                "is False); build on a GPU machine, stop after lower_kv (stages=[export,lower_kv]), or choose backend=xnnpack")
    return BuildPlan(cfg, tuple(stages), parts, chosen, scheme(cfg.quant.scheme), memory, context)


def _parts_in_context(cfg: DictConfig, names: set[str], chosen: Backend) -> tuple[DictConfig, dict, Context]:
    """Each role's part (its settings checked) with its KV layout, in the config whose ``kv.max_step_tokens``
    and ``kv.capacity`` are filled in where null (a copy then: the caller's config stays as it was)."""
    from pipeline.build.context import derive_capacity, model_context, step_tokens
    from pipeline.build.feasibility import budget_of, check_rope, memory_estimate
    from pipeline.quant import check as check_quant

    own = model_context(cfg.model)
    step, step_from = step_tokens(cfg.kv, own)
    if cfg.kv.capacity is None or cfg.kv.max_step_tokens is None:
        cfg = copy.deepcopy(cfg)
        cfg.kv.max_step_tokens = step
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
    capacity_from = "set"
    if cfg.kv.capacity is None:
        def measure(capacity: int) -> dict:
            layouts = list(_layouts(cfg, parts, chosen, capacity).values())  # the target's first
            estimate = memory_estimate(layouts, parts[TARGET].args, cfg.model.dtype)
            return estimate | {"scratch": layouts[0].attention_scratch_bytes()}

        budget, where = budget_of(cfg.memory_budget_gb)
        cfg.kv.capacity, capacity_from = derive_capacity(cfg.kv, own, _least_capacity(cfg, parts), measure,
                                                         budget, where)
        check_rope(parts[TARGET].args, cfg.kv.capacity)
    for name, layout in _layouts(cfg, parts, chosen).items():  # the one place layouts are built from the config
        parts[name] = dataclasses.replace(parts[name], layout=layout)
    return cfg, parts, Context(cfg.kv.capacity, cfg.kv.max_step_tokens, capacity_from, step_from)


def _layouts(cfg: DictConfig, parts: dict, chosen: Backend, capacity: int | None = None) -> dict[str, KVLayout]:
    """The KV layout of each attending part, from the ``kv`` config (at ``capacity`` instead of
    ``kv.capacity`` where given: what another capacity would take)."""
    kv = cfg.kv if capacity is None else OmegaConf.merge(cfg.kv, {"capacity": capacity})
    out = {}
    for name, part in parts.items():
        rule = part.role.kv_rule(cfg, part, parts)
        if rule is not None:
            # kv.dtype=int8 quantizes the target's stores; a draft's (its context features' keys) stay float32
            own = kv if name == TARGET or kv.dtype != "int8" else OmegaConf.merge(kv, {"dtype": "float32"})
            layout = build_layout(own, part.args, rule.causal, rule.max_step_tokens, rule.step_width)
            out[name] = dataclasses.replace(layout, planned=chosen.planned_attention,  # the backend's step buffers
                                            native=kv.cpu_kernel == "native")
    return out


def _least_capacity(cfg: DictConfig, parts: dict) -> int:
    """The smallest ``kv.capacity`` the layouts can be built with: a step, a sliding window."""
    return max([cfg.kv.max_step_tokens] + [getattr(p.args, "sliding_window", 0) for p in parts.values()])


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
