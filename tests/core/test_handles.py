"""Every module behind a handle that offers only public method calls through ``execute``, with
arguments and results pickled across it: what an actor handle is. A full mock run (validation,
failed items, checkpoints, a resume, ``nexrl eval``) must behave exactly as in local mode, and
nothing (controller, module, tracker, weight-sync backend) may read a module's attribute or call
it directly. This is the test that a launch mode with modules in other processes can rely on."""

from __future__ import annotations

import json

import pytest

import nexrl_core.launch
from nexrl_core.builtins.mock import mock_sum_threshold
from nexrl_core.controller import NexRLController
from nexrl_core.errors import ErrorSeverity
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.testing import make_recipe, write_recipe
from nexrl_core.types import NexRLRole
from tests.support import handles

LEARN_STEPS = 4
TRAIN = [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3)]
VAL = [(1, 0), (2, 1), (3, 3), (0, 0)]
STEPS, BATCH, GROUP = 6, 4, 2


def _row(a: int, b: int) -> dict:
    return {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}


def expected_validation(version: int) -> dict[str, float]:
    """Validation metrics from the rows alone; the one row with no prompt fails (score 0)."""
    scores = [float(version >= mock_sum_threshold(a, b, LEARN_STEPS)) for a, b in VAL] + [0.0]
    return {"val/reward": sum(scores) / len(scores), "val/num_samples": float(len(scores)), "val/num_failed": 1.0}


@pytest.fixture
def handles_launch_mode(monkeypatch):
    monkeypatch.setitem(nexrl_core.launch.LAUNCH_MODES, "test_handles", "tests.support.handles:HandleResourceManager")
    handles.reset()
    yield handles
    handles.reset()


@pytest.fixture
def make_controller(tmp_path, core_pm, reset_loguru, handles_launch_mode):
    def make(steps: int = STEPS, eval_only: bool = False, **extra) -> NexRLController:
        # the kit's mock recipe (mock trainer, mock model in mode: sum, quick monitor) on these rows
        recipe = make_recipe(
            launch_mode="test_handles", run_dir=str(tmp_path / "run"),
            data={"type": "inline", "rows": [_row(a, b) for a, b in TRAIN] + [{"prompt": "", "answer": "0"}]},
            rollout_worker={"num_workers": 3, "evaluator": {"type": "exact_match"}},
            trajectory_pool={"batch_size": BATCH, "group_size": GROUP},
            trainer={"type": "mock", "total_train_steps": steps, "save_freq": 2},
            weight={"validate_freq": 2},
            service={"inference_service": {"learn_steps": LEARN_STEPS}},
            validate={"validate_before_train": True,
                      "data": {"type": "inline", "rows": [_row(a, b) for a, b in VAL] + [{"prompt": ""}]}},
            **extra)
        path = write_recipe(recipe, tmp_path / "recipe.yaml")
        return NexRLController(load_recipe(path), plugin_manager=core_pm, eval_only=eval_only)

    return make


def _check_validations(validations: list[dict], steps: list[int]) -> None:
    assert [v["step"] for v in validations] == steps
    for v in validations:
        for key, value in expected_validation(v["step"]).items():
            assert v[key] == pytest.approx(value), (v["step"], key)


def test_a_full_run_through_method_only_handles(make_controller, tmp_path):
    controller = make_controller()
    assert isinstance(controller.trainer, handles.Handle)  # the controller got handles, not modules
    summary = controller.run()

    assert handles.VIOLATIONS == []
    assert summary.stopped_by == "finished" and summary.global_step == STEPS
    _check_validations(summary.validation, [0, 2, 4, 6])

    rm = controller.resource_manager
    trainer = rm.instances(NexRLRole.TRAINER)[0]
    tracker = rm.instances(NexRLRole.ACTIVITY_TRACKER)[0]
    # no module failed on a handle (a direct call would have become a worker exception)
    assert not [e for e in tracker.error_reporter.errors() if e.severity is not ErrorSeverity.WARNING]
    assert {e.work_context for e in tracker.error_reporter.errors()} == {"missing_prompt"}

    run_dir = tmp_path / "run"
    errors = [json.loads(line) for line in (run_dir / "errors.jsonl").read_text().splitlines()]
    assert {e["cause"] for e in errors} == {"missing_prompt"}
    assert {e["validation"] for e in errors} == {True, False}  # both paths reach the records through the tracker
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    # the trainer got each step's usable trajectories (a step of failed items only trains on nothing)
    assert [int(r["train/num_trajectories"]) for r in train_rows if r["train/num_trajectories"]] == \
        [len(b) for b in trainer.batches]
    assert all(r["train/num_trajectories"] + r["train/num_failed"] == BATCH for r in train_rows)
    assert sum(r["train/num_failed"] for r in train_rows) == sum(not e["validation"] for e in errors)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == \
        ["global_step_2", "global_step_4", "global_step_6"]

    # what went over the handles: the monitor, the data path and the records
    calls = handles.CALLS
    for role, method in [("trainer", "get_status"), ("trainer", "initialize_workers"), ("trainer", "stop"),
                         ("rollout_worker", "request_stop"), ("inference_service", "complete"),
                         ("inference_service", "set_model_version"), ("trajectory_pool", "get_batch"),
                         ("weight_sync_controller", "get_sync_stats"), ("validator", "put_trajectory"),
                         ("data_loader", "get_next_item"), ("validate_dataloader", "get_next_item"),
                         ("activity_tracker", "record_lost_item"), ("activity_tracker", "start")]:
        assert calls[(role, method)] > 0, (role, method)


def test_resume_and_health_checks_through_handles(make_controller, tmp_path):
    make_controller().run()
    handles.reset()
    controller = make_controller(steps=STEPS + 2, resume={"mode": "auto"})
    summary = controller.run()

    assert handles.VIOLATIONS == []
    assert summary.stopped_by == "finished" and summary.global_step == STEPS + 2
    _check_validations(summary.validation, [STEPS, STEPS + 2])  # the resumed step is validated again
    assert handles.CALLS[("trainer", "resume_checkpoint")] == 1
    assert handles.CALLS[("activity_tracker", "truncate_records_after")] == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == list(range(1, STEPS + 3))

    # the monitor's health check asks every module through its handle
    assert controller.resource_manager.instances(NexRLRole.ACTIVITY_TRACKER)[0].dead_modules(1.0) == []
    assert handles.VIOLATIONS == []
    for role in ("trainer", "rollout_worker", "trajectory_pool", "validator", "weight_sync_controller",
                 "inference_service", "data_loader", "validate_dataloader"):
        assert handles.CALLS[(role, "health_check")] > 0, role


def test_evaluation_through_handles(make_controller):
    controller = make_controller(eval_only=True)
    metrics = controller.run_evaluation()
    assert handles.VIOLATIONS == []
    for key, value in expected_validation(0).items():
        assert metrics[key] == pytest.approx(value)
    assert sorted(t["uid"] for t in controller.evaluation_samples) == sorted(f"0:{i}" for i in range(len(VAL) + 1))


def test_a_handle_refuses_attributes_and_direct_calls(handles_launch_mode):
    from nexrl_core import execute
    from nexrl_core.builtins.mock import MockInferenceClient

    client = handles.Handle(NexRLRole.INFERENCE_SERVICE, MockInferenceClient({"mode": "echo"}))
    assert execute(client.get_model_tag) == "default"
    with pytest.raises(AttributeError):
        client.model_tag  # noqa: B018 - an attribute, not a method
    with pytest.raises(AttributeError):
        client._version_lock  # noqa: B018
    with pytest.raises(TypeError):
        client.model_version()
    assert len(handles.VIOLATIONS) == 3
