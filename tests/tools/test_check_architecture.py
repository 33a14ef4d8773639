"""The package's architecture rules (``tools/check_architecture.py``): no import cycle, stages and
backends import no stage, role names only in the role table and the manifest, no ``none`` presence
tests, one call site building layouts. The checker is shown to catch each rule broken in a copy."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import check_architecture  # noqa: E402


def test_the_package_keeps_its_architecture():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "check_architecture.py")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    assert "0 violations" in proc.stdout


@pytest.fixture
def copy(tmp_path) -> Path:
    package = tmp_path / "pipeline"
    shutil.copytree(ROOT / "pipeline", package, ignore=shutil.ignore_patterns("__pycache__"))
    assert check_architecture.check(package) == []
    return package


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


@pytest.mark.parametrize("broken, needle", [
    # the cycle the runner and the dry run once had (a function-level import counts)
    ("build/dry_run.py", "import cycle: pipeline.build.dry_run <-> pipeline.build.runner"),
    ("stages/lower_kv.py", "imports the stage pipeline.stages.export: stages never import one another"),
    ("backends/cuda.py", "imports the stage pipeline.stages.validate: backends never import stages"),
    ("stages/compile.py", "the role name 'draft' outside the role table"),
    ("build/runner.py", "a presence test against 'none'"),
    ("runtime/session.py", "build_layout called outside pipeline.build.plan"),
])
def test_each_rule_fails_when_broken(copy, broken, needle):
    plant = {
        "build/dry_run.py": "\n\ndef _planted():\n    from pipeline.build.runner import build  # noqa: F401\n",
        "stages/lower_kv.py": "\nfrom pipeline.stages.export import run as _export  # noqa: E402,F401\n",
        "backends/cuda.py": "\n\ndef _planted():\n    from pipeline.stages.validate import programs_recipe  # noqa: F401\n",
        "stages/compile.py": "\n_PLANTED = {'draft': None}\n",
        "build/runner.py": "\n\ndef _planted(cfg):\n    return cfg.draft.name != \"none\"\n",
        "runtime/session.py": "\n\ndef _planted(cfg, args):\n    from pipeline.kv.layouts import build_layout\n\n"
                              "    return build_layout(cfg.kv, args)\n",
    }[broken]
    _append(copy / broken, plant)
    found = check_architecture.check(copy)
    assert any(needle in line for line in found), found
