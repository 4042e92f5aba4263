"""Runtime monitor, error policies and item accounting, in process (no torch).

Faulty components are registered in process with ``PluginManager.register``; the inference
service, where one is needed, is the real loopback fake OpenAI server of tests/support, driven
through the ``openai`` backend, and stopped, restarted or told to fail while the run goes on.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections import Counter

import pytest
import yaml
from loguru import logger

from nexrl_core import Option, hookimpl
from nexrl_core.builtins.evaluators import ExactMatchEvaluator
from nexrl_core.builtins.mock import MockTrainer
from nexrl_core.builtins.workers import SimpleRolloutWorker
from nexrl_core.controller import NexRLController, RunFailed
from nexrl_core.errors import ErrorSeverity
from nexrl_core.launch.recipe import load_recipe
from tests.support.openai_server import FakeOpenAIServer

pytestmark = pytest.mark.timeout(120)

INTERVAL, TIMEOUT = 0.5, 0.5  # runtime_monitor.health_check
SLACK = 0.6  # scheduling latency on a busy 2-core machine (monitor loop tick, thread wake-ups)
ROWS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


# -- faulty components ------------------------------------------------------------------------

class HangingTrainer(MockTrainer):
    """From step ``hang_at_step`` on, its health_check never answers (the thread keeps training)."""

    OPTIONS = {"hang_at_step": Option(0, int, "step from which health_check never answers (0: never)", ge=0)}

    def __init__(self, config):
        super().__init__(config)
        self.hang_since: float | None = None
        self.release = threading.Event()

    def train(self, trajectories):
        if self.global_step + 1 == int(self._config.hang_at_step) and self.hang_since is None:
            self.hang_since = time.monotonic()
        return super().train(trajectories)

    def health_check(self) -> bool:
        if self.hang_since is not None:
            self.release.wait(60)
        return super().health_check()


class ReportingTrainer(MockTrainer):
    """Reports one error of ``report_severity`` while training step ``report_at_step``."""

    OPTIONS = {"report_at_step": Option(2, int, "step whose training reports the error", ge=1),
               "report_severity": Option("error", str, "severity of the reported error")}

    def train(self, trajectories):
        if self.global_step + 1 == int(self._config.report_at_step):
            severity = ErrorSeverity(str(self._config.report_severity))
            self._activity_tracker.report_error(self._module_name, "train", f"injected {severity.value}", severity)
        return super().train(trajectories)


class DyingWorker(SimpleRolloutWorker):
    """Its thread dies (an exception escapes the worker loop) after ``die_after`` tasks."""

    OPTIONS = {"die_after": Option(3, int, "tasks before the worker thread dies", ge=0)}

    def _run_task(self, task, validating):
        if self.completed >= int(self._config.die_after):
            raise RuntimeError("worker thread crashed")
        super()._run_task(task, validating)


class BoomEvaluator(ExactMatchEvaluator):
    """Raises on rows flagged ``boom``."""

    def evaluate(self, data, evaluation_target):
        if data.get("boom"):
            raise ValueError("boom item")
        return super().evaluate(data, evaluation_target)


class LateFailureWorker(SimpleRolloutWorker):
    """A slow worker: the first failed trajectory of each ``boom`` sample is handed in only after the
    served weights changed (waiting up to 1 s), so it arrives stale and must be thrown away and
    rolled again; only the failure that is used may be recorded."""

    handed_late: set = set()

    def _put_trajectory(self, trajectory):
        key = (trajectory.get("uid"), trajectory.get("sample_index"))
        if trajectory.get("failed") and trajectory["task"].get("boom") and key not in self.handed_late:
            self.handed_late.add(key)
            deadline = time.monotonic() + 1.0
            while self._current_version() == trajectory["model_version"] and time.monotonic() < deadline:
                time.sleep(0.005)
        return super()._put_trajectory(trajectory)


class FaultPlugin:
    @hookimpl
    def nexrl_trainers(self):
        return {"hanging_mock": HangingTrainer, "reporting_mock": ReportingTrainer}

    @hookimpl
    def nexrl_rollout_workers(self):
        return {"dying": DyingWorker, "late_failure": LateFailureWorker}

    @hookimpl
    def nexrl_evaluators(self):
        return {"boom": BoomEvaluator}


# -- harness ------------------------------------------------------------------------------------

def _merge(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


BASE = {
    "logger": {"backend": [], "level": "WARNING"},
    "data": {"type": "inline", "rows": ROWS},
    "rollout_worker": {"num_workers": 2},
    "trajectory_pool": {"batch_size": 4, "group_size": 2, "key_list": ["uid"]},
    "trainer": {"type": "mock", "total_train_steps": 5},
    "service": {"inference_service": {"backend": "mock", "mode": "sum"}},
    "runtime_monitor": {"stop_timeout": 10, "health_check": {"check_interval": INTERVAL, "timeout": TIMEOUT},
                        "exception_handling": {"check_interval": 0.05}},
}


def openai_service(server: FakeOpenAIServer, **extra) -> dict:
    return {"inference_service": {"backend": "openai", "url": server.url, "model": server.model, "timeout": 2.0,
                                  "max_retries": 1, "retry_backoff": 0.02, "max_retry_time": 1.0, **extra}}


@pytest.fixture
def build(tmp_path, core_pm, reset_loguru):
    """``build(changes)`` -> a controller for BASE merged with ``changes`` (the fault plugin registered)."""
    core_pm.register(FaultPlugin(), name="faults", distribution="nexrl-faults (in-process)")

    def make(changes: dict) -> NexRLController:
        recipe = _merge({"run_dir": str(tmp_path / "run"), **BASE}, changes)
        recipe["service"] = changes.get("service", BASE["service"])  # a whole service section replaces the mock
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return NexRLController(load_recipe(str(path)), plugin_manager=core_pm)

    return make


@pytest.fixture
def warnings_logged():
    lines: list[str] = []
    handler = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    yield lines
    logger.remove(handler)


def record_detections(controller: NexRLController) -> list[tuple[float, list[str]]]:
    """(time, dead modules) of every health check the monitor makes."""
    seen: list[tuple[float, list[str]]] = []
    original = controller.activity_tracker.dead_modules

    def dead_modules(timeout: float = 5.0) -> list[str]:
        dead = original(timeout)
        seen.append((time.monotonic(), dead))
        return dead

    controller.activity_tracker.dead_modules = dead_modules
    return seen


def when_step(controller: NexRLController, step: int, action) -> threading.Thread:
    """Run ``action()`` in a thread once the trainer reached ``step``."""
    def watch():
        deadline = time.monotonic() + 60
        while controller.trainer.global_step < step and time.monotonic() < deadline:
            time.sleep(0.005)
        action()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


# -- health checks ------------------------------------------------------------------------------

def test_hung_module_is_detected_within_interval_plus_timeout(build):
    controller = build({"trainer": {"type": "hanging_mock", "total_train_steps": 100000, "step_time_s": 0.01,
                                    "hang_at_step": 3}})
    seen = record_detections(controller)
    try:
        with pytest.raises(RunFailed) as failed:
            controller.run()
    finally:
        controller.trainer.release.set()
    assert "health check failed: module trainer is dead or hung" in str(failed.value)
    detected = min(t for t, dead in seen if "trainer" in dead)
    assert detected - controller.trainer.hang_since <= INTERVAL + TIMEOUT + SLACK


def test_stopped_inference_server_is_noticed_within_one_health_interval(build):
    with FakeOpenAIServer() as server:
        controller = build({"trainer": {"total_train_steps": 100000, "step_time_s": 0.01},
                            "service": openai_service(server),
                            # the health check is what is timed here; the failed samples would stop it too
                            "runtime_monitor": {"failed_samples": {"enabled": False}}})
        seen = record_detections(controller)
        stopped_at: list[float] = []
        when_step(controller, 2, lambda: (server.stop(), stopped_at.append(time.monotonic())))
        with pytest.raises(RunFailed) as failed:
            controller.run()
    assert f"health check failed: the inference service at {server.url} stopped answering" in str(failed.value)
    detected = min(t for t, dead in seen if "inference_service" in dead)
    assert detected - stopped_at[0] <= INTERVAL + SLACK
    assert controller.trainer.global_step >= 2


def test_grace_period_lets_a_restarted_server_finish_the_run(build, warnings_logged):
    with FakeOpenAIServer() as server:
        controller = build({
            "trainer": {"total_train_steps": 8, "step_time_s": 0.01},
            # retries outlast the outage: no request fails for good
            "service": openai_service(server, max_retries=50, retry_backoff=0.05, max_retry_time=20.0),
            "runtime_monitor": {"health_check": {"check_interval": 0.2, "grace_period": 5.0}},
        })
        seen = record_detections(controller)

        def outage():
            server.stop()
            time.sleep(1.0)
            server.start()

        when_step(controller, 2, outage)
        summary = controller.run()
    assert summary.stopped_by == "finished" and summary.global_step == 8
    assert any("inference_service" in dead for _, dead in seen), "the outage was never noticed"
    assert any("waiting up to 5.0s" in line and "inference_service" in line for line in warnings_logged)
    assert not os.path.exists(os.path.join(controller.run_dir, "errors.jsonl"))  # nothing failed


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("policy", ["continue", "stop_on_error"])
def test_dead_rollout_worker_thread_is_detected(build, policy):
    controller = build({"rollout_worker": {"type": "dying", "num_workers": 1, "die_after": 3},
                        "trainer": {"total_train_steps": 1000},
                        "runtime_monitor": {"exception_handling": {"policy": policy}}})
    t0 = time.monotonic()
    with pytest.raises(RunFailed) as failed:
        controller.run()
    message = str(failed.value)
    if policy == "continue":  # the error is tolerated; the health check finds the dead thread
        assert "health check failed: module rollout_worker_0 is dead or hung" in message
    else:  # the exception that killed the thread stops the run first
        assert "(policy stop_on_error): rollout_worker_0/rollout: RuntimeError: worker thread crashed" in message
    assert time.monotonic() - t0 < 10


# -- error policies -----------------------------------------------------------------------------

@pytest.mark.parametrize("policy, severity, stops", [
    ("stop_on_error", "warning", False),
    ("stop_on_error", "error", True),
    ("stop_on_error", "critical", True),
    ("stop_on_critical", "error", False),
    ("stop_on_critical", "critical", True),
    ("continue", "critical", False),
])
def test_exception_policies(build, policy, severity, stops):
    steps = 20
    controller = build({"trainer": {"type": "reporting_mock", "total_train_steps": steps, "step_time_s": 0.01,
                                    "report_at_step": 2, "report_severity": severity},
                        "runtime_monitor": {"exception_handling": {"policy": policy}}})
    if stops:
        with pytest.raises(RunFailed) as failed:
            controller.run()
        assert str(failed.value) == f"stopping on {severity} (policy {policy}): trainer/train: injected {severity}"
        assert controller.trainer.global_step < steps
    else:
        summary = controller.run()
        assert summary.stopped_by == "finished" and summary.global_step == steps
        assert f"injected {severity}" in summary.errors


# -- nothing lost -------------------------------------------------------------------------------

def test_every_consumed_item_is_trained_or_recorded_once(build):
    """Evaluator raising on one row, the inference server failing some requests beyond retries,
    first failures handed in stale: every task the trainer consumed is either trained on or in
    errors.jsonl (once, with its cause and the step that consumed it); failed attempts thrown
    away as stale are rolled again, not recorded. (batch-async: in sync mode the trainer waits for
    every admitted rollout before it takes a batch, so no attempt can arrive stale.)"""
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b), **({"boom": True} if a == 6 else {})}
            for a, b in [(1, 2), (3, 4), (5, 6), (6, 1), (2, 2), (4, 5)]]
    steps, batch = 8, 4
    LateFailureWorker.handed_late = set()
    with FakeOpenAIServer() as server:
        server.fail_next(3, status=400)  # rejected: not retried, fails at once
        controller = build({
            "data": {"rows": rows},
            "rollout_worker": {"type": "late_failure", "num_workers": 4, "evaluator": {"type": "boom"}},
            "trainer": {"total_train_steps": steps, "step_time_s": 0.01},
            "weight": {"sync_mode": "batch-async"},
            "service": openai_service(server),
            # most of a batch fails here on purpose: the failed-sample stop is tested elsewhere
            "runtime_monitor": {"failed_samples": {"max_fraction": 1.0}},
        })
        when_step(controller, 3, lambda: server.fail_next(12, status=503))  # retried once, then fails
        summary = controller.run()
    assert summary.stopped_by == "finished" and summary.global_step == steps
    run_dir = controller.run_dir
    errors = [json.loads(line) for line in open(f"{run_dir}/errors.jsonl")]
    metrics = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]

    assert errors and not any(e["validation"] for e in errors)
    error_seqs = [e["seq"] for e in errors]
    assert len(error_seqs) == len(set(error_seqs)), "a seq is recorded twice"
    causes = {e["cause"] for e in errors}
    assert causes == {"evaluator_exception", "rollout_failure"}, causes
    for e in errors:
        assert e["message"] and 1 <= e["step"] <= steps
        if e["cause"] == "evaluator_exception":
            assert e["item"]["boom"] is True and "ValueError: boom item" in e["message"]
        else:
            assert f"inference server {server.url}" in e["message"]

    trained = [t["seq"] for b in controller.trainer.batches for t in b]
    assert len(trained) == len(set(trained)), "a task was trained twice"
    assert not set(trained) & set(error_seqs)
    state = controller.dataloader.state_dict()
    waiting = {t["seq"] for t in state["requeued"]} | {t["seq"] for t in state["pending"]}
    consumed = set(range(state["next_seq"])) - waiting
    assert len(consumed) == steps * batch
    assert consumed == set(trained) | set(error_seqs)

    # errors.jsonl agrees with metrics.jsonl step by step
    per_step = Counter(e["step"] for e in errors)
    train_rows = [r for r in metrics if "train/reward_mean" in r]
    assert [r["step"] for r in train_rows] == list(range(1, steps + 1))
    assert {r["step"]: int(r["train/num_failed"]) for r in train_rows if r["train/num_failed"]} == dict(per_step)
    # every failed attempt was reported (WARNING, with its seq); a failed attempt that arrived
    # stale was thrown away and its task rolled again: reported twice, recorded once
    attempts = Counter(e.details["seq"] for e in controller.activity_tracker.error_reporter.errors()
                       if e.severity is ErrorSeverity.WARNING and e.work_context in causes)
    assert set(error_seqs) <= set(attempts)
    assert any(n > 1 for n in attempts.values()), "no failed attempt was re-rolled: the scenario did not happen"
