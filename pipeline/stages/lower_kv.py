"""lower_kv: LowerOffGraphKVPass on every method that attends, each over its model's layout (the
plan's). Every method is exported again here with the bounds of the layout (``ModelPart.methods``:
the widest step, the sampler's rows), the export stage's being the layout's none
(``pipeline/models/methods.py``: ``lower_methods``).

needs: exported    gives: lowered ({method: ExportedProgram})
"""

from pipeline.build.plan import BuildPlan
from pipeline.models.methods import lower_methods


def run(plan: BuildPlan, inputs: dict, workdir) -> dict:
    return {"lowered": lower_methods(plan, inputs["exported"])}
