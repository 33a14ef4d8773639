"""Run the lowered methods on a CUDA GPU through AOTInductor, sharing one set of KV stores.

ExecuTorch's Python runtime (pybindings) carries no CUDA backend, so a GPU
validation compiles the same lowered graphs that ExecuTorch's CudaBackend
compiles (AOTInductor, Triton kernels included) and runs them here. Each
method becomes its own AOTInductor package; the KV store buffers are replaced
by one set of user-managed device tensors so that, as in the .pte, every
method reads what the others wrote.
"""

import tempfile
from pathlib import Path

import torch
from torch.export import ExportedProgram

STORE_PREFIX = "kv_store."


def compile_methods(lowered: dict[str, ExportedProgram], device: str = "cuda") -> dict:
    from torch.export.passes import move_to_device_pass

    stores: dict[str, torch.Tensor] = {}
    runners = {}
    workdir = Path(tempfile.mkdtemp(prefix="aoti-"))
    for name, ep in lowered.items():
        print(f"  aoti compile {name}", flush=True)
        ep = move_to_device_pass(ep, device)
        package = torch._inductor.aoti_compile_and_package(ep, package_path=str(workdir / f"{name}.pt2"))
        model = torch._inductor.aoti_load_package(package)
        own = {fqn: t for fqn, t in ep.state_dict.items() if fqn.startswith(STORE_PREFIX)}
        if own:
            shared = {fqn: stores.setdefault(fqn, torch.zeros_like(t, device=device)) for fqn, t in own.items()}
            missing = set(shared) - set(model.get_constant_fqns())
            if missing:
                raise RuntimeError(f"AOTInductor package of {name} has no constant for the KV stores {sorted(missing)}")
            model.load_constants(shared, check_full_update=False, user_managed=True)
        runners[name] = _caller(model, device)
    return runners


def _caller(model, device):
    def execute(args):
        out = model(*[a.to(device) for a in args])
        out = out if isinstance(out, (list, tuple)) else [out]
        return [o.cpu() for o in out]

    return execute
