"""The stages, in their natural order, with what each needs and gives.

A stage is ``run(*config_sections, inputs, workdir) -> artifacts``: it sees
only the config sections it names and the upstream artifacts it needs.
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
        Stage("export_vision", ("vision", "model"), (), ("vision", "vision_exported", "vision_section")),
        Stage("export", ("model", "draft", "quant"), (), ("model", "draft", "exported", "tokenizer", "quant")),
        Stage("lower_kv", ("model", "kv", "backend"), ("model", "draft", "exported"), ("layouts", "lowered", "kv_sections")),
        Stage("compile", ("backend",), ("lowered", "kv_sections", "tokenizer", "quant"), ("program", "manifest", "partitions"),
              optional=("vision_exported", "vision_section")),
        Stage("validate", ("validate", "vision", "model", "draft", "kv", "backend", "quant"), ("model", "draft", "lowered", "program"),
              ("validation",), optional=("vision", "vision_exported")),
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
