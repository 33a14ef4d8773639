"""The state of a sweep's SLURM jobs where the cluster keeps no accounting.

submitit learns a job's state from ``sacct``. On a cluster without accounting storage (a small or test cluster:
``AccountingStorageType=accounting_storage/none``) sacct exits 1, submitit keeps the state ``UNKNOWN``, and a job
that ended without writing its result (killed by the OOM killer, a node lost, a SIGKILL before its cleanup) is
waited for forever: the sweep never returns. ``StateWatcher`` asks ``sacct`` first, as submitit does, and where
that fails asks the controller (``scontrol show job``), which knows every job until ``MinJobAge`` after it ends.
A job the controller no longer knows has ended long ago; it is reported as ``PURGED``, so that submitit raises its
"has not produced any output" error for it instead of waiting. The sweep then writes that job's row itself
(``record_lost_job``): status ``killed``, the state SLURM gave it, and its log.
"""

import re
import subprocess
import time
from pathlib import Path

from submitit.slurm.slurm import SlurmInfoWatcher

PURGED = "PURGED"  # ended, and forgotten by the controller (past MinJobAge): not one of submitit's unfinished states


def task_ids(spec: str) -> list[int]:
    """SLURM's ArrayTaskId (``3``, ``0-7``, ``1,3,5``, ``0-15:4``, each with an optional ``%N`` throttle)."""
    found = []
    for part in spec.split("%")[0].split(","):
        first, _, rest = part.partition("-")
        last, _, step = rest.partition(":")
        found.extend(range(int(first), int(last or first) + 1, int(step or 1)))
    return found


def states_from_scontrol(text: str) -> dict[str, dict[str, str]]:
    """``scontrol show job -o`` output as submitit's info: {job id: {"JobID", "State", "NodeList"}}, the tasks of
    an array keyed ``<array>_<task>`` (a pending array's one record stands for each of its tasks)."""
    info = {}
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "JobId" not in fields or "JobState" not in fields:
            continue
        array, tasks = fields.get("ArrayJobId"), fields.get("ArrayTaskId")
        try:
            keys = [f"{array}_{t}" for t in task_ids(tasks)] if array and tasks and tasks != "N/A" else [fields["JobId"]]
        except ValueError:  # a task list this reader does not know: those jobs' states stay as they were
            continue
        for key in keys:
            info[key] = {"JobID": key, "State": fields["JobState"], "NodeList": fields.get("NodeList", "")}
    return info


class StateWatcher(SlurmInfoWatcher):
    """submitit's watcher (every registered job's state in one call, at 0, 2, 4, 8 ... s, then every ``delay_s``),
    with the controller asked where ``sacct`` fails."""

    def __init__(self, delay_s: int = 60) -> None:
        super().__init__(delay_s=delay_s)
        self._accounting = True  # until sacct fails once

    def update(self) -> None:
        command = self._make_command()
        if command is None:
            return
        self._num_calls += 1
        arrays = [command[i + 1] for i, word in enumerate(command) if word == "-j"]
        info = self._from_sacct(command) if self._accounting else None
        if info is None:
            self._accounting = False
            info = self._from_controller(arrays)
        self._info_dict.update(info)
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def _from_sacct(self, command: list[str]) -> dict | None:
        try:
            self._output = subprocess.check_output(command, stderr=subprocess.PIPE, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        return self.read_info(self._output)

    def _from_controller(self, arrays: list[str]) -> dict:
        info: dict[str, dict[str, str]] = {}
        for array in arrays:
            try:
                proc = subprocess.run(["scontrol", "show", "job", "-o", array], capture_output=True, text=True,
                                      timeout=60)
            except (OSError, subprocess.SubprocessError):
                continue  # the controller did not answer: the states stay as they were, asked again later
            if proc.returncode == 0:
                info.update(states_from_scontrol(proc.stdout))
            elif re.search(r"invalid job id", proc.stderr, re.IGNORECASE):
                for job_id in self._registered - self._finished:
                    if job_id.split("_")[0] == array:
                        info[job_id] = {"JobID": job_id, "State": PURGED, "NodeList": ""}
        return info


def watch_without_accounting() -> None:
    """Every SLURM job this process submits through submitit is watched by ``StateWatcher`` (submitit keeps one
    watcher for all its SLURM jobs, ``SlurmJob.watcher``; its own asks sacct only, every 600 s at most)."""
    from submitit.slurm.slurm import SlurmJob

    if not isinstance(SlurmJob.watcher, StateWatcher):
        SlurmJob.watcher = StateWatcher()


# submitit's UncompletedJobError: the job's id, its result file (in the job's submitit folder) and its state
_LOST = re.compile(r"Job (?P<id>\S+) \(task: \d+\) with path (?P<result>\S+)\s+has not produced any output "
                   r"\(state: (?P<state>[^)]*)\)")


def record_lost_job(message: str) -> str | None:
    """When ``message`` is submitit's error for a job that ended without its result (SLURM killed it: out of
    memory, a node lost, SIGKILL before its cleanup), the job's row of the sweep's summary (it could not write
    its own) and one line saying so; None for any other error."""
    from omegaconf import OmegaConf
    from submitit.core.utils import DelayedSubmission

    from pipeline.build.sweep import COLUMNS, record_job

    found = _LOST.search(message)
    if found is None:
        return None
    folder = Path(found["result"]).parent  # <sweep dir>/.submitit/<job id>
    sweep_dir, log = folder.parent.parent, folder / f"{found['id']}_0_log.err"
    error = (f"SLURM ended the job without its result (state {found['state']}: killed before its cleanup, e.g. "
             f"out of memory or its node lost); its log: {log}")
    try:
        # Hydra's job as submitit pickled it: (its overrides, the sweep dir key, its number, ...)
        overrides, _, num, *_ = DelayedSubmission.load(next(folder.glob("*_submitted.pkl"))).args
        dirname = OmegaConf.load(sweep_dir / "multirun.yaml").hydra.job.config.override_dirname
    except Exception as err:  # noqa: BLE001  (no row then; the line says why)
        return f"job {found['id']}: {error} (no row: {type(err).__name__}: {err})"
    # the overrides as Hydra's override_dirname shows them (the other rows' column)
    shown = sorted(o for o in overrides if o.split("=")[0].lstrip("+~") not in dirname.exclude_keys)
    row = dict.fromkeys(COLUMNS, "") | {"job": num, "status": "killed", "error": error,
                                       "overrides": dirname.item_sep.join(shown).replace("=", dirname.kv_sep)}
    if not (sweep_dir / str(num) / "job.json").exists():  # the job may have written its row and died after it
        record_job(sweep_dir, row)
    return f"job {num} ({row['overrides']}): {error}"
