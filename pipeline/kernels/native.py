"""The CPU attention's decodes as native kernels of ExecuTorch's runtime (``pipeline/kernels/cpu/sdpa_gather.cpp``):
the tokens of a step that attend alone (each over its own sequence's listed rows) computed over the store
slots where they lie, where the ATen form (``reference.py``, the CPU backends' default, ``kv.cpu_kernel=aten``)
copies every key and value it reads two or three times (docs/benchmarks.md "kv_read_floor"). A step's block
(a prefill chunk: its tokens share one list) stays the ATen form's, whose matrix products run it faster.

``kv.cpu_kernel=native`` inlines ``kvcache::sdpa_gather`` (``_q8``) as ``split`` (``split_q8``): the tokens alone
through ``kvcache::sdpa_gather_alone`` (``_q8``), kept whole in the program, the block as ATen
(``Backend.programs``). ``load()`` builds the library with g++ against the ExecuTorch wheel's headers and
``libexecutorch.so`` (once per source, flags, compiler and ExecuTorch version, cached under
``$PIPELINE_NATIVE_CACHE`` or ``~/.cache/kv-pipeline/native``), loads it beside the runtime (its kernels
register with the runtime's operator registry by name) and defines the ops' out variants for export. The
Session loads it before a program whose manifest names ``cpu_kernel: native``.
tests/kernels/test_native_gather.py holds the program's attention to float64 on fresh random inputs.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from pipeline.kernels import reference

SOURCE = Path(__file__).with_name("cpu") / "sdpa_gather.cpp"
# -ffast-math: the softmax's exp vectorized (glibc's libmvec) and the dot products' sums reassociated;
# the kernel keeps no infinities for it (a hidden key scores -1e30). -march=native: built where it runs.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC",
         "-DET_USE_THREADPOOL", "-DC10_USING_CUSTOM_GENERATED_MACROS"]
_OUT_SCHEMAS = {
    "sdpa_gather_alone": "sdpa_gather_alone.out(Tensor q, Tensor k_store, Tensor v_store, Tensor q_pos, Tensor one, "
                         "float scale, bool causal, SymInt window, *, Tensor(a!) out) -> Tensor(a!)",
    "sdpa_gather_alone_q8": "sdpa_gather_alone_q8.out(Tensor q, Tensor k_store, Tensor k_scale, Tensor v_store, "
                            "Tensor v_scale, Tensor q_pos, Tensor one, float scale, bool causal, SymInt window, *, "
                            "Tensor(a!) out) -> Tensor(a!)",
}


@torch.library.custom_op("kvcache::sdpa_gather_alone", mutates_args=())
def sdpa_gather_alone(q: Tensor, k_store: Tensor, v_store: Tensor, q_pos: Tensor, one: Tensor, scale: float,
                      causal: bool, window: int) -> Tensor:
    """``sdpa_gather``'s tokens alone (``one``: [T1, 3, N1]) -> [T1, Hq, Dv] float32 (the kernel's eager form)."""
    return reference.sdpa_gather_alone_reference(q, k_store, v_store, q_pos, one, scale, causal, window)


@sdpa_gather_alone.register_fake
def _(q, k_store, v_store, q_pos, one, scale, causal, window):
    return q.new_empty(one.shape[0], q.shape[1], v_store.shape[-1], dtype=torch.float32)


@torch.library.custom_op("kvcache::sdpa_gather_alone_q8", mutates_args=())
def sdpa_gather_alone_q8(q: Tensor, k_store: Tensor, k_scale: Tensor, v_store: Tensor, v_scale: Tensor, q_pos: Tensor,
                         one: Tensor, scale: float, causal: bool, window: int) -> Tensor:
    """``sdpa_gather_q8``'s tokens alone -> [T1, Hq, Dv] float32."""
    return reference.sdpa_gather_alone_reference(q, k_store, v_store, q_pos, one, scale, causal, window, k_scale,
                                                 v_scale)


@sdpa_gather_alone_q8.register_fake
def _(q, k_store, k_scale, v_store, v_scale, q_pos, one, scale, causal, window):
    return q.new_empty(one.shape[0], q.shape[1], v_store.shape[-1], dtype=torch.float32)


def split(q, k_store, v_store, q_pos, one, block_q, block, out_rows, scale, causal, window):
    """``sdpa_gather`` as a program built with ``kv.cpu_kernel=native`` computes it."""
    alone = torch.ops.kvcache.sdpa_gather_alone(q, k_store, v_store, q_pos, one, scale, causal, window)
    shared = reference.sdpa_gather_block_reference(q, k_store, v_store, q_pos, block_q, block, scale, causal, window)
    return torch.cat([alone, shared]).index_select(0, out_rows).to(q.dtype)


def split_q8(q, k_store, k_scale, v_store, v_scale, q_pos, one, block_q, block, out_rows, scale, causal, window):
    alone = torch.ops.kvcache.sdpa_gather_alone_q8(q, k_store, k_scale, v_store, v_scale, q_pos, one, scale, causal,
                                                   window)
    shared = reference.sdpa_gather_block_reference(q, k_store, v_store, q_pos, block_q, block, scale, causal, window,
                                                   k_scale, v_scale)
    return torch.cat([alone, shared]).index_select(0, out_rows).to(q.dtype)


# Backend.programs's table with kv.cpu_kernel=native, in place of the ATen bodies of the same ops
DECOMPOSITIONS = {torch.ops.kvcache.sdpa_gather.default: split, torch.ops.kvcache.sdpa_gather_q8.default: split_q8}
_loaded: dict[str, object] = {}



def executorch_root() -> Path:
    """The ExecuTorch wheel's directory: ``include/`` (the runtime's headers) and ``lib/`` (its libraries)."""
    import executorch.exir

    return Path(executorch.exir.__file__).resolve().parent.parent


def compiler() -> str:
    """g++'s path, or a RuntimeError saying what the native kernels need."""
    found = shutil.which(os.environ.get("CXX", "g++"))
    if not found:
        raise RuntimeError("the native CPU attention kernels (pipeline/kernels/cpu/sdpa_gather.cpp) are built with "
                           "a C++17 compiler: none found as $CXX or g++ (apt-get install g++)")
    return found


def _cpu() -> str:
    """This CPU's instruction set (-march=native builds for it: a cache shared by other machines keeps one each)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    return next((line for line in info.splitlines() if line.startswith("flags")), platform.machine())


def library() -> Path:
    """The built library, built first where the cache has none for this source, flags, compiler, runtime and CPU."""
    cxx, root = compiler(), executorch_root()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    from executorch.version import __version__ as et_version

    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, et_version, str(root), _cpu()]).encode()).hexdigest()
    cache = Path(os.environ.get("PIPELINE_NATIVE_CACHE", Path.home() / ".cache" / "kv-pipeline" / "native"))
    target = cache / key[:16] / "libkvcache_cpu.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [cxx, *FLAGS, f"-I{root / 'include'}", f"-I{root / 'include/executorch/runtime/core/portable_type/c10'}",
                   str(SOURCE), "-o", str(built), f"-L{root / 'lib'}", "-lexecutorch", "-lexecutorch_threadpool",
                   f"-Wl,-rpath,{root / 'lib'}"]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(command)}):\n{run.stderr[-4000:]}")
        built.replace(target)  # whole or not at all: a concurrent build replaces it with the same bytes
    return target


def load() -> Path:
    """Build (where needed) and load the kernels; define the ops' out variants for export. Idempotent."""
    if "path" in _loaded:
        return _loaded["path"]
    path = library()
    _loaded["handle"] = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    lib = torch.library.Library("kvcache", "FRAGMENT")
    for name, schema in _OUT_SCHEMAS.items():
        if not hasattr(getattr(torch.ops.kvcache, name), "out"):
            lib.define(schema)
            lib.impl(f"{name}.out", _eager_out(globals()[name]), "CompositeExplicitAutograd")
    _loaded["library"], _loaded["path"] = lib, path
    return path


def _eager_out(fn):
    def out_variant(*args, out):
        return out.copy_(fn(*args))

    return out_variant
