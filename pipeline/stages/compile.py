"""compile: ExecuTorch program from the lowered methods; writes model.pte (+ .ptd) and manifest.json.

needs: layout, lowered, kv_manifest    gives: program (path of model.pte), manifest

CPU backends (xnnpack, portable) have no kernel for the attention custom ops,
so their ATen bodies are inlined first. The CUDA backend compiles each method
with AOTInductor: the Triton ``sdpa_varlen`` kernel chosen by lower_kv goes
into the compiled graph as it is; the cell layout's attention is inlined as
ATen and compiled by Inductor.
"""

import copy
import json
from pathlib import Path

import torch

from pipeline.config import BACKENDS
from pipeline.kernels.reference import ATEN_DECOMPOSITIONS
from pipeline.kv.manifest import constant_methods, manifest
from pipeline.passes.common_subexpressions import merge_common_subexpressions


def _partitioners(backend: str, methods: list[str]):
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return [XnnpackPartitioner()]
    if backend == "portable":
        return []
    if backend == "cuda":
        from executorch.backends.cuda.cuda_backend import CudaBackend
        from executorch.backends.cuda.cuda_partitioner import CudaPartitioner

        return {m: [CudaPartitioner([CudaBackend.generate_method_name_compile_spec(m)])] for m in methods}
    raise ValueError(f"backend.name={backend} is not a backend; choose one of {', '.join(BACKENDS)}")


def backend_programs(lowered: dict, backend: str) -> dict:
    """The graphs the backend compiles: attention custom ops it has no kernel for, inlined as ATen.

    The upstream programs must stay usable. ``run_decompositions`` gives new programs with their own
    state dicts, which is enough for the CPU backends (XNNPACK drops the constants it takes from the
    program it lowers, it does not change tensors); the CUDA backend moves and frees the tensors
    themselves, so it gets deep copies. A deep copy of every method's weights was the largest
    single term of a real model's build memory (0.54 GB per method for SmolLM2-135M)."""
    decompositions = ATEN_DECOMPOSITIONS
    if backend == "cuda":  # keep the Triton kernel; only the cell attention becomes ATen
        lowered = {name: copy.deepcopy(ep) for name, ep in lowered.items()}
        decompositions = {torch.ops.kvcache.sdpa_cells.default: ATEN_DECOMPOSITIONS[torch.ops.kvcache.sdpa_cells.default]}
    programs = {name: ep.run_decompositions(decompositions) for name, ep in lowered.items()}
    for ep in programs.values():
        merge_common_subexpressions(ep.graph_module)
    return programs


def run(backend_cfg, inputs: dict, workdir: Path) -> dict:
    # imported here: backend_programs must stay free of executorch (and the torchao it loads), which
    # the GPU validation's AOTInductor process keeps out (see pipeline/runtime/aoti.py)
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    layout, lowered = inputs["layout"], inputs["lowered"]
    backend = backend_cfg.name
    programs = backend_programs(lowered, backend)
    print(f"  to_edge_transform_and_lower ({backend}): {', '.join(programs)}", flush=True)
    edge = to_edge_transform_and_lower(
        programs, partitioner=_partitioners(backend, list(programs)), constant_methods=constant_methods(layout, inputs["kv_manifest"]["vocab_size"]),
        # the CUDA backend's AOTInductor graphs hold ops outside the Edge dialect (the Triton kernel)
        compile_config=EdgeCompileConfig(_check_ir_validity=backend != "cuda"),
    )
    for name in programs:
        graph = edge.exported_program(name).graph
        delegates = sum(1 for n in graph.nodes if n.op == "call_function" and "call_delegate" in str(n.target))
        print(f"  {name}: {delegates} {backend} partition{'s' * (delegates != 1)}", flush=True)
    print("  to_executorch", flush=True)
    et = edge.to_executorch(ExecutorchBackendConfig(
        # CPU backends: the KV stores are mutable buffers of the program, shared by all methods.
        # CUDA: the AOTInductor partitioner takes the stores into each method's delegate (constants
        # named by their FQN in the .ptd), and delegate inputs are planned in device memory.
        memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=backend != "cuda"),
        emit_mutable_buffer_names=True,
    ))
    program = workdir / "model.pte"
    with program.open("wb") as f:
        et.write_to_file(f)
    if backend == "cuda":  # aoti_cuda_blob.ptd: the AOTInductor library and weights
        et.write_tensor_data_to_file(str(workdir))
    data_files = sorted(p.name for p in workdir.glob("*.ptd"))
    methods = {name: [spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind.name == "USER_INPUT"]
               for name, ep in lowered.items()}
    tokenizer = inputs["tokenizer"] and inputs["tokenizer"].name
    doc = manifest(inputs["kv_manifest"], backend, program.name, data_files, methods, tokenizer)
    (workdir / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")
    return {"program": program, "manifest": doc}
