"""Backends: one module each (``xnnpack.py``, ``portable.py``, ``cuda.py``), holding a ``Backend``
that answers everything the stages ask of it.

    lower_kv   attention_kernel()    the sdpa_varlen implementation the store lowering calls
    compile    programs(lowered)     the graphs the backend compiles (custom ops it has no kernel
                                     for inlined as ATen), on copies where it edits them
               partitioners(methods), edge_ir_check, share_mutable_buffers, reinplace_stores,
               one_retrace, lowering(), write_data(...)
    validate   session(...)          the Session the episode drives, and what runs it
    runner     needs_gpu             compile and validate need a CUDA GPU

Adding a backend is a module here defining ``BACKEND`` plus ``conf/backend/<name>.yaml``; the
config check finds it by its module name. Importing this package imports neither torch nor
ExecuTorch (the config check runs before any), and no backend module imports ExecuTorch at the top:
the GPU validation's child process builds graphs through ``programs`` with ExecuTorch kept out.
"""

import contextlib
import importlib
import pkgutil
from pathlib import Path

from pipeline.errors import ConfigError


class Backend:
    name = ""
    needs_gpu = False
    # ExecuTorch's Edge dialect check (off where the compiled graphs hold ops outside it)
    edge_ir_check = True
    # KV stores as mutable buffers of the program, one set shared by every method
    share_mutable_buffers = True
    # ExecuTorch's reinplace pass on the store writes: index_put_ into the buffer, where the
    # functional index_put copies the whole store into a new tensor and copy_ writes it back, two
    # copies of every row of every column per layer and step
    reinplace_stores = True
    # runs quantized weights (quant.scheme other than none): kernels for 8-bit and 4-bit linears and embeddings
    quantized_kernels = False
    # compile decomposes each method in one retrace (the inlined ops with ExecuTorch's core ATen
    # table, ``pipeline/passes/edge.py``) instead of ``to_edge_transform_and_lower``'s four
    one_retrace = True
    # the attention is planned on the device from the step's seq_info (the GPU's Triton kernel), not
    # gathered from the slots the host lists (ATen on CPU): the layouts' step buffers follow it
    planned_attention = False
    # reads 8-bit KV stores with a scale per token and KV head (kv.dtype=int8: the gathered ATen attention)
    quantized_kv = True

    def attention_kernel(self):
        """The ops lower_kv's store lowering calls (``kv.layouts.AttentionKernel``): the ATen attention
        over the rows the step reads, or a plan once per step and layer kind and the attention it drives."""
        import torch

        import pipeline.kernels.reference  # noqa: F401  (registers the kvcache:: attention ops)
        from pipeline.kv.layouts import AttentionKernel

        return AttentionKernel(gather=torch.ops.kvcache.sdpa_gather.default, gather_q8=torch.ops.kvcache.sdpa_gather_q8.default)

    def inlined(self) -> dict:
        """Custom ops the backend has no kernel for -> their ATen bodies (run_decompositions table)."""
        from pipeline.kernels.reference import ATEN_DECOMPOSITIONS

        return ATEN_DECOMPOSITIONS

    def programs(self, lowered: dict, tables: dict | None = None, native: bool = False) -> dict:
        """The graphs the backend compiles, from lower_kv's programs, which must stay usable.

        ``run_decompositions`` gives new programs with their own state dicts, enough for a backend
        that drops the constants it takes but does not change tensors (XNNPACK, portable): no copy of
        the weights, which for a real model is the largest single term of the build's memory.
        ``tables``: {method: decomposition table} applied in the same retrace (compile passes
        ExecuTorch's core ATen table there: ``pipeline/passes/edge.py``)."""
        from pipeline.passes.common_subexpressions import merge_common_subexpressions

        programs = {}
        for name, ep in lowered.items():
            table = (tables or {}).get(name)
            table = table.copy() if table is not None else {}  # ExecuTorch's: torch.export's CustomDecompTable
            table.update(self.inlined())
            if native:  # kv.cpu_kernel=native: the tokens alone through the native kernel, the block as ATen
                from pipeline.kernels.native import DECOMPOSITIONS, load

                load()  # its ops' out variants, which to_executorch finds by name
                table.update(DECOMPOSITIONS)
            programs[name] = ep.run_decompositions(table)
        for ep in programs.values():
            merge_common_subexpressions(ep.graph_module)
            drop_provenance(ep.graph_module)
        return programs

    def partitioners(self, methods: list[str]):
        """ExecuTorch partitioners: a list for every method, or {method: list}."""
        return []

    @contextlib.contextmanager
    def lowering(self):
        """Around compile's lowering (the partitioners and the backend's preprocess)."""
        yield

    def write_data(self, program, workdir: Path) -> None:
        """Files beside model.pte (.ptd) that the program needs at run time."""

    @contextlib.contextmanager
    def session(self, validate_cfg, inputs: dict, workdir: Path, recipe=None):
        """The session validate drives through the built program, and a description of its runtime
        (``recipe``: a picklable call that makes the graphs ``programs`` gives again, for a runtime
        in another process)."""
        from pipeline.runtime.session import Session

        yield Session(workdir), "executorch.runtime (Python bindings), CPU"


def drop_provenance(gm) -> None:
    """Forget where each node came from (``meta["from_node"]``: torch.fx's provenance, a chain of
    every node it was made from, pass after pass since the export). Every pass that makes a node
    deep-copies the chain of the node it came from, and compile runs dozens (the edge dialect, then
    each of XNNPACK's 17 passes on every partition): under cProfile those copies were 14.6 s of the
    87.5 s of the default build's compile with the export's and lower_kv's chains carried along (in
    wall time the difference is within this machine's noise: 40.8 / 30.4 s kept, 29.6 / 30.4 s
    dropped, side by side). Nothing in the build reads it (no ETRecord is written)."""
    for node in gm.graph.nodes:
        node.meta.pop("from_node", None)


def names() -> list[str]:
    """Every backend, by module name (no import)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def quantizing() -> list[str]:
    """The backends that run quantized weights."""
    return [name for name in names() if backend(name).quantized_kernels]


def quantized_kv_backends() -> list[str]:
    """The backends that run an 8-bit KV cache (kv.dtype=int8)."""
    return [name for name in names() if backend(name).quantized_kv]


def backend(name: str) -> Backend:
    if name not in names():
        raise ConfigError(f"backend={name} is not a backend; choose one of {', '.join(names())}")
    return importlib.import_module(f"{__name__}.{name}").BACKEND
