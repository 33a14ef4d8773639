"""The CPU attention as native kernels of ExecuTorch's runtime (``pipeline/kernels/cpu/sdpa_gather.cpp``):
``kvcache::sdpa_gather`` and ``kvcache::sdpa_gather_q8`` computed over the listed store slots where they
lie, where the ATen form (``reference.py``, the CPU backends' default, ``kv.cpu_kernel=aten``) copies every
key and value it reads two or three times (docs/benchmarks.md "kv_read_floor").

``load()`` builds the library with g++ against the ExecuTorch wheel's headers and ``libexecutorch.so``
(once per source, flags, compiler and ExecuTorch version, cached under ``$PIPELINE_NATIVE_CACHE`` or
``~/.cache/kv-pipeline/native``), loads it beside the runtime (its kernels register with the runtime's
operator registry by name) and defines the ops' out variants for export, so a program that keeps the op
whole calls the kernel. tests/kernels/test_native_gather.py holds the kernels to float64 on fresh random
inputs. ``kv.cpu_kernel=native`` keeps the op whole in the program
(``Backend.programs``) and the Session loads the library before the program (the manifest's
``cpu_kernel``).
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pipeline.kernels import reference

SOURCE = Path(__file__).with_name("cpu") / "sdpa_gather.cpp"
# -ffast-math: the softmax's exp vectorized (glibc's libmvec) and the dot products' sums reassociated;
# the kernel keeps no infinities for it (a hidden key scores -1e30). -march=native: built where it runs.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC",
         "-DET_USE_THREADPOOL", "-DC10_USING_CUSTOM_GENERATED_MACROS"]
_OUT_SCHEMAS = {
    "sdpa_gather": "sdpa_gather.out(Tensor q, Tensor k_store, Tensor v_store, Tensor q_pos, Tensor one, "
                   "Tensor block_q, Tensor block, Tensor out_rows, float scale, bool causal, SymInt window, *, "
                   "Tensor(a!) out) -> Tensor(a!)",
    "sdpa_gather_q8": "sdpa_gather_q8.out(Tensor q, Tensor k_store, Tensor k_scale, Tensor v_store, Tensor v_scale, "
                      "Tensor q_pos, Tensor one, Tensor block_q, Tensor block, Tensor out_rows, float scale, "
                      "bool causal, SymInt window, *, Tensor(a!) out) -> Tensor(a!)",
}
_loaded: dict[str, object] = {}
# the ops the library runs, kept whole in a program built with kv.cpu_kernel=native
NATIVE_OPS = (torch.ops.kvcache.sdpa_gather.default, torch.ops.kvcache.sdpa_gather_q8.default)


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


def library() -> Path:
    """The built library, built first where the cache has none for this source, flags, compiler and runtime."""
    cxx, root = compiler(), executorch_root()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    from executorch.version import __version__ as et_version

    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, et_version, str(root)]).encode()).hexdigest()
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
            lib.impl(f"{name}.out", _eager_out(getattr(reference, f"{name}_reference")), "CompositeExplicitAutograd")
    _loaded["library"], _loaded["path"] = lib, path
    return path


def _eager_out(fn):
    def out_variant(*args, out):
        return out.copy_(fn(*args))

    return out_variant
