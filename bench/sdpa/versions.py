"""Earlier versions of the kernel, loaded beside ours for ``--compare`` and ``--plan-compare``."""

import importlib
import os
import sys
import types


def _load_source(path, name, old, new):
    """The Python file ``path`` as module ``name``, ``old`` replaced by ``new`` in its source."""
    src = open(path).read().replace(old, new)
    mod = types.ModuleType(name)
    mod.__file__ = os.path.abspath(path)
    sys.modules[mod.__name__] = mod  # triton's jit looks its functions' globals up through the module
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


def load_module(path):
    """Another version of the kernel: one file (its ops registered under ``kvcache_prev::``, the
    names of ours are taken), or the package's directory (e.g. ``old/pipeline/kernels/sdpa_varlen``
    after ``git archive REV pipeline/kernels/sdpa_varlen | tar -x -C old``): its ``tuning``, ``plan``
    and ``attention`` modules, with what they import; its ``ops.py`` is not imported."""
    if not os.path.isdir(path):
        return _load_source(path, "sdpa_varlen_prev", '"kvcache::', '"kvcache_prev::')
    pkg = types.ModuleType("sdpa_varlen_prev")
    pkg.__path__ = [os.path.abspath(path)]
    sys.modules[pkg.__name__] = pkg
    tuning = importlib.import_module("sdpa_varlen_prev.tuning")
    pkg.plan_impl = importlib.import_module("sdpa_varlen_prev.plan").plan_impl
    pkg.attend_impl = importlib.import_module("sdpa_varlen_prev.attention").attend_impl
    pkg._geometry_of = lambda q, k, v, cols: tuning.geometry(q.shape[0], cols, q.shape[1], k.shape[1], q.shape[2],
                                                             v.shape[-1], q.element_size(), tuning.DEFAULT)
    return pkg


def load_plan(path):
    """An earlier version's plan.py, its relative import made absolute: its ``plan_impl``."""
    return _load_source(path, "sdpa_varlen_prev_plan", "from .tuning import", "from pipeline.kernels.sdpa_varlen.tuning import")
