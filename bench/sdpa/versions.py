"""Other versions of the kernel, loaded beside ours: earlier ones for ``--compare`` and
``--plan-compare``, and the package with the removed paths that the sweep's groups load (``removed.py``)."""

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


def load_module(path, name="sdpa_varlen_prev"):
    """Another version of the kernel: one file (its ops registered under ``kvcache_prev::``, the
    names of ours are taken), or the package's directory (e.g. ``old/pipeline/kernels/sdpa_varlen``
    after ``git archive REV pipeline/kernels/sdpa_varlen | tar -x -C old``) as package ``name``: its
    ``tuning``, ``plan`` and ``attention`` modules, with what they import; its ``ops.py`` is not
    imported.  A package gives ``plan_impl``, ``attend_impl``, its ``Tuning`` and
    ``_geometry_of(q, k, v, cols, tuning=None)`` (None: its defaults); a file its own."""
    if not os.path.isdir(path):
        return _load_source(path, "sdpa_varlen_prev", '"kvcache::', '"kvcache_prev::')
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]  # a package loaded under this name before: its modules are not this one's
    pkg = types.ModuleType(name)
    pkg.__path__ = [os.path.abspath(path)]
    sys.modules[pkg.__name__] = pkg
    tuning = importlib.import_module(f"{name}.tuning")
    pkg.plan_impl = importlib.import_module(f"{name}.plan").plan_impl
    pkg.attend_impl = importlib.import_module(f"{name}.attention").attend_impl
    pkg.Tuning = tuning.Tuning
    pkg._geometry_of = lambda q, k, v, cols, tun=None: tuning.geometry(
        q.shape[0], cols, q.shape[1], k.shape[1], q.shape[2], v.shape[-1], q.element_size(),
        tuning.Tuning() if tun is None else tun)
    return pkg
