"""A SLURM job's state without a cluster: the sweep's reading of it from the controller (``build/slurm_state.py``),
on ``scontrol show job -o`` lines as SLURM 22.05 prints them (abridged), and a job's own verdict on the SIGTERM
that ends it (``cli._stop_on_sigterm``); tests/build/test_slurm.py drives both on a real cluster."""

import os
import signal
import subprocess
import time

import pytest

from pipeline.build.slurm_state import states_from_scontrol, task_ids


def test_task_ids_read_every_form_of_array_task_id():
    assert task_ids("3") == [3]
    assert task_ids("0-3") == [0, 1, 2, 3]
    assert task_ids("1-3%1") == [1, 2, 3]
    assert task_ids("1,3,5") == [1, 3, 5]
    assert task_ids("0-15:4") == [0, 4, 8, 12]
    assert task_ids("0,4-5%2") == [0, 4, 5]


def test_states_key_tasks_as_submitit_does():
    text = "\n".join([
        "JobId=67 ArrayJobId=67 ArrayTaskId=2-3%1 JobName=__main__ JobState=PENDING Reason=JobArrayTaskLimit NodeList=",
        "JobId=68 ArrayJobId=67 ArrayTaskId=0 JobState=RUNNING NodeList=n1",
        "JobId=69 ArrayJobId=67 ArrayTaskId=1 JobState=FAILED NodeList=n2",
        "JobId=70 JobName=wrap JobState=CANCELLED NodeList=n1",
        "JobId=71 ArrayJobId=71 ArrayTaskId=a-b JobState=PENDING NodeList=",  # unreadable: left out, not fatal
        "",
    ])
    info = states_from_scontrol(text)
    assert {k: v["State"] for k, v in info.items()} == {
        "67_2": "PENDING", "67_3": "PENDING", "67_0": "RUNNING", "67_1": "FAILED", "70": "CANCELLED"}
    assert info["67_1"] == {"JobID": "67_1", "State": "FAILED", "NodeList": "n2"}


def _status_on_sigterm(monkeypatch, scontrol_out: str | None) -> str:
    """The status a job's SIGTERM handler (``cli._stop_on_sigterm``) gives, ``scontrol show job`` at the job's
    start answering ``scontrol_out`` (None: scontrol missing), the signal sent right after."""
    from pipeline import cli

    def scontrol(*args, **kwargs):
        if scontrol_out is None:
            raise FileNotFoundError("scontrol")
        return subprocess.CompletedProcess(args, 0, stdout=scontrol_out, stderr="")

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setattr(subprocess, "run", scontrol)
    before = signal.getsignal(signal.SIGTERM)
    try:
        cli._stop_on_sigterm()
        with pytest.raises(cli.KilledBySlurm) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at the next bytecode
        return stopped.value.status
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sigterm_at_the_time_limit_is_a_timeout_and_before_it_a_cancel(monkeypatch):
    """SLURM's time limit cannot be shown on the test cluster (its least is a minute; a tiny build ends sooner), so
    the job's handler is driven here: the limit is read once at the start, the SIGTERM only compares clocks."""
    job = "JobId=7 JobState=RUNNING RunTime={} TimeLimit={} NodeList=n1"
    assert _status_on_sigterm(monkeypatch, job.format("00:00:59", "00:01:00")) == "timeout"
    assert _status_on_sigterm(monkeypatch, job.format("1-00:59:59", "1-01:00:00")) == "timeout"
    assert _status_on_sigterm(monkeypatch, job.format("00:00:05", "01:00:00")) == "cancelled"
    assert _status_on_sigterm(monkeypatch, job.format("00:00:05", "UNLIMITED")) == "cancelled"
    assert _status_on_sigterm(monkeypatch, "") == "cancelled"  # the controller said nothing: no limit known
    assert _status_on_sigterm(monkeypatch, "JobId=7 JobState=RUNNING TimeLimit=01:00:00") == "cancelled"  # no RunTime
    assert _status_on_sigterm(monkeypatch, None) == "cancelled"
