"""The serving session: it reads the layout from the artifact and refuses what it cannot serve."""

import pytest

from conftest import BATCHED, CELL
from pipeline.runtime.session import Session, SessionError


@pytest.fixture(scope="module")
def batched(build_dir):
    return build_dir(*BATCHED)


def test_layout_comes_from_the_artifact(batched, build_dir):
    assert Session(batched).layout == "batched-sequence" and Session(batched).max_seqs == 4
    assert Session(build_dir(*CELL)).layout == "cell"


def test_errors(batched):
    s = Session(batched)
    for i in range(4):
        s.add(i)
    with pytest.raises(SessionError, match="4 sequences are live"):
        s.add(4)
    with pytest.raises(SessionError, match="unknown sequence 'nope'"):
        s.step({"nope": [1]})
    with pytest.raises(SessionError, match="exceeds the artifact's max_step_tokens=16"):
        s.step({0: [1] * 17})
    s.release(3)
    s.add("new")  # a freed column is reused
    assert s.seqs["new"].slot == 3
    for _ in range(8):
        s.step({0: [5] * 16})
    with pytest.raises(SessionError, match="past the flat layers' capacity of 128"):
        s.step({0: [5]})


def test_logits_only_for_sampled_rows(batched):
    s = Session(batched)
    s.add("a")
    s.add("b")
    out = s.step({"a": [1] * 10, "b": [2] * 5})
    assert set(out) == {"a", "b"} and out["a"].shape == (512,)


def test_cell_pool_full(build_dir):
    s = Session(build_dir(*CELL))
    s.add("a")
    for _ in range(512 // 16):
        s.step({"a": [3] * 16})
    with pytest.raises(SessionError, match="cell pool is full"):
        s.step({"a": [3]})
    s.release("a")
    s.add("b")
    s.step({"b": [1, 2]})  # released cells are free again
