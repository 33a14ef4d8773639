"""The native CPU attention (kv.cpu_kernel=native) as a user builds it: the tokens that attend alone run by
pipeline/kernels/cpu/sdpa_gather.cpp (the op kept whole in the program), a block by the ATen form; on XNNPACK
(the default backend) in both layouts and with an 8-bit cache, and on portable; validated by the episode
against the eager oracle as the ATen form is; refused, in one line, where it cannot run. The kernel itself
against float64: tests/kernels/test_native_gather.py."""

import json
import shutil
import subprocess
import sys

import pytest

from conftest import compose_config
from pipeline.build.plan import plan_of
from pipeline.errors import ConfigError

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="kv.cpu_kernel=native is built with g++: none here")

CASES = {  # case: (the manifest's layout, the op the program calls, the build's overrides)
    "batched-sequence": ("batched-sequence", "kvcache::sdpa_gather_alone",
                         ("kv=sequence", "kv.max_seqs=3", "kv.cpu_kernel=native", "experiment_name=native")),
    "portable": ("batched-sequence", "kvcache::sdpa_gather_alone",
                 ("backend=portable", "kv=sequence", "kv.max_seqs=2", "kv.cpu_kernel=native", "validate.decode_steps=16",
                  "experiment_name=native_portable")),
    "cell int8": ("cell", "kvcache::sdpa_gather_alone_q8",
                  ("kv=cell", "kv.max_seqs=3", "kv.dtype=int8", "kv.cpu_kernel=native", "validate.decode_steps=16",
                   "experiment_name=native_cell8")),
}


def program_ops(pte) -> set[str]:
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(pte.read_bytes())
    program = getattr(program, "program", program)
    return {op.name for plan in program.execution_plan for op in plan.operators}


@pytest.mark.parametrize("case", CASES)
def test_native_attention_builds_and_validates(build_dir, case):
    layout, op, overrides = CASES[case]
    version = build_dir(*overrides)
    report = json.loads((version / "validation.json").read_text())
    assert report["passed"] and report["scenario"]["layout"] == layout
    assert json.loads((version / "manifest.json").read_text())["target"]["cpu_kernel"] == "native"
    ops = program_ops(version / "model.pte")
    assert op in ops, ops  # the decodes through the kernel (a block stays the ATen form)
    # a fresh process, as a server starts: the Session loads the kernels the manifest names before the program
    code = ("import sys; from pipeline.runtime.session import Session; s = Session(sys.argv[1]); s.add(0); "
            "print(int(s.step({0: [1, 2, 3]})[0].argmax()))")
    run = subprocess.run([sys.executable, "-c", code, str(version)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_native_attention_refusals(monkeypatch):
    """CUDA plans its own attention; the kernel reads float32 queries and float32 or int8 stores; without a
    compiler it cannot be built: each a one-line error naming the setting."""
    with pytest.raises(ConfigError, match=r"kv.cpu_kernel=native: backend=cuda") as err:
        plan_of(compose_config("kv.cpu_kernel=native", "backend=cuda", "stages=[export,lower_kv]"))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"kv.cpu_kernel=native reads float32 queries .* kv.dtype=bfloat16") as err:
        plan_of(compose_config("kv.cpu_kernel=native", "kv.dtype=bfloat16"))
    assert "\n" not in str(err.value)
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(ConfigError, match=r"kv.cpu_kernel=native: .*compiler.*kv.cpu_kernel=aten") as err:
        plan_of(compose_config("kv.cpu_kernel=native"))
    assert "\n" not in str(err.value)
    assert plan_of(compose_config()).target.layout.native is False  # the default: the ATen form
