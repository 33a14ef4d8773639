"""bench/kv_read_floor.py's forms compute the attention eager torch computes, lowered to XNNPACK (a smoke run
at toy sizes; the script asserts each form against eager torch before timing it, the native kernel's too)."""

import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def test_kv_read_floor_smoke(tmp_path):
    out = tmp_path / "results.md"
    run = subprocess.run([sys.executable, "kv_read_floor.py", "--layers", "1", "--shapes", "2x8", "--runs", "1",
                          "--out", str(out)], cwd=BENCH, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    table = out.read_text()
    forms = ["gathered (landed)", "gathered int8 (landed)", "head-major", "head-major, keys left"]
    if shutil.which("g++"):  # the native kernel, built and loaded into ExecuTorch's runtime
        forms += ["native (kv.cpu_kernel=native)", "native int8"]
    for form in forms:
        assert f"| 2x8 | {form} |" in table, table
