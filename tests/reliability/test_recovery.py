"""Recovery without a person (issue #29 item 7, docs/reliability.md):

- every module's health check can fail: the trajectory pool, the validator and the data loaders
  when a call of theirs hangs (a lock held), a data loader that failed to draw a task, the
  weight-sync controller when a weight push failed (the Tinker client: tests/tinker_plugin);
- ``resume.on_failure: restart``: a run a failed module stops starts again from its newest
  checkpoint, counts the restart in run.json, trains every step exactly once, and gives up
  after ``resume.max_restarts``.

Real local runs on the mock components (no model).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from nexrl_core import hookimpl
from nexrl_core.builtins.dataloaders import InlineDataLoader
from nexrl_core.builtins.mock import MockTrainer
from nexrl_core.builtins.workers import SimpleRolloutWorker
from nexrl_core.cli import main
from nexrl_core.controller import NexRLController, RunFailed
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.testing import use_plugins
from nexrl_core.weight_sync import WeightSyncBackend, WeightSyncController

INTERVAL, TIMEOUT = 0.2, 0.5
ROWS = [{"prompt": f"{a} + {b}", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2)]]
FAULTS: dict[str, int] = {}  # what the plugin below injects: name -> how many times more


def _take(name: str) -> bool:
    if FAULTS.get(name, 0) > 0:
        FAULTS[name] -= 1
        return True
    return False


class FlakyTrainer(MockTrainer):
    """Raises in train step FAULTS['trainer_at'] while FAULTS['trainer'] lasts."""

    def train(self, trajectories):
        if self.global_step + 1 == FAULTS.get("trainer_at") and _take("trainer"):
            raise RuntimeError(f"injected trainer fault at step {self.global_step + 1}")
        return super().train(trajectories)


class FlakyWorker(SimpleRolloutWorker):
    """A bug in the worker (not an inference or evaluator failure): an error the policy stops on."""

    def step(self, task):
        if _take("worker"):
            raise KeyError("injected worker bug")
        return super().step(task)


class BrokenLoader(InlineDataLoader):
    """Fails to draw its task number FAULTS['loader_at'] (a loader bug met mid-run)."""

    def _take_locked(self):
        if self._next_seq >= FAULTS.get("loader_at", 1 << 30) and _take("loader"):
            raise IndexError("injected loader bug")
        return super()._take_locked()


class Plugin:
    @hookimpl
    def nexrl_trainers(self):
        return {"flaky": FlakyTrainer}

    @hookimpl
    def nexrl_rollout_workers(self):
        return {"flaky": FlakyWorker}

    @hookimpl
    def nexrl_dataloaders(self):
        return {"broken": BrokenLoader}


FlakyTrainer.CAPABILITIES = MockTrainer.CAPABILITIES

RECIPE = {
    "logger": {"backend": [], "level": "WARNING", "progress": "off"},
    "data": {"type": "inline", "rows": ROWS},
    "rollout_worker": {"num_workers": 2},
    "trajectory_pool": {"batch_size": 4, "group_size": 2},
    "trainer": {"type": "flaky", "total_train_steps": 6, "save_freq": 1, "step_time_s": 0.02},
    "service": {"inference_service": {"backend": "mock", "mode": "sum"}},
    "runtime_monitor": {"stop_timeout": 10, "health_check": {"check_interval": INTERVAL, "timeout": TIMEOUT},
                        "exception_handling": {"check_interval": 0.05}},
}


@pytest.fixture(autouse=True)
def _faults():
    FAULTS.clear()
    yield
    FAULTS.clear()


def _merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.fixture
def build(tmp_path, core_pm, reset_loguru):
    core_pm.register(Plugin(), name="recovery", distribution="nexrl-recovery (in-process)")

    def make(changes: dict | None = None) -> NexRLController:
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(_merge({"run_dir": str(tmp_path / "run"), **RECIPE}, changes or {})))
        return NexRLController(load_recipe(str(path)), plugin_manager=core_pm)
    return make


# -- health checks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("module, lock", [
    ("trajectory_pool", lambda c: c.trajectory_pool._lock),
    ("data_loader", lambda c: c.dataloader._lock),
])
def test_a_module_whose_calls_hang_fails_its_health_check(build, module, lock):
    """Before, these modules always answered healthy: a call that hung there stalled the run for ever."""
    controller = build({"trainer": {"total_train_steps": 100000}})
    held = threading.Event()

    def hang():
        while controller.trainer.global_step < 2:
            time.sleep(0.005)
        with lock(controller):
            held.set()
            time.sleep(3 * (INTERVAL + TIMEOUT))

    threading.Thread(target=hang, daemon=True).start()
    with pytest.raises(RunFailed) as failed:
        controller.run()
    assert held.is_set()
    assert f"health check failed: module {module} is dead or hung (no answer within {TIMEOUT:g}s)" \
        in str(failed.value)


def _health_while_held(module: Any, lock: Any) -> str | None:
    module.HEALTH_LOCK_WAIT_S = 0.1
    assert module.health_check() and module.health_problem() is None
    result: list[Any] = []
    with lock:  # a call stuck while holding it
        t = threading.Thread(target=lambda: result.append(module.health_problem()))
        t.start()
        t.join(5)
    assert module.health_check()  # released: healthy again
    return result[0]


def test_the_validator_and_a_validation_loader_whose_calls_hang_are_unhealthy():
    from nexrl_core.validator import Validator

    validator = Validator(OmegaConf.create({"n_samples": 1}))
    assert _health_while_held(validator, validator._lock) == "its validator lock has been held for over 0.1s"
    loader = InlineDataLoader(OmegaConf.create({"rows": ROWS, "group_size": 1}), is_validate=True)
    assert _health_while_held(loader, loader._lock) == "its data loader lock has been held for over 0.1s"


def test_a_data_loader_that_failed_to_draw_a_task_is_unhealthy(build):
    FAULTS.update(loader=1, loader_at=9)
    controller = build({"data": {"type": "broken"}, "trainer": {"total_train_steps": 100000},
                        "runtime_monitor": {"exception_handling": {"policy": "continue"}}})
    with pytest.raises(RunFailed) as failed:
        controller.run()
    assert "health check failed: module data_loader is dead or hung (drawing a task failed: IndexError: " \
           "injected loader bug)" in str(failed.value)
    assert FAULTS["loader"] == 0


class _FailingPush(WeightSyncBackend):
    def sync(self, trainer: Any, inference_client: Any, version: int) -> None:
        if version >= 1:
            raise ConnectionError("the inference server went away")


def test_the_weight_sync_controller_is_unhealthy_after_a_failed_push_and_when_its_lock_hangs():
    class Client:
        def set_model_version(self, version: int) -> None:
            pass

    wsc = WeightSyncController(OmegaConf.create({"sync_mode": "sync"}), backend=_FailingPush({}))
    wsc.set_module_references(None, None, None, Client())
    wsc.sync_weight_to_rollout_service()
    assert wsc.health_check() and wsc.health_problem() is None
    wsc._train_version["default"] = 1
    with pytest.raises(ConnectionError):
        wsc.sync_weight_to_rollout_service()
    assert not wsc.health_check()
    assert wsc.health_problem() == ("pushing weights v1 to the inference service failed: ConnectionError: the "
                                    "inference server went away")

    hung = WeightSyncController(OmegaConf.create({"sync_mode": "sync"}), backend=_FailingPush({}))
    assert _health_while_held(hung, hung._cond) == "its weight-sync lock has been held for over 0.1s"


# -- automatic restarts ----------------------------------------------------------------------------

@pytest.fixture
def nexrl(tmp_path, capfd, reset_loguru, monkeypatch):
    """``nexrl(*overrides)`` -> (exit code, run.json, stderr): ``nexrl run`` of RECIPE in process."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), **RECIPE}))

    def call(*overrides: str):
        with use_plugins(Plugin()):
            code = main(["run", str(path), *overrides])
        _, err = capfd.readouterr()
        return code, json.loads((tmp_path / "run" / "run.json").read_text()), err
    return call


RESTART = ["resume.on_failure=restart", "resume.max_restarts=2", "resume.restart_backoff=0.05"]


def _train_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "train/loss" in r]


def test_a_trainer_that_fails_once_is_restarted_from_its_checkpoint_and_finishes(nexrl, tmp_path):
    FAULTS.update(trainer=1, trainer_at=4)
    code, run, err = nexrl(*RESTART)
    assert code == 0, err
    assert run["exit_status"] == "finished" and run["global_step"] == 6
    assert run["restarts"] == 1
    assert [c["global_step"] for c in run["restart_causes"]] == [3]
    assert "injected trainer fault at step 4" in run["restart_causes"][0]["error"]
    assert "the run failed (restart 1 of 2)" in err and "restarting from the newest checkpoint" in err
    assert _train_steps(tmp_path / "run") == [1, 2, 3, 4, 5, 6]  # each step once: step 4 is not counted twice
    assert FAULTS["trainer"] == 0


def test_a_worker_error_the_policy_stops_on_is_restarted(nexrl, tmp_path):
    FAULTS.update(worker=1)
    code, run, err = nexrl(*RESTART, "rollout_worker.type=flaky")
    assert code == 0, err
    assert run["restarts"] == 1 and "injected worker bug" in run["restart_causes"][0]["error"]
    assert _train_steps(tmp_path / "run") == [1, 2, 3, 4, 5, 6]


def test_a_run_that_keeps_failing_stops_after_max_restarts(nexrl, tmp_path):
    FAULTS.update(trainer=99, trainer_at=2)
    code, run, err = nexrl(*RESTART)
    assert code == 1
    assert run["exit_status"] == "error" and run["restarts"] == 2 and len(run["restart_causes"]) == 2
    assert "injected trainer fault at step 2" in run["error"]
    assert FAULTS["trainer"] == 99 - 3  # the first attempt and two restarts
    assert _train_steps(tmp_path / "run") == [1]


def test_without_on_failure_restart_a_failure_stops_the_run(nexrl, tmp_path):
    FAULTS.update(trainer=1, trainer_at=2)
    code, run, _ = nexrl()
    assert code == 1 and run["restarts"] == 0 and "restart_causes" not in run


def test_the_wait_before_a_restart_doubles_up_to_its_maximum():
    from nexrl_core.config.schema import ResumeSettings
    from nexrl_core.launch.prologue import Restarts

    class Record:
        def note_restart(self, step, error):
            pass

    restarts = Restarts(ResumeSettings.of({"on_failure": "restart", "max_restarts": 4, "restart_backoff": 2.0,
                                           "restart_backoff_max": 5.0, "mode": "from_path", "resume_path": "/x"}))
    waits = []
    while restarts.allowed():
        waits.append(restarts.next(0, "boom", Record()))
    assert waits == [2.0, 4.0, 5.0, 5.0]


# -- one prologue for `nexrl run` and nexrl_core.run() (issue #42 step 3) ------------------------------

def test_the_library_call_restarts_as_nexrl_run_does(tmp_path, reset_loguru, monkeypatch):
    """nexrl_core.run() shares `nexrl run`'s prologue, restart-on-failure included (it had none)."""
    import nexrl_core

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "")
    FAULTS.update(trainer=1, trainer_at=4)
    with use_plugins(Plugin()):
        summary = nexrl_core.run({"run_dir": str(tmp_path / "run"), **RECIPE}, RESTART)
    assert summary.global_step == 6 and summary.stopped_by == "finished"
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["restarts"] == 1 and "injected trainer fault at step 4" in run["restart_causes"][0]["error"]
    assert run["command"][0].startswith("nexrl_core.run(")
    assert _train_steps(tmp_path / "run") == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("how", ["nexrl run", "nexrl_core.run()"])
def test_a_recipe_is_checked_once_per_run(how, nexrl, tmp_path, monkeypatch):
    """The recipe's checks run once, in the prologue; the controller (each attempt's, after a
    restart too) receives a started run and checks nothing."""
    import nexrl_core
    import nexrl_core.launch.recipe as recipe_module

    calls = []
    check = recipe_module.check_config
    monkeypatch.setattr(recipe_module, "check_config", lambda *a, **k: calls.append(1) or check(*a, **k))
    FAULTS.update(trainer=1, trainer_at=2)
    if how == "nexrl run":
        code, run, err = nexrl(*RESTART)
        assert code == 0 and run["restarts"] == 1, err
    else:
        with use_plugins(Plugin()):
            summary = nexrl_core.run({"run_dir": str(tmp_path / "run"), **RECIPE}, RESTART)
        assert summary.global_step == 6
    assert calls == [1]
