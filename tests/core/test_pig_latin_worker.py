"""The pig_latin worker's targets: computed from the source, or (NexRL's rows) read from a field,
with a row that lacks it failed by name rather than trained on an empty target."""

from __future__ import annotations

import pytest

from nexrl_core.builtins.workers import PigLatinRolloutWorker, pig_latin
from nexrl_core.rollout_worker import ItemFailure


class _Pool:
    def __init__(self) -> None:
        self.trajectories: list[dict] = []

    def put_trajectory(self, trajectory: dict) -> str:
        self.trajectories.append(dict(trajectory))
        return "success"


def _worker(**keys) -> tuple[PigLatinRolloutWorker, _Pool]:
    worker = PigLatinRolloutWorker({"type": "pig_latin", "prompt_key": "input", **keys})
    pool = _Pool()
    worker._put_trajectory = pool.put_trajectory  # the trajectory as the pool would receive it
    return worker, pool


def test_the_target_is_computed_without_target_key_and_read_with_it():
    computed, pool = _worker()
    computed.step({"uid": "a", "input": "hello world"})
    assert pool.trajectories[0]["response"] == pig_latin("hello world") == "ellohay orldway"
    read, pool = _worker(target_key="label.text")
    read.step({"uid": "b", "input": "hello world", "label": {"text": "ello-hay orld-way"}})
    assert pool.trajectories[0]["response"] == "ello-hay orld-way"
    assert pool.trajectories[0]["prompt"] == [{"role": "user", "content": "Translate to Pig Latin: hello world"}]


@pytest.mark.parametrize("row", [{"uid": "c", "input": "hi"}, {"uid": "d", "input": "hi", "output": ""}])
def test_a_row_without_its_target_fails_by_name(row):
    worker, pool = _worker(target_key="output")
    with pytest.raises(ItemFailure, match=r"no 'output' field \(rollout_worker.target_key\)") as failure:
        worker.step(row)
    assert failure.value.cause == "missing_target" and pool.trajectories == []
