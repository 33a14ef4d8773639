"""The stage cache (pipeline/cache): what reruns when a setting changes, damaged entries, concurrent
builds, a build killed mid-compile, and gc."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import compose_config
from pipeline.build.runner import build
from pipeline.build.versions import sha256_file
from pipeline.cache import Cache
from pipeline.cache.gc import gc

ROOT = str(Path(__file__).resolve().parents[2])
BASE = ("model=tiny_flat", "backend=portable", "stages=[export,lower_kv,compile,validate]", "validate.decode_steps=8")
OWN = re.compile(r"^(\[\d+/\d+\] \w+: (cached|building)|  |built |up to date: |removed )")
STATUS = re.compile(r"^\[\d+/\d+\] (\w+): (cached|building)(?: \((.*)\))?$", re.M)


def statuses(out: str) -> dict[str, tuple[str, str]]:
    return {stage: (how, why) for stage, how, why in STATUS.findall(out)}


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    root = tmp_path_factory.mktemp("cached")
    return root, build(compose_config(f"output_root={root}", *BASE))


def rebuild_with(capsys, root: Path, *overrides: str) -> tuple[Path, dict]:
    capsys.readouterr()
    version = build(compose_config(f"output_root={root}", *BASE, *overrides))
    return version, statuses(capsys.readouterr().out)


def test_unchanged_rebuild_runs_no_stage(first, capsys):
    root, version = first
    again, said = rebuild_with(capsys, root)
    assert again == version
    assert {stage: how for stage, (how, _) in said.items()} == dict.fromkeys(("export", "lower_kv", "compile", "validate"), "cached")


def test_a_setting_reruns_exactly_the_stages_downstream_of_it(first, capsys):
    root, version = first
    v2, said = rebuild_with(capsys, root, "validate.decode_steps=6")
    assert {s: how for s, (how, _) in said.items()} == {"export": "cached", "lower_kv": "cached", "compile": "cached",
                                                        "validate": "building"}
    assert "validate.decode_steps 8 -> 6" in said["validate"][1]
    assert sha256_file(v2 / "model.pte") == sha256_file(version / "model.pte")
    v3, said = rebuild_with(capsys, root, "kv.max_seqs=2")
    assert {s: how for s, (how, _) in said.items()} == {"export": "cached", "lower_kv": "building", "compile": "building",
                                                        "validate": "building"}
    assert "kv.max_seqs 1 -> 2" in said["lower_kv"][1] and "the result of lower_kv" in said["compile"][1]
    assert json.loads((v3 / "validation.json").read_text())["passed"]
    record = json.loads((v3 / "build.json").read_text())
    assert record["stage_entries"]["export"]["from"] == "cached" and record["stage_entries"]["compile"]["from"] == "built"
    _, said = rebuild_with(capsys, root, "force_from=compile")
    assert {s: how for s, (how, _) in said.items()} == {"export": "cached", "lower_kv": "cached", "compile": "building",
                                                        "validate": "building"}


def test_a_damaged_entry_is_reported_and_rebuilt(first, capsys):
    root, version = first
    record = json.loads((version / "build.json").read_text())
    entry = Path(record["cache_dir"]) / "compile" / record["stage_entries"]["compile"]["key"]
    program = entry / "files" / "model.pte"
    data = program.read_bytes()
    program.unlink()  # a new file: the version's hard link keeps the good bytes
    program.write_bytes(data[: len(data) // 2])
    v, said = rebuild_with(capsys, root, "validate.decode_steps=5")
    assert said["compile"][0] == "building" and "damaged (files/model.pte is" in said["compile"][1]
    assert sha256_file(v / "model.pte") == record["artifacts"]["model.pte"]["sha256"]  # rebuilt, the same bytes
    assert json.loads((v / "validation.json").read_text())["passed"]
    (entry / "entry.json").write_text("{")  # an unreadable record: rebuilt too
    _, said = rebuild_with(capsys, root, "validate.decode_steps=4")
    assert said["compile"][0] == "building" and "entry.json is unreadable" in said["compile"][1]


def test_gc_removes_what_no_version_references(first, capsys):
    root, _ = first
    v = build(compose_config(f"output_root={root}", *BASE, "validate.decode_steps=3"))
    key = json.loads((v / "build.json").read_text())["stage_entries"]["validate"]["key"]
    cache = Cache(root / ".cache")
    with cache.building(), pytest.raises(SystemExit, match="builds are running"):
        gc(cache.root, [root])  # never while a build may be about to publish its entries
    import shutil

    shutil.rmtree(v)
    before = {(e.path.parent.name, e.key) for e in cache.entries()}
    gc(cache.root, [root])
    after = {(e.path.parent.name, e.key) for e in cache.entries()}
    assert before - after == {("validate", key)}, (before - after, key)
    _, said = rebuild_with(capsys, root)  # what versions use is kept
    assert {how for how, _ in said.values()} == {"cached"}


def _pipeline(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}  # no PYTHONWARNINGS: the build's own filtering is under test
    return subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_concurrent_builds_share_one_entry_per_stage(tmp_path):
    """Two builds of one config at once: one builds each stage, the other waits and reuses it; two
    good versions."""
    args = (f"output_root={tmp_path}", *BASE[:2], "stages=[export,lower_kv,compile]")
    procs = [_pipeline(*args, cwd=tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        # only the project's own lines: stage lines, their progress, the summary; no library noise
        assert err == "" and all(OWN.match(line) for line in out.splitlines()), (out, err)
    versions = sorted(p.name for p in (tmp_path / "default").iterdir() if not p.name.startswith("."))
    assert versions == ["v0001", "v0002"]
    for stage in ("export", "lower_kv", "compile"):
        assert len([p for p in (tmp_path / ".cache" / stage).iterdir() if p.is_dir()]) == 1, stage
        assert sum(statuses(out)[stage][0] == "building" for out, _ in outs) == 1, stage
    assert sha256_file(tmp_path / "default" / "v0001" / "model.pte") == sha256_file(tmp_path / "default" / "v0002" / "model.pte")


def test_build_killed_during_compile_then_rerun(tmp_path):
    """SIGKILL during compile (as the out-of-memory killer does): no version, no compile entry; the
    rerun removes the debris, takes export and lower_kv from the cache and publishes a good v0001."""
    args = (f"output_root={tmp_path}", *BASE)
    proc = _pipeline(*args, cwd=tmp_path)
    for line in proc.stdout:
        if "compile: building" in line:
            break
    import time

    time.sleep(2)  # into ExecuTorch's lowering
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    exp = tmp_path / "default"
    debris = [p for p in exp.glob(".building-*") if p.is_dir()]
    assert len(debris) == 1 and not list(exp.glob("v[0-9]*"))
    assert [p.name for p in (tmp_path / ".cache" / "compile").iterdir() if p.is_dir() and not p.name.startswith(".")] == []
    rerun = _pipeline(*args, cwd=tmp_path)
    out, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err
    assert f"removed {debris[0]}: left by a build that died" in out and "pid" in out
    assert {s: how for s, (how, _) in statuses(out).items()} == {"export": "cached", "lower_kv": "cached",
                                                                  "compile": "building", "validate": "building"}
    assert sorted(p.name for p in exp.iterdir()) == ["v0001"]
    assert json.loads((exp / "v0001" / "validation.json").read_text())["passed"]
    assert not list((tmp_path / ".cache").glob("*/.tmp-*"))  # the killed build's half entry went with the rerun
