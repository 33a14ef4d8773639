"""The build's output without the libraries' known noise: C-level writes, Python warnings and log
records alike, real errors and unknown warnings through, everything with verbose."""

import subprocess
import sys

CHILD = r'''
import logging, os, sys, warnings
from pipeline.quiet import filtered_stderr
logging.basicConfig(stream=sys.stdout, format="%(message)s")  # as Hydra's job_logging=stdout
with filtered_stderr(enabled={enabled}) as noise:
    logging.getLogger("torchao").warning("Failed to load /venv/torchao/_C_mxfp8.so: Could not load this library")
    logging.getLogger("torchao").warning("a torchao message that matters")
    os.write(2, b"[cpuinfo_utils.cpp:71] Reading file /sys/devices/soc0/image_version\n")
    warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, "copyreg.py", 105)
    print("  return cls.__new__(cls, *args)", file=sys.stderr)
    print("a real problem", file=sys.stderr)
    warnings.warn_explicit("something new", UserWarning, "lib.py", 3)
    os.write(2, b"[cpuinfo_utils.cpp:125] CPU info and manual query on # of cpus dont match.\n")
print("hidden", noise["hidden"])
'''


def _run(enabled: bool):
    return subprocess.run([sys.executable, "-c", CHILD.format(enabled=enabled)], capture_output=True, text=True, check=True)


def test_known_noise_is_hidden_and_counted():
    proc = _run(True)
    assert proc.stderr.splitlines() == ["a real problem", "lib.py:3: UserWarning: something new"]
    # the two cpuinfo lines, the warning, its source line (linecache finds copyreg.py) and the indented line after it
    assert proc.stdout.splitlines() == ["a torchao message that matters", "hidden 6"]


def test_verbose_shows_everything():
    proc = _run(False)
    assert "cpuinfo_utils.cpp:71" in proc.stderr and "LeafSpec" in proc.stderr and "a real problem" in proc.stderr
    assert "Failed to load" in proc.stdout and proc.stdout.strip().endswith("hidden 0")
