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
    sections: tuple[str, ...]  # config sections passed to run, in order
    needs: tuple[str, ...]  # artifacts from earlier stages
    gives: tuple[str, ...]
    optional: tuple[str, ...] = ()  # artifacts of earlier stages it takes when they ran (export_vision's)

    def load(self):
        import importlib

        return importlib.import_module(f"pipeline.stages.{self.name}").run


STAGES = {
    s.name: s
    for s in (
        Stage("export_vision", ("vision", "model"), (), ("vision_models", "vision_exported")),
        Stage("export", ("model", "draft", "quant"), (), ("models", "exported", "tokenizer", "quant")),
        Stage("lower_kv", ("model", "draft", "kv", "backend"), ("exported",), ("lowered",)),
        Stage("compile", ("backend",), ("lowered", "tokenizer", "quant"), ("program", "manifest", "partitions"),
              optional=("vision_exported",)),
        Stage("validate", ("validate", "vision", "model", "draft", "kv", "backend", "quant"), ("models", "lowered", "program"),
              ("validation",), optional=("vision_models", "vision_exported")),
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
