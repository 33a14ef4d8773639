"""The stages, in their natural order, with what each needs and gives.

A stage is ``run(plan, inputs, workdir) -> artifacts``: it reads the build plan
(``pipeline/build/plan.py``) and the upstream artifacts it needs. ``sections`` are the
config sections its result depends on beyond those of the stages it takes artifacts from:
its cache key holds them (``pipeline/cache/keys.py``). Stages never import one another.
"""

from dataclasses import dataclass

from pipeline.errors import ConfigError


@dataclass(frozen=True)
class Stage:
    name: str
    config: tuple[str, ...]  # config sections its result depends on, besides its models' (``models``)
    needs: tuple[str, ...]  # artifacts from earlier stages
    gives: tuple[str, ...]
    optional: tuple[str, ...] = ()  # artifacts of earlier stages it takes when they ran (export_vision's)
    # whose config sections it reads: "built" (the roles it builds), "kv" (the roles that keep KV), "all", "none"
    models: str = "built"

    @property
    def sections(self) -> tuple[str, ...]:
        """The config sections its cache key holds: ``config`` and its models' sections, in the role table's order."""
        from pipeline.build.roles import ROLES

        reads = {"built": lambda r: r.stage == self.name, "kv": lambda r: r.store is not None,
                 "all": lambda r: True, "none": lambda r: False}[self.models]
        roles = [r for r in ROLES.values() if reads(r)]
        return tuple(dict.fromkeys([*self.config[:1], *(r.section for r in roles), *self.config[1:]]))

    def load(self):
        import importlib

        return importlib.import_module(f"pipeline.stages.{self.name}").run


STAGES = {
    s.name: s
    for s in (
        Stage("export_vision", ("model",), (), ("vision_models", "vision_exported")),
        Stage("export", ("model", "quant"), (), ("models", "exported", "tokenizer", "quant")),
        Stage("lower_kv", ("model", "kv", "backend"), ("exported",), ("lowered",), models="kv"),
        Stage("compile", ("backend",), ("lowered", "tokenizer", "quant"), ("program", "manifest", "partitions"),
              optional=("vision_exported",), models="none"),
        Stage("validate", ("validate", "kv", "backend", "quant"), ("models", "lowered", "program"), ("validation",),
              optional=("vision_models", "vision_exported"), models="all"),
    )
}


class StageOrderError(ConfigError):
    pass


def check_order(names: list[str]) -> list[Stage]:
    """Every stage known, none twice, each after the stages that give what it needs."""
    valid = ", ".join(STAGES)
    if not names:
        raise StageOrderError(f"stages=[] is empty; list stages to run from: {valid}")
    given: dict[str, str] = {}
    plan = []
    for name in names:
        if name not in STAGES:
            raise StageOrderError(f"stages: '{name}' is not a stage; valid stages are: {valid}")
        if any(s.name == name for s in plan):
            raise StageOrderError(f"stages: '{name}' is listed twice")
        stage = STAGES[name]
        missing = [a for a in stage.needs if a not in given]
        if missing:
            producers = sorted({s.name for s in STAGES.values() for a in missing if a in s.gives})
            raise StageOrderError(
                f"stages=[{','.join(names)}]: '{name}' needs {', '.join(missing)} from "
                f"{' and '.join(producers)}, which must run before it (natural order: {valid})")
        given |= {a: name for a in stage.gives}
        plan.append(stage)
    return plan
