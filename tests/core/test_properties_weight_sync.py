"""Properties of the WeightSyncController and of validation (docs/evaluation.md §Weight-sync modes,
§Weight version, §Samples, §Failed samples).

- the blocking rule of each mode matches the table of §Weight-sync modes over random event
  sequences, and every weight update pushes weights;
- a weight update waits for a running validation (one weight version per validation);
- through the real controller (``nexrl eval``'s path) with a random number of rollout workers,
  random failures of every kind and re-rollouts, every sample of the validation set is
  counted exactly once and failures are counted, never dropped.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loguru import logger

from nexrl_core import hookimpl
from nexrl_core.builtins.mock import MockInferenceClient
from nexrl_core.builtins.workers import SimpleRolloutWorker
from nexrl_core.controller import NexRLController
from nexrl_core.evaluation import EvaluationRunResult, Evaluator
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.plugins import PluginManager
from nexrl_core.runtime.inference import InferenceError
from nexrl_core.testing import make_recipe, write_recipe
from nexrl_core.weight_sync import WeightSyncController

pytestmark = pytest.mark.timeout(120)  # a deadlock fails the test instead of hanging the suite

@pytest.fixture(autouse=True, scope="module")
def _quiet():
    logger.disable("nexrl_core")
    yield
    logger.enable("nexrl_core")


# -- the blocking rule of each mode -------------------------------------------------------------

EVENTS = st.lists(st.sampled_from(["batch_ready", "batch_ready_outdated", "step_start", "weight_update",
                                   "validate"]), max_size=40)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["sync", "batch-async", "fully-async"]), st.integers(0, 3), EVENTS)
def test_blocking_rule_matches_the_documented_table(mode, threshold, events):
    # docs/evaluation.md §Weight-sync modes
    client = MockInferenceClient({"mode": "echo"})
    wsc = WeightSyncController({"sync_mode": mode, "staleness_threshold": threshold})
    wsc.set_module_references(None, None, None, client)
    wsc.sync_weight_to_rollout_service()
    bound = 0 if mode == "sync" else threshold
    train = started = 0
    ready = training = False
    for event in events:
        if event == "batch_ready":
            wsc.trajectory_pool_notify_batch_ready("default", train - bound)
            ready = True
        elif event == "batch_ready_outdated" and train > 0:
            wsc.trajectory_pool_notify_batch_ready("default", train - bound - 1)  # computed before a push
        elif event == "step_start" and not training:
            wsc.train_worker_notify_step_start("t")
            started, training = train + 1, True
        elif event == "weight_update" and training:
            wsc.train_worker_notify_weight_update("t")
            train, training, ready = train + 1, False, False
            assert client.model_version() == train and wsc.sync_count == train + 1  # pushed every step
        elif event == "validate":
            wsc.request_validation()
            assert wsc.check_rollout_service_status() == "block"  # training rollouts pause
            wsc.end_validate()
        expect_block = {"sync": ready, "batch-async": started - train > bound, "fully-async": False}[mode]
        assert wsc.check_rollout_service_status() == ("block" if expect_block else "continue"), (event, mode)
        assert wsc.min_trainable_version() == train - bound
        assert wsc.get_rollout_model_version() == train == wsc.get_train_model_version()


def test_sync_mode_forces_zero_staleness_and_bad_modes_are_rejected():
    assert WeightSyncController({"sync_mode": "sync", "staleness_threshold": 5}).staleness_threshold == 0
    assert WeightSyncController({"sync_mode": "fully-async", "staleness_threshold": 2}).staleness_threshold == 2
    from nexrl_core.errors import ConfigError

    with pytest.raises(ConfigError, match="sync_mode"):
        WeightSyncController({"sync_mode": "async"})
    with pytest.raises(ConfigError, match="staleness_threshold"):
        WeightSyncController({"sync_mode": "batch-async", "staleness_threshold": -1})


def test_weight_update_waits_for_a_running_validation():
    # docs/evaluation.md §Weight version: no weights move under a running validation
    client = MockInferenceClient({"mode": "echo"})
    wsc = WeightSyncController({"sync_mode": "fully-async", "staleness_threshold": 1, "validate_freq": 1})
    wsc.set_module_references(None, None, None, client)
    wsc.sync_weight_to_rollout_service()
    wsc.train_worker_notify_step_start("t")
    wsc.train_worker_notify_weight_update("t")  # version 1; validate_freq 1 -> validation requested
    assert wsc.is_waiting_for_validation() and client.model_version() == 1
    wsc.train_worker_notify_step_start("t")
    pusher = threading.Thread(target=wsc.train_worker_notify_weight_update, args=("t",), daemon=True)
    pusher.start()
    time.sleep(0.2)
    assert pusher.is_alive() and client.model_version() == 1 and wsc.get_train_model_version() == 1
    wsc.end_validate()
    pusher.join(5)
    assert not pusher.is_alive() and client.model_version() == 2


# -- validation counts every sample exactly once --------------------------------------------------

class FlakyEvaluator(Evaluator):
    """Exact match on ``answer``; raises for rows marked ``eval_fail``."""

    def evaluate(self, data, evaluation_target):
        if data.get("eval_fail"):
            raise RuntimeError("evaluator exploded")
        ok = evaluation_target.final_answer.strip() == str(data["answer"])
        return EvaluationRunResult(reward=float(ok), ground_truth=str(data["answer"]), metrics={"acc": float(ok)})


class TroubledWorker(SimpleRolloutWorker):
    """Rows can ask for: an inference failure, a step that gives up without a trajectory, or one
    re-rollout before succeeding."""

    retried: set = set()
    lock = threading.Lock()

    def step(self, task):
        key = (task["uid"], task["sample_index"])
        if task.get("infer_fail"):
            raise InferenceError("service unavailable")
        if task.get("drop"):
            return "fail"
        if task.get("retry"):
            with self.lock:
                first = key not in self.retried
                self.retried.add(key)
            if first:
                return "re-rollout"
        return super().step(task)


class _TestPlugin:
    @hookimpl
    def nexrl_evaluators(self):
        return {"flaky": FlakyEvaluator}

    @hookimpl
    def nexrl_rollout_workers(self):
        return {"troubled": TroubledWorker}


@pytest.fixture(scope="module")
def pm():
    manager = PluginManager(load_entrypoints=False)
    manager.register(_TestPlugin(), name="validation_props")
    return manager


ROW = st.fixed_dictionaries({
    "a": st.integers(0, 9), "b": st.integers(0, 9), "data_source": st.sampled_from(["x", "y"]),
    "kind": st.sampled_from(["ok", "ok", "ok", "eval_fail", "infer_fail", "drop", "retry"]),
})


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(rows=st.lists(ROW, min_size=1, max_size=10), n_samples=st.integers(1, 3), num_workers=st.integers(1, 6),
       delay=st.sampled_from([0.0, 0.002]))
def test_every_validation_sample_counted_exactly_once(pm, rows, n_samples, num_workers, delay):
    # docs/evaluation.md §Samples, §Denominators, §Failed samples, §Missing samples
    TroubledWorker.retried = set()
    data = [{"prompt": f"{r['a']} + {r['b']}", "answer": str(r["a"] + r["b"]), "data_source": r["data_source"],
             **({r["kind"]: True} if r["kind"] != "ok" else {})} for r in rows]
    with tempfile.TemporaryDirectory() as tmp:
        recipe = make_recipe(
            None, run_dir=os.path.join(tmp, "run"), logger={"backend": [], "level": "WARNING"},
            data={"type": "inline", "rows": data},
            validate={"n_samples": n_samples, "data": {"type": "inline", "rows": data}},
            rollout_worker={"type": "troubled", "num_workers": num_workers, "evaluator": {"type": "flaky"}},
            trajectory_pool={"batch_size": 1, "group_size": 1, "key_list": []},
            service={"inference_service": {"backend": "mock", "mode": "sum", "learn_steps": 4, "delay_s": delay}})
        path = write_recipe(recipe, os.path.join(tmp, "recipe.yaml"))
        controller = NexRLController(load_recipe(path), plugin_manager=pm, eval_only=True,
                                     eval_out=os.path.join(tmp, "eval"))
        metrics = controller.run_evaluation()
        trajs = controller.validator.trajectories()
        errors_path = os.path.join(tmp, "eval", "errors.jsonl")  # never the training run's run_dir
        assert not os.path.exists(os.path.join(tmp, "run"))
        errors = [json.loads(line) for line in open(errors_path)] if os.path.exists(errors_path) else []

    expected = {(f"0:{i}", j) for i in range(len(rows)) for j in range(n_samples)}
    keys = [(t["uid"], t["sample_index"]) for t in trajs]
    assert len(keys) == len(set(keys)) and set(keys) == expected  # each sample exactly once
    failing = sum(r["kind"] in ("eval_fail", "infer_fail", "drop") for r in rows) * n_samples
    assert metrics["val/num_samples"] == len(expected)
    assert metrics["val/num_missing"] == 0
    assert metrics["val/num_failed"] == failing
    assert len(errors) == failing and all(e["validation"] for e in errors)
    assert {e["cause"] for e in errors} <= {"evaluator_exception", "rollout_failure", "no_trajectory"}
    by_key = {(t["uid"], t["sample_index"]): t for t in trajs}
    rewards = {k: (0.0 if t.get("failed") else t["reward"]) for k, t in by_key.items()}
    assert metrics["val/reward"] == pytest.approx(sum(rewards.values()) / len(rewards))
    for source in {r["data_source"] for r in rows}:
        sub = [rewards[(f"0:{i}", j)] for i, r in enumerate(rows) if r["data_source"] == source
               for j in range(n_samples)]
        assert metrics[f"val/{source}_reward"] == pytest.approx(sum(sub) / len(sub))
    assert {t["model_version"] for t in trajs} == {0}  # one weight version
