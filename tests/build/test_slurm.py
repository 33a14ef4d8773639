"""Sweeps on a real SLURM cluster: the one-host cluster of ``.ci/slurm-up`` (two slurmd nodes, n1 and n2, one
partition ``local``), which ``.ci/run`` starts before the suite. SLURM's own record of the jobs is its completion
log (``JobCompType=jobcomp/filetxt``: accounting storage is off, so there is no ``sacct``)."""

import csv
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cluster_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    proc = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20)
    return proc.returncode == 0 and "idle" in proc.stdout


pytestmark = pytest.mark.skipif(not _cluster_answers(),
                                reason="no SLURM cluster answers here (sinfo); `bash .ci/slurm-up` starts one as root")

SWEEP = ["model=tiny", "backend=portable", "stages=[export,lower_kv,compile]", "kv=sequence,cell", "kv.max_seqs=1,2"]


def command(tmp_path: Path) -> list[str]:
    """The sweep, each job asking for a whole node's CPUs (so that the four spread over both nodes whatever
    nproc is) and 1 GB (a tiny build's; the nodes share this host's memory)."""
    cpus = min(int(c) for c in subprocess.run(["sinfo", "-h", "-N", "-o", "%c"], capture_output=True, text=True,
                                              check=True).stdout.split())
    return [sys.executable, "-m", "pipeline", "-m", "hydra/launcher=slurm", "hydra.launcher.partition=local",
            f"hydra.launcher.cpus_per_task={cpus}", "hydra.launcher.mem_gb=1",
            f"output_root={tmp_path / 'out'}", f"cache_dir={tmp_path / 'cache'}", *SWEEP]


def environment() -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}


def summary(tmp_path: Path) -> list[dict]:
    """The newest sweep's rows."""
    roots = sorted(p for p in (tmp_path / "out" / "multirun").iterdir() if p.is_dir())
    with (roots[-1] / "summary.csv").open() as f:
        return list(csv.DictReader(f))


def completions(array_id: str) -> dict[str, tuple[str, str]]:
    """{job id: (state, node)} of the array's jobs in SLURM's completion log."""
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True).stdout
    log = Path(re.search(r"JobCompLoc\s*=\s*(\S+)", config).group(1))
    out = {}
    for line in log.read_text().splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        out[fields["JobId"]] = (fields["JobState"], fields["NodeList"])
    ids = _array_job_ids(array_id)
    return {j: out[j] for j in ids if j in out}


def _array_job_ids(array_id: str) -> list[str]:
    proc = subprocess.run(["scontrol", "show", "job", "-o", array_id], capture_output=True, text=True)
    return re.findall(r"JobId=(\d+)", proc.stdout)


def wait_gone(array_id: str, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not subprocess.run(["squeue", "-h", "-j", array_id], capture_output=True, text=True).stdout.strip():
            return
        time.sleep(1)
    raise AssertionError(f"SLURM array {array_id} still queued after {seconds} s")


def array_of(tmp_path: Path) -> str:
    """The SLURM array id of the sweep (submitit's folder per job: <array>_<task>)."""
    (array,) = {p.name.split("_")[0] for p in (tmp_path / "out" / "multirun").glob("*/.submitit/*") if p.name[0].isdigit()}
    return array


def test_four_job_sweep_runs_on_both_nodes_and_shares_one_export(tmp_path):
    proc = subprocess.run(command(tmp_path), cwd=tmp_path, env=environment(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = summary(tmp_path)
    assert [(r["status"], r["layout"], r["max_seqs"]) for r in rows] == [
        ("ok", "sequence", "1"), ("ok", "sequence", "2"), ("ok", "cell", "1"), ("ok", "cell", "2")]
    assert sum("export" in r["stages_built"].split() for r in rows) == 1  # the stage lock held across the jobs
    assert len([p for p in (tmp_path / "cache" / "export").iterdir() if p.is_dir()]) == 1
    array = array_of(tmp_path)
    wait_gone(array)
    done = completions(array)
    assert len(done) == 4 and {state for state, _ in done.values()} == {"COMPLETED"}, done
    assert {node for _, node in done.values()} == {"n1", "n2"}, done


def test_a_cancelled_job_is_a_row_and_resubmitting_builds_only_its_stages(tmp_path):
    """scancel on the last job of a running sweep, mid-build: its row says cancelled, the other three are ok, the
    cache holds no half entry and the job no version; the same sweep again builds that job's stages only."""
    sweep = subprocess.Popen(command(tmp_path), cwd=tmp_path, env=environment(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    # job 3 (kv=cell, max_seqs=2) is cancelled as soon as its build has begun (its .building-* directory exists):
    # the export is the first job's, its lower_kv and compile take ~10 s here
    deadline, building = time.monotonic() + 600, []
    while not building and time.monotonic() < deadline and sweep.poll() is None:
        building = list((tmp_path / "out" / "default").glob("*kv.max_seqs=2,kv=cell*/.building-*"))
        time.sleep(0.1)
    assert building, "job 3 never began its build"
    listing = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True).stdout
    victim = next(job for job, state in (line.split() for line in listing.splitlines() if line.strip())
                  if job.endswith("_3") and state == "RUNNING")
    subprocess.run(["scancel", victim], check=True)
    try:
        _, stderr = sweep.communicate(timeout=900)
    finally:
        sweep.kill()  # (a no-op once it has ended)
    # the last line is ours (Hydra's lines above it)
    assert sweep.returncode == 2 and stderr.splitlines()[-1].startswith("error: sweep:"), stderr[-2000:]
    assert "SLURM ended the job (cancelled" in stderr.splitlines()[-1]
    wait_gone(victim.split("_")[0])

    rows = summary(tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "cancelled"], rows
    assert "SLURM ended the job (cancelled" in rows[3]["error"] and rows[3]["version"] == ""
    assert not list((tmp_path / "cache").rglob(".tmp-*"))
    cancelled_dir = next((tmp_path / "out" / "default").glob("*kv.max_seqs=2,kv=cell*"))
    assert not list(cancelled_dir.glob("v0*")) and not list(cancelled_dir.glob(".building-*"))

    again = subprocess.run(command(tmp_path), cwd=tmp_path, env=environment(), capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    first, rows = rows, summary(tmp_path)
    # the finished jobs' versions are found whole and reused (no new version); the cancelled job builds its own
    # stages, the export the sweep shares coming from the cache
    assert [r["version"] for r in rows[:3]] == [r["version"] for r in first[:3]]
    assert not list((tmp_path / "out" / "default").glob("*/v0002"))
    assert rows[3]["status"] == "ok" and rows[3]["stages_built"] == "lower_kv compile"


def _job_processes(tmp_path: Path) -> list[int]:
    """The pids of the sweep's job processes (submitit's worker, ``python -u -m submitit.core._submit <folder>``)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode().split("\0")
        except OSError:
            continue
        if argv[1:4] == ["-u", "-m", "submitit.core._submit"] and argv[4].startswith(str(tmp_path)):
            found.append(int(cmdline.parent.name))
    return found


def test_a_job_killed_before_its_result_ends_the_sweep_with_its_row(tmp_path):
    """SIGKILL to a job mid-build (as the OOM killer sends it): no cleanup, no result. On this cluster sacct has no
    accounting to answer with, so submitit alone would wait for the job forever; the sweep asks the controller,
    ends with the job's error and writes its row (killed, SLURM's state, its log). The next build of the same
    config removes what the killed one left."""
    cmd = [*command(tmp_path)[:-2], "kv=sequence", "kv.max_seqs=1"]
    sweep = subprocess.Popen(cmd, cwd=tmp_path, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline, building = time.monotonic() + 600, []
    while not building and time.monotonic() < deadline and sweep.poll() is None:
        building = list((tmp_path / "out" / "default").glob("*/.building-*"))
        time.sleep(0.1)
    assert building, "the job never began its build"
    (pid,) = _job_processes(tmp_path)
    os.kill(pid, signal.SIGKILL)
    try:
        _, stderr = sweep.communicate(timeout=300)  # without the controller's states it never returned
    finally:
        sweep.kill()
    last = stderr.splitlines()[-1]
    assert sweep.returncode == 2 and last.startswith("error: sweep: job 0 (backend=portable,kv.max_seqs=1,"), stderr[-2000:]
    assert "SLURM ended the job without its result (state FAILED" in last and "_0_log.err" in last, last
    assert "sacct" not in stderr  # asked once, quietly; submitit's warning per poll no more
    (row,) = summary(tmp_path)
    assert row["status"] == "killed" and row["version"] == "" and row["error"] in last, row
    assert row["overrides"] == "backend=portable,kv.max_seqs=1,kv=sequence,model=tiny,stages=[export,lower_kv,compile]"

    again = subprocess.run(cmd, cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    (row,) = summary(tmp_path)
    assert row["status"] == "ok" and row["version"].endswith("v0001"), row
    assert not list((tmp_path / "out" / "default").glob("*/.building-*"))
