"""Sweeps (-m): jobs in parallel through joblib and through submitit, the report at the sweep root,
a failed job as a row, the SLURM preset."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def sweep(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "-m", f"output_root={tmp_path / 'out'}", "model=tiny_flat",
                           "backend=portable", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    (root,) = (tmp_path / "out" / "multirun").iterdir()
    return proc, root


def summary(root: Path) -> list[dict]:
    with (root / "summary.csv").open() as f:
        return list(csv.DictReader(f))


def test_joblib_sweep_shares_the_cache_and_reports_every_job(tmp_path):
    """4 jobs, 2 at a time: one export for the sweep; the cell job over the pool's limit fails as a
    row with its error while the others build; summary.csv/.md and both plots at the sweep root."""
    proc, root = sweep(tmp_path, "stages=[export,lower_kv,compile]", "measure_decode_steps=4",
                       "kv=sequence,cell", "kv.max_seqs=2,64")
    assert proc.returncode == 2 and "kv.max_seqs=64" in proc.stderr  # the sweep says a job failed
    assert "Joblib.Parallel" in proc.stdout or "Launching jobs" in proc.stdout
    rows = {(r["layout"], int(r["max_seqs"])): r for r in summary(root)}
    assert set(rows) == {("sequence", 2), ("sequence", 64), ("cell", 2), ("cell", 64)}
    failed = rows.pop(("cell", 64))
    assert failed["status"] == "failed" and "kv.max_seqs=64" in failed["error"] and failed["version"] == ""
    for (layout, max_seqs), row in rows.items():
        version = Path(row["version"])
        record = json.loads((version / "build.json").read_text())
        assert row["status"] == "ok" and version.parent.name.startswith("backend=portable,")
        assert f"kv.max_seqs={max_seqs}" in version.parent.name and f"kv={layout}" in version.parent.name
        assert int(row["kv_bytes"]) == record["kv_bytes_total"] and float(row["decode_tok_s"]) > 0
        assert float(row["artifact_mb"]) == round(record["artifacts"]["model.pte"]["bytes"] / 1e6, 3)
    assert sum("export" in r["stages_built"].split() for r in rows.values()) == 1  # one export for the sweep
    assert int(rows[("sequence", 64)]["kv_bytes"]) == 32 * int(rows[("sequence", 2)]["kv_bytes"])
    md = (root / "summary.md").read_text()
    assert "4 jobs, 1 failed" in md and md.count("\n| ") == 5
    for plot in ("kv_bytes.png", "decode_tokens_per_s.png"):
        assert (root / plot).read_bytes()[:8] == PNG, plot


def test_submitit_local_sweep(tmp_path):
    """The same jobs through submitit's machinery (local processes, as a SLURM cluster runs them)."""
    proc, root = sweep(tmp_path, "hydra/launcher=submitit_local", "stages=[export,lower_kv]", "kv.max_seqs=1,2")
    assert proc.returncode == 0, proc.stderr
    rows = summary(root)
    assert [(r["status"], r["max_seqs"]) for r in rows] == [("ok", "1"), ("ok", "2")]
    assert [int(r["kv_bytes"]) for r in rows] == [32768, 65536]
    assert (root / ".submitit").is_dir() and (root / "kv_bytes.png").read_bytes()[:8] == PNG


def test_slurm_preset_composes():
    from pipeline.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher.partition == "gpu" and launcher.timeout_min == 60 and "submitit_folder" in launcher
    assert (launcher.cpus_per_task, launcher.mem_gb) == (1, 4)  # a small cluster's defaults


def test_slurm_sweep_without_a_cluster_is_one_line(tmp_path):
    """hydra/launcher=slurm where SLURM is not installed (sbatch not on PATH), or its controller does not answer
    (a slurm.conf naming one that is down): one line naming what is missing and how to start the local cluster,
    exit 2, before Hydra writes any job."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    bare = tmp_path / "bin"
    bare.mkdir()
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=gone\nSlurmctldHost=localhost\nSlurmctldPort=9\nNodeName=n1 CPUs=1\n"
                    "PartitionName=p Nodes=n1\n")
    cases = [({**env, "PATH": str(bare)}, "sbatch is not on PATH")]
    import shutil

    if shutil.which("sbatch"):
        cases.append(({**env, "SLURM_CONF": str(conf)}, "slurmctld is not reachable"))
    for case_env, needle in cases:
        proc = subprocess.run([sys.executable, "-m", "pipeline", "-m", "hydra/launcher=slurm",
                               f"output_root={tmp_path / 'out'}", "kv.max_seqs=1,2"], cwd=tmp_path, env=case_env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("error: hydra/launcher=slurm: ") and needle in proc.stderr, proc.stderr
        assert "bash .ci/slurm-up" in proc.stderr
    assert not (tmp_path / "out").exists()
