"""CUDA: ExecuTorch's CudaBackend compiles each method with AOTInductor into ``aoti_cuda_blob.ptd``.

The attention of the sequence layouts is the Triton ``sdpa_varlen`` kernel, planned once per step
and layer kind, and goes into the compiled graph as it is; the cell layout's attention is inlined as
ATen and compiled by Inductor. ExecuTorch's Python runtime has no CUDA backend, so validation runs
the same lowered graphs through Inductor in a child process (``pipeline/runtime/aoti.py``).
"""

import contextlib
import copy
from pathlib import Path

from pipeline.backends import Backend


class Cuda(Backend):
    name = "cuda"
    needs_gpu = True
    edge_ir_check = False  # the AOTInductor graphs hold ops outside the Edge dialect (the Triton kernel)
    # the partitioner takes the stores into each method's delegate (constants named by their FQN in
    # the .ptd), and delegate inputs are planned in device memory
    share_mutable_buffers = False
    reinplace_stores = False  # the store writes run inside the AOTI delegate
    one_retrace = False  # ExecuTorch's to_edge_transform_and_lower: the one-retrace path is not measured on a GPU
    planned_attention = True
    quantized_kv = False  # the Triton attention reads float stores

    def attention_kernel(self):
        import torch

        from pipeline.kernels import sdpa_varlen  # noqa: F401  (registers the Triton ops)
        from pipeline.kv.layouts import AttentionKernel

        return AttentionKernel(plan=torch.ops.kvcache.sdpa_varlen_plan.default,
                               attend=torch.ops.kvcache.sdpa_varlen_attend.default)

    def inlined(self) -> dict:
        import torch

        from pipeline.kernels.reference import ATEN_DECOMPOSITIONS

        cells = torch.ops.kvcache.sdpa_cells.default  # the Triton kernel stays; only the cell attention
        return {cells: ATEN_DECOMPOSITIONS[cells]}

    def programs(self, lowered: dict, tables: dict | None = None) -> dict:
        # the CUDA backend moves the tensors to the device and frees them: deep copies
        return super().programs({name: copy.deepcopy(ep) for name, ep in lowered.items()}, tables)

    def partitioners(self, methods: list[str]):
        from executorch.backends.cuda.cuda_backend import CudaBackend
        from executorch.backends.cuda.cuda_partitioner import CudaPartitioner

        return {m: [CudaPartitioner([CudaBackend.generate_method_name_compile_spec(m)])] for m in methods}

    def write_data(self, program, workdir: Path) -> None:
        program.write_tensor_data_to_file(str(workdir))  # aoti_cuda_blob.ptd: the library and weights

    @contextlib.contextmanager
    def session(self, validate_cfg, inputs: dict, workdir: Path, recipe=None):
        import torch

        from pipeline.config import GPU_RUNTIMES
        from pipeline.runtime.aoti import MethodServer
        from pipeline.runtime.session import Session

        gpu = torch.cuda.get_device_name()
        runtime = (f"{validate_cfg.runtime}: the lowered graphs that ExecuTorch's CudaBackend compiles with AOTInductor, "
                   f"rebuilt from the config in a child process (same fingerprint), {GPU_RUNTIMES[validate_cfg.runtime]}, "
                   f"on {gpu} (ExecuTorch's Python runtime has no CUDA backend)")
        with MethodServer(recipe, self.programs(inputs["lowered"] | inputs.get("vision_exported", {})),
                          device="cuda", runtime=validate_cfg.runtime) as server:
            yield Session(workdir, methods=server.runners), runtime


BACKEND = Cuda()
