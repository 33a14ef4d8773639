"""The kernel package with the paths since removed from ours, for the sweep's groups that time them.

Two launches (``split_launch``, ``dec_warps``), the merge launch (``merge_launch``, ``merge_rows``, the
plan's split list) and descriptor loads (``tma_paths``) were off by default and measured no win on the
H200 (docs/benchmarks_gpu_sdpa.md, "Tuning history"); the product kernel dropped them after
``REMOVED_AT``. Its package at that commit is the variant: not a copy kept in the tree, but taken from
git history when the sweep (or its test) needs it, into ``VARIANT_DIR`` (ignored, carried to a GPU
machine as ``.whl`` is: a device copy has no history; ``python -c "from bench.sdpa.removed import
removed_paths_package as r; print(r())"`` makes it). Only the modules ``bench/sdpa/versions.py`` loads
(``MODULES``) are taken: not the package's ``__init__`` or ``ops``, which would register ops under our names.

``SDPA_VARLEN_VARIANT`` names another directory. Its ``item_cap`` default is 0 (off) where ours is
1.5: the sweep builds the variant's ``Tuning`` from the running choice's fields plus the group's.
"""

import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

REMOVED_AT = "e06a1ce"
REPO = Path(__file__).resolve().parents[2]
VARIANT_DIR = REPO / ".whl" / f"sdpa_varlen_{REMOVED_AT}"
PACKAGE = "pipeline/kernels/sdpa_varlen"
MODULES = ("tuning.py", "plan.py", "attention.py", "tiles.py", "merge.py")


def removed_paths_package() -> str:
    """A directory holding the kernel package's ``MODULES`` at ``REMOVED_AT``, extracted from git
    history the first time."""
    given = os.environ.get("SDPA_VARLEN_VARIANT")
    if given:
        if not (Path(given) / "plan.py").is_file():
            raise FileNotFoundError(f"SDPA_VARLEN_VARIANT={given} holds no kernel package (plan.py)")
        return given
    if all((VARIANT_DIR / name).is_file() for name in MODULES):
        return str(VARIANT_DIR)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "kernel.tar"
        done = subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), REMOVED_AT,
                               *(f"{PACKAGE}/{name}" for name in MODULES)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise FileNotFoundError(f"the kernel package at {REMOVED_AT} (the sweep's removed paths) is not in "
                                    f"{VARIANT_DIR} and git could not give it ({done.stderr.strip()[:200]}); make it "
                                    "with the command in bench/sdpa/removed.py's docstring")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        VARIANT_DIR.mkdir(parents=True, exist_ok=True)
        for name in MODULES:
            (VARIANT_DIR / name).write_bytes((Path(tmp) / PACKAGE / name).read_bytes())
    return str(VARIANT_DIR)
