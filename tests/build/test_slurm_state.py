"""The sweep's reading of SLURM job states from the controller (``build/slurm_state.py``), on ``scontrol show job
-o`` lines as SLURM 22.05 prints them (abridged); tests/build/test_slurm.py drives it on a real cluster."""

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
