"""Run the lowered methods through Inductor on a GPU, sharing one set of KV stores.

ExecuTorch's Python runtime (pybindings) carries no CUDA backend, so a GPU
validation compiles the same lowered graphs that ExecuTorch's CudaBackend
compiles (Inductor, Triton kernels included) and runs them here. Each method is
compiled on its own; the KV store buffers are replaced by one set of device
tensors so that, as in the .pte, every method reads what the others wrote.

Two runtimes (``validate.runtime``): ``aoti`` packages each method with
AOTInductor, exactly as the CudaBackend does, and runs it with AOTInductor's
model-container runtime; ``inductor`` compiles each method with
``torch.compile`` and Inductor's C++ wrapper. On the lent H200 (torch 2.11,
CUDA 13) loading any AOTInductor package segfaults, even a two-layer module,
whether through ``aoti_load_package`` (in the compiling process or a fresh one,
single-threaded or not) or ``AOTIModelContainerRunnerCuda``; ``torch.compile``
with the C++ wrapper runs there, so the GPU validation uses ``inductor``.

``MethodServer`` does the compiling and running in a fresh child process, each
call travelling as (method, inputs) over a pipe, so that nothing of ExecuTorch's
CUDA compile in the build process is shared, and a crash there is reported as a
validation error instead of killing the build. The child rebuilds the graphs
itself from a picklable recipe and must arrive at the same fingerprint (graph
text, every constant's bytes) as the parent's: graphs that went through
``torch.export.save``/``load`` compiled to wrong code under AOTInductor (an
out-of-bounds index on the CPU), so they do not travel as files.
"""

import hashlib
import multiprocessing
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from torch.export import ExportedProgram

from pipeline.config import GPU_RUNTIMES
from pipeline.models.methods import tensor_bytes

STORE_PREFIX = "kv_store."
KEPT_OUT = ("executorch.backends", "executorch.extension.pybindings", "executorch.runtime")



def compile_methods(lowered: dict[str, ExportedProgram], device: str = "cuda", runtime: str = "inductor") -> dict:
    """In this process: every method compiled by Inductor, the KV stores bound to one set of shared tensors.

    aoti: one AOTInductor package per method (``aoti_compile_and_package``), run by AOTInductor's
    model-container runtime, the stores loaded as user-managed constants.
    inductor: ``torch.compile`` of each method's unlifted module with Inductor's C++ wrapper, the
    stores set as the modules' buffers. Same Inductor lowering and Triton kernels; used on the H200
    (torch 2.11, CUDA 13), where loading any AOTInductor package segfaults."""
    from torch.export.passes import move_to_device_pass

    if runtime not in GPU_RUNTIMES:
        raise ValueError(f"validate.runtime={runtime} is not a runtime; choose one of {', '.join(GPU_RUNTIMES)}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # graphs name the device as the tensors do: cuda:0
        device = torch.device("cuda", torch.cuda.current_device())
    stores: dict[str, torch.Tensor] = {}
    runners = {}
    workdir = Path(tempfile.mkdtemp(prefix="aoti-")) if runtime == "aoti" else None
    for name, ep in lowered.items():
        print(f"  {runtime} compile {name}", flush=True)
        ep = move_to_device_pass(ep, device)
        own = {fqn: t for fqn, t in ep.state_dict.items() if fqn.startswith(STORE_PREFIX)}
        shared = {fqn: stores.setdefault(fqn, torch.zeros_like(t, device=device)) for fqn, t in own.items()}
        if runtime == "inductor":
            runners[name] = _caller(_inductor_module(ep, shared), device)
            continue
        package = torch._inductor.aoti_compile_and_package(ep, package_path=str(workdir / f"{name}.pt2"))
        model = torch._inductor.aoti_load_package(package)
        if shared:
            missing = set(shared) - set(model.get_constant_fqns())
            if missing:
                raise RuntimeError(f"AOTInductor package of {name} has no constant for the KV stores {sorted(missing)}")
            model.load_constants(shared, check_full_update=False, user_managed=True)
        runners[name] = _caller(model, device)
    return runners


def _inductor_module(ep: ExportedProgram, shared: dict[str, torch.Tensor]):
    """The unlifted module writes its buffer mutations back in place: give it the shared stores."""
    module = ep.module()
    # export's input checks (dtype, device) compare device strings exactly, and Dynamo's fake inputs
    # say cuda:0 where the moved graph may say cuda: the caller passes inputs of the exported kind
    for node in list(module.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            module.graph.erase_node(node)
    module.recompile()
    for fqn, tensor in shared.items():
        owner, _, leaf = fqn.rpartition(".")
        buffers = module.get_submodule(owner)._buffers
        if leaf not in buffers:
            raise RuntimeError(f"the unlifted module has no buffer {fqn} for the KV store")
        buffers[leaf] = tensor
    # dynamic: one compile per method for every step width, as the exported dynamic dims allow
    return torch.compile(module, fullgraph=True, dynamic=True, options={"cpp_wrapper": True})


def _caller(model, device):
    def execute(args):
        out = model(*[a.to(device) for a in args])
        out = out if isinstance(out, (list, tuple)) else [out]
        return [o.cpu() for o in out]

    return execute


class MethodServerError(RuntimeError):
    pass


def _graph_text(ep: ExportedProgram) -> str:
    """The graph with nodes numbered by position: node names depend on what ran before in the process."""
    index = {node: i for i, node in enumerate(ep.graph.nodes)}
    lines = [f"{node.op} {node.target if node.op != 'placeholder' else ''} "
             f"{torch.fx.node.map_arg((node.args, node.kwargs), lambda n: f'%{index[n]}')}" for node in ep.graph.nodes]
    sig = ep.graph_signature
    lines += [f"in {spec.kind.name} {spec.target}" for spec in sig.input_specs]
    lines += [f"out {spec.kind.name} {spec.target}" for spec in sig.output_specs]
    return "\n".join(lines)


def fingerprint(programs: dict[str, ExportedProgram]) -> str:
    """Hash of every method's graph and of its constants' names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for name in sorted(programs):
        ep = programs[name]
        h.update(f"{name}\n{_graph_text(ep)}\n".encode())
        for fqn, t in sorted({**ep.state_dict, **ep.constants}.items()):
            if isinstance(t, torch.Tensor):
                h.update(f"{fqn}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(tensor_bytes(t))
    return h.hexdigest()


def _serve(conn, recipe, expect: str, device: str, runtime: str) -> None:
    """Child process: rebuild and compile, then answer (method, inputs) until told to stop (None)."""
    try:
        programs = recipe()
        got = fingerprint(programs)
        if got != expect:
            raise MethodServerError(f"the child process rebuilt different graphs (fingerprint {got[:12]}, "
                                    f"parent's {expect[:12]}): nothing to validate against")
        # ExecuTorch's backends and runtime load native libraries of their own: none of them here, so
        # that this process runs only torch's. Its neutral op (executorch.extension.llm.cache, which
        # imports executorch.exir and torchao) is needed to trace the graphs and loads none.
        loaded = sorted(m for m in sys.modules if m.startswith(KEPT_OUT))
        if loaded:
            raise MethodServerError(f"{', '.join(loaded[:3])} got imported in the method process; keep them out")
        runners = compile_methods(programs, device, runtime)
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001  (reported to the parent, which raises)
        conn.send(("error", traceback.format_exc()))
        return
    while (request := conn.recv()) is not None:
        name, args = request
        try:
            conn.send(("ok", runners[name](args)))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class MethodServer:
    """The methods compiled and run by Inductor (``compile_methods``) in a fresh child process.

    ``recipe`` is a picklable callable (a module-level function or a partial of one) that
    builds ``programs`` anew in the child; the child refuses to serve unless its graphs
    match ``programs``. ``runners`` maps each method name to callable(list of inputs) ->
    list of outputs, as ``Session(methods=...)`` takes them. Use as a context manager."""

    def __init__(self, recipe, programs: dict[str, ExportedProgram], device: str = "cuda", runtime: str = "inductor"):
        self._runtime = runtime
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, recipe, fingerprint(programs), device, runtime),
                                 name="aoti-methods", daemon=True)
        self._proc.start()
        child.close()
        try:
            self._receive("compiling the methods")
        except BaseException:
            self.close()
            raise
        self.runners = {name: self._runner(name) for name in programs}

    def _receive(self, doing: str):
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._proc.join(timeout=10)
            raise MethodServerError(
                f"the {self._runtime} method process died while {doing} (exit code {self._proc.exitcode})") from None
        if status == "error":
            raise MethodServerError(f"the {self._runtime} method process failed while {doing}:\n{value}")
        return value

    def _runner(self, name: str):
        def execute(args):
            self._conn.send((name, [a.contiguous() for a in args]))
            return self._receive(f"running {name}")

        return execute

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
