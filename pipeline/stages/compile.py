"""compile: ExecuTorch program from the lowered methods; writes model.pte (+ .ptd) and manifest.json.

needs: lowered, tokenizer, quant (and export_vision's vision_exported)
gives: program (path of model.pte), manifest, partitions (backend delegates per method: compile's
cost grows with them; build.json records them)

What differs by backend (the graphs it compiles, its partitioners, memory planning, data files) is
the backend object's (``pipeline/backends/``).
"""

import json
from pathlib import Path

from pipeline.build.manifest import MANIFEST, constant_methods, manifest
from pipeline.build.plan import BuildPlan
from pipeline.passes import edge as one_retrace_lowering
from pipeline.passes.group_merge import merge_check_by_set_ops


def run(plan: BuildPlan, inputs: dict, workdir: Path) -> dict:
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    lowered = inputs["lowered"] | inputs.get("vision_exported", {})
    sections = plan.manifest_sections()
    backend = plan.backend
    partitioners = backend.partitioners(list(lowered))
    if not isinstance(partitioners, dict):
        partitioners = {name: partitioners for name in lowered}
    config = EdgeCompileConfig(_check_ir_validity=backend.edge_ir_check)
    # kv.cpu_kernel=native: the gathered attention stays whole, for the native kernel (pipeline/kernels/native.py)
    native = any(p.layout is not None and p.layout.native for p in plan.parts.values())
    print(f"  to_edge_transform_and_lower ({backend.name}): {', '.join(lowered)}", flush=True)
    with backend.lowering(), merge_check_by_set_ops():  # the group partitioner's pair check in C (same partitions)
        if backend.one_retrace and one_retrace_lowering.one_retrace(partitioners):  # one retrace per method
            edge = one_retrace_lowering.to_edge_transform_and_lower(backend, lowered, partitioners,
                                                                    constant_methods(sections), config, native)
        else:
            edge = to_edge_transform_and_lower(backend.programs(lowered, native=native), partitioner=partitioners,
                                               constant_methods=constant_methods(sections), compile_config=config)
    partitions = {}
    for name in lowered:
        graph = edge.exported_program(name).graph
        partitions[name] = sum(1 for n in graph.nodes if n.op == "call_function" and "call_delegate" in str(n.target))
        print(f"  {name}: {partitions[name]} {backend.name} partition{'s' * (partitions[name] != 1)}", flush=True)
    print("  to_executorch", flush=True)
    et = edge.to_executorch(ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=backend.share_mutable_buffers),
        emit_mutable_buffer_names=True, run_reinplace_pass=backend.reinplace_stores,
    ))
    program = workdir / "model.pte"
    with program.open("wb") as f:
        et.write_to_file(f)
    backend.write_data(et, workdir)
    data_files = sorted(p.name for p in workdir.glob("*.ptd"))
    methods = {name: [spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind.name == "USER_INPUT"]
               for name, ep in lowered.items()}
    tokenizer = inputs["tokenizer"] and inputs["tokenizer"].name
    doc = manifest(sections, backend.name, program.name, data_files, methods, tokenizer)
    doc["quant"] = inputs["quant"]  # the weights' scheme, group size and per-tensor error (pipeline/quant)
    (workdir / MANIFEST).write_text(json.dumps(doc, indent=2) + "\n")
    return {"program": program, "manifest": doc, "partitions": partitions}
