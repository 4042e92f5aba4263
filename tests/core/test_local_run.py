"""A complete run: controller -> data loader -> rollout workers -> pool -> trainer -> weight
sync -> validator, with the ``mock`` inference backend in ``mode: sum`` (a row "A + B" is
answered correctly once the served weight version reaches ``mock_sum_threshold(A, B)``) and the
``mock`` trainer. Every number is recomputed here from the rows and the versions. The shared run
goes once per launch mode (``local``: threads in this process; ``ray``: every module in a Ray
actor of the test cluster); what the tests read of the modules is read through their handles
just before the run releases them."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from nexrl_core import execute
from nexrl_core.builtins.mock import mock_sum_threshold
from nexrl_core.checkpoint import CORE_STATE_FILE

LEARN_STEPS = 4
TRAIN = [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3), (0, 7), (4, 4), (9, 1)]
VAL_SOURCES = {
    "arith": [(1, 0), (1, 1), (2, 1), (3, 3), (0, 0)],
    "big": [(10, 1), (12, 5), (11, 2)],
}
STEPS = 6
VALIDATE_FREQ = 2
N_SAMPLES = 2
BATCH, GROUP = 4, 2


def _row(a: int, b: int, source: str) -> dict:
    return {"prompt": f"What is {a} + {b}?", "answer": str(a + b), "data_source": source}


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _correct(a: int, b: int, version: int) -> float:
    return float(version >= mock_sum_threshold(a, b, LEARN_STEPS))


def _operands(prompt) -> tuple[int, int]:
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    a, b = re.search(r"(\d+) \+ (\d+)", text).groups()
    return int(a), int(b)


def expected_validation(version: int) -> dict[str, float]:
    """The seed's metric names, computed from the rows alone."""
    out: dict[str, float] = {}
    every = []
    for source, pairs in VAL_SOURCES.items():
        scores = [_correct(a, b, version) for a, b in pairs for _ in range(N_SAMPLES)]
        every += scores
        out[f"val/{source}_reward"] = out[f"val/{source}_accuracy"] = sum(scores) / len(scores)
    out["val/reward"] = out["val/accuracy"] = sum(every) / len(every)
    out["val/num_samples"] = float(len(every))
    return out


class Snapshot:
    """What the tests read of the modules, taken through their handles before the run ends."""

    def __init__(self, controller):
        self.batches = execute(controller.trainer.get_batches)
        self.global_step = execute(controller.trainer.get_global_step)
        self.rollout_version = execute(controller.weight_sync_controller.get_rollout_model_version)
        self.served_version = execute(controller.inference_client.model_version)


def run_and_snapshot(controller):
    """``controller.run()`` and a :class:`Snapshot` taken when its modules are stopped but not released."""
    taken = []
    release = controller.resource_manager.shutdown

    def snapshot_then_release():
        taken.append(Snapshot(controller))
        release()

    controller.resource_manager.shutdown = snapshot_then_release
    summary = controller.run()
    return summary, taken[0]


@pytest.fixture(scope="module", params=["local", "local-4-tasks-per-call", "ray"])
def finished_run(request, tmp_path_factory):
    """One run per launch mode shared by the tests below (module scope keeps the suite fast); also
    local mode with workers taking 4 tasks per call (one loader call, one engine call, one pool
    call for the 4): the same numbers."""
    from loguru import logger

    from nexrl_core.controller import NexRLController
    from nexrl_core.launch.recipe import load_recipe
    from nexrl_core.plugins import PluginManager
    from nexrl_core.testing import make_recipe, write_recipe

    launch_mode, tasks_per_call = ("local", 4) if request.param == "local-4-tasks-per-call" else (request.param, 1)
    if launch_mode == "ray":
        request.getfixturevalue("ray_cluster")
    tmp_path = tmp_path_factory.mktemp(f"{request.param}_run")
    train = _write_jsonl(tmp_path / "train.jsonl", [_row(a, b, "train") for a, b in TRAIN])
    val = [_write_jsonl(tmp_path / f"{s}.jsonl", [_row(a, b, s) for a, b in pairs])
           for s, pairs in VAL_SOURCES.items()]
    # the kit's mock recipe (mock trainer, mock model in mode: sum, quick monitor), on these files
    recipe = make_recipe(
        launch_mode=launch_mode, run_dir=str(tmp_path / "run"),
        data={"type": "file", "path": train},
        rollout_worker={"num_workers": 3, "tasks_per_call": tasks_per_call, "evaluator": {"type": "exact_match"}},
        trajectory_pool={"batch_size": BATCH, "group_size": GROUP},
        trainer={"type": "mock", "total_train_steps": STEPS, "save_freq": 2},
        weight={"validate_freq": VALIDATE_FREQ},
        service={"inference_service": {"learn_steps": LEARN_STEPS}},
        validate={"validate_before_train": True, "n_samples": N_SAMPLES, "data": {"type": "file", "path": val}})
    write_recipe(recipe, tmp_path / "recipe.yaml")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXRL_LOAD_PLUGINS", "")
        controller = NexRLController(load_recipe(str(tmp_path / "recipe.yaml")), plugin_manager=PluginManager())
        summary, snapshot = run_and_snapshot(controller)
    logger.remove()
    logger.add(lambda m: sys.stderr.write(m), level="WARNING")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return snapshot, summary, rows, tmp_path / "run"


def test_run_finishes_every_step(finished_run):
    snapshot, summary, _, _ = finished_run
    assert summary.stopped_by == "finished"
    assert summary.global_step == STEPS == snapshot.global_step
    assert len(snapshot.batches) == STEPS
    assert snapshot.rollout_version == STEPS
    assert snapshot.served_version == STEPS


def test_validation_numbers_are_exact(finished_run):
    _, summary, rows, _ = finished_run
    val_steps = [0] + list(range(VALIDATE_FREQ, STEPS + 1, VALIDATE_FREQ))
    assert [v["step"] for v in summary.validation] == val_steps
    logged = {r["step"]: r for r in rows if any(k.startswith("val/") for k in r)}
    assert sorted(logged) == val_steps
    assert len([r for r in rows if any(k.startswith("val/") for k in r)]) == len(val_steps)  # once each
    for step in val_steps:
        want = expected_validation(version=step)  # sync mode: validation at step s serves version s
        for source in (summary.validation[val_steps.index(step)], logged[step]):
            for key, value in want.items():
                assert source[key] == pytest.approx(value, abs=1e-12), (step, key)
            assert source["val/num_failed"] == 0.0 and source["val/num_missing"] == 0.0
    # the numbers move: the mock model learns, so a broken version flow would show
    assert expected_validation(0)["val/reward"] < expected_validation(STEPS)["val/reward"] == 1.0
    assert len({expected_validation(s)["val/reward"] for s in val_steps}) >= 3


def test_per_source_keys_exist_for_every_source(finished_run):
    _, summary, _, _ = finished_run
    keys = set(summary.validation[0])
    for source in VAL_SOURCES:
        assert {f"val/{source}_reward", f"val/{source}_accuracy"} <= keys
    assert not {k for k in keys if k.startswith("val/train_")}


def test_training_batches_are_whole_groups_of_the_current_version(finished_run):
    snapshot, _, rows, _ = finished_run
    train_rows = {r["step"]: r for r in rows if "train/reward_mean" in r}
    assert sorted(train_rows) == list(range(1, STEPS + 1))
    assert len([r for r in rows if "train/reward_mean" in r]) == STEPS
    for step, batch in enumerate(snapshot.batches, start=1):
        version = step - 1
        assert len(batch) == BATCH
        uids = [t["uid"] for t in batch]
        assert all(uids.count(u) == GROUP for u in uids)
        for uid in set(uids):
            group = [t for t in batch if t["uid"] == uid]
            assert sorted(t["sample_index"] for t in group) == list(range(GROUP))
            assert len({json.dumps(t["prompt"]) for t in group}) == 1
        rewards = []
        for t in batch:
            assert t["model_version"] == version
            a, b = _operands(t["prompt"])
            assert t["response"] == str(a + b) if _correct(a, b, version) else str(a + b + 1)
            assert t["reward"] == _correct(a, b, version)
            assert t["response_token_ids"] == list(t["response"].encode())
            assert t["token_versions"] == [version] * len(t["response_token_ids"])  # one version per token
            rewards.append(t["reward"])
        assert train_rows[step]["train/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
        assert train_rows[step]["train/num_trajectories"] == BATCH
        assert train_rows[step]["train/num_failed"] == 0
        assert train_rows[step]["train/staleness_max"] == 0
        assert train_rows[step]["train/token_staleness_max"] == train_rows[step]["train/token_staleness_mean"] == 0


def test_no_task_is_trained_twice(finished_run):
    snapshot, _, _, _ = finished_run
    trained = [t for batch in snapshot.batches for t in batch]
    seqs = [t["seq"] for t in trained]
    assert len(set(seqs)) == len(seqs)
    assert len({(t["uid"], t["sample_index"]) for t in trained}) == len(trained)
    for t in trained:  # the uid names the row ("<epoch>:<row index>") the prompt came from
        row = int(t["uid"].split(":")[1])
        assert _operands(t["prompt"]) == TRAIN[row]


def test_checkpoints_are_written(finished_run):
    _, _, _, run_dir = finished_run
    ckpt = run_dir / "checkpoints"
    assert sorted(os.listdir(ckpt)) == ["global_step_2", "global_step_4", "global_step_6"]
    for step in (2, 4, 6):
        state = json.loads((ckpt / f"global_step_{step}" / CORE_STATE_FILE).read_text())
        assert state["global_step"] == step
        assert state["weight_sync"]["train_version"] == {"default": step}  # the saved weights' version
    assert not (run_dir / "errors.jsonl").exists()  # nothing was lost


def test_resumed_run_validates_like_an_uninterrupted_one(run_local, tmp_path):
    """A checkpoint at step N serves version N after a resume (it used to come back as N-1)."""
    recipe = {
        "data": {"type": "inline", "rows": [_row(a, b, "train") for a, b in TRAIN[:2]]},
        "validate": {"data": {"type": "inline", "rows": [_row(a, b, "v") for a, b in [(1, 5), (2, 5), (0, 2)]]}},
        "trajectory_pool": {"batch_size": 2, "group_size": 1},
        "trainer": {"type": "mock", "total_train_steps": 2, "save_freq": 2},
        "weight": {"validate_freq": 1},
        "resume": {"mode": "auto"},
        "service": {"inference_service": {"backend": "mock", "mode": "sum", "learn_steps": 16}},
    }

    def val(version):
        pairs = [(1, 5), (2, 5), (0, 2)]
        return sum(float(version >= mock_sum_threshold(a, b, 16)) for a, b in pairs) / len(pairs)

    _, first = run_local(recipe)
    assert [(v["step"], v["val/reward"]) for v in first.validation] == [(1, val(1)), (2, val(2))]
    controller, resumed = run_local(recipe, overrides=["trainer.total_train_steps=4"])
    assert resumed.global_step == 4
    # the resumed step is validated again (its row was dropped from metrics.jsonl), then 3 and 4
    assert [(v["step"], v["val/reward"]) for v in resumed.validation] == [(s, val(s)) for s in (2, 3, 4)]
    assert [t["model_version"] for batch in controller.trainer.batches for t in batch] == [2, 2, 3, 3]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "val/reward" in r] == [1, 2, 3, 4]
