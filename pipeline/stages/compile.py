"""compile: ExecuTorch program from the lowered methods; writes model.pte and manifest.json.

needs: layout, lowered, kv_manifest    gives: program (path of model.pte), manifest
"""

import json
from pathlib import Path

from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.passes import MemoryPlanningPass

from pipeline.kernels.reference import ATEN_DECOMPOSITIONS
from pipeline.kv.manifest import constant_methods, manifest
from pipeline.passes.common_subexpressions import merge_common_subexpressions

BACKENDS = ("xnnpack", "portable")


def partitioners(backend: str) -> list:
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return [XnnpackPartitioner()]
    if backend == "portable":
        return []
    raise ValueError(f"backend.name={backend} is not a backend; choose one of {', '.join(BACKENDS)}")


def run(backend_cfg, inputs: dict, workdir: Path) -> dict:
    layout, lowered = inputs["layout"], inputs["lowered"]
    parts = partitioners(backend_cfg.name)
    # CPU backends have no kernel for the attention custom ops: inline their ATen bodies.
    programs = {name: ep.run_decompositions(ATEN_DECOMPOSITIONS) for name, ep in lowered.items()}
    for ep in programs.values():
        merge_common_subexpressions(ep.graph_module)
    print(f"  to_edge_transform_and_lower ({backend_cfg.name}): {', '.join(programs)}", flush=True)
    edge = to_edge_transform_and_lower(programs, partitioner=parts, constant_methods=constant_methods(layout))
    print("  to_executorch", flush=True)
    et = edge.to_executorch(ExecutorchBackendConfig(
        # all methods read and write the same KV stores
        memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
        emit_mutable_buffer_names=True,
    ))
    program = workdir / "model.pte"
    program.write_bytes(et.buffer)
    methods = {name: [spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind.name == "USER_INPUT"]
               for name, ep in lowered.items()}
    doc = manifest(inputs["kv_manifest"], backend_cfg.name, program.name, [], methods)
    (workdir / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")
    return {"program": program, "manifest": doc}
