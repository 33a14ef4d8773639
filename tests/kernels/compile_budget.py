"""The compile budget of a kernel test: how many specialisations of the ``sdpa_varlen`` kernels
(``_plan_kernel``, ``_sdpa_varlen_fwd`` and the decode merge launch ``_merge_split_list``) it launches.

On a GPU each specialisation is one Triton compile (~10-20 s of one core for sm_90), so this count
is what a test costs the native suite (``bench/gpu_suite.sh``).  Every test that launches the kernels
declares ``@pytest.mark.compiles(n)``; ``test_sdpa_varlen.py``'s autouse fixture counts the distinct
specialisations the test launches and fails it past ``n`` (and fails an undeclared test that launches
any), in the interpreter (CI) and on a GPU alike.

A specialisation is keyed as Triton keys its compile cache, conservatively (never fewer keys than
Triton makes): each tensor argument by dtype and whether its address is a multiple of 16, each int by
whether it is 1, a multiple of 16 or neither and whether it needs 64 bits, each float as fp32, and the
constexprs and launch options by value.
"""

from __future__ import annotations

import pytest
import torch


def _arg_key(a) -> object:
    if isinstance(a, torch.Tensor):
        return ("*", str(a.dtype), a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("i1", a)
    if isinstance(a, int):
        return ("i64" if not -2**31 <= a < 2**31 else "i32", "1" if a == 1 else ("D" if a % 16 == 0 else ""))
    if isinstance(a, float):
        return "fp32"
    return ("const", repr(a))


def specialisation(name: str, args: tuple, kwargs: dict) -> tuple:
    """The compile-cache key of one launch of kernel ``name``."""
    opts = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in ("grid", "warmup")))
    return (name, tuple(_arg_key(a) for a in args), opts)


class Counter:
    """The distinct specialisations launched while installed (``install``)."""

    def __init__(self) -> None:
        self.keys: set[tuple] = set()

    def install(self, monkeypatch: pytest.MonkeyPatch, kernels: dict) -> None:
        """Wrap each kernel's ``run`` (what ``kernel[grid](...)`` calls, compiled or interpreted)."""
        for name, kernel in kernels.items():
            original = kernel.run

            def run(*args, _name=name, _original=original, **kwargs):
                self.keys.add(specialisation(_name, args, kwargs))
                return _original(*args, **kwargs)

            monkeypatch.setattr(kernel, "run", run)

    def per_kernel(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key in self.keys:
            out[key[0]] = out.get(key[0], 0) + 1
        return out


def enforce(item: pytest.Item, counter: Counter) -> str | None:
    """The budget check after a test: an error message, or None.  The count is kept in the test's
    ``user_properties`` (the GPU suite's logs print it)."""
    n = len(counter.keys)
    item.user_properties.append(("compiles", n))
    marker = item.get_closest_marker("compiles")
    if marker is None:
        return (f"{item.nodeid} launched {n} kernel specialisations ({counter.per_kernel()}) but declares no "
                "compile budget: mark it @pytest.mark.compiles(N)") if n else None
    budget = marker.args[0]
    if n > budget:
        return (f"{item.nodeid} launched {n} kernel specialisations ({counter.per_kernel()}), over its compile "
                f"budget of {budget} (@pytest.mark.compiles): each is a Triton compile on a GPU")
    return None
