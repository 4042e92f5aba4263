"""A plugin's author can see why it failed (issue 18, item 7).

An evaluator that raises: each distinct error (same exception type, same line) is shown once on
the console, naming the evaluator, its distribution and ``file:line``; run.log holds every
occurrence and the traceback; errors.jsonl and ``nexrl eval --samples-out`` keep the reply that
caused it. A ``nexrl_step_end`` hook or a metrics sink that raises is reported by plugin name and
training goes on.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

from nexrl_core.cli import main
from nexrl_core.testing import make_recipe, write_recipe

EVALUATOR = textwrap.dedent('''
    from nexrl_core import EvaluationRunResult, Evaluator, hookimpl


    class Picky(Evaluator):
        def evaluate(self, data, evaluation_target):
            reply = evaluation_target.final_answer
            if "key" in reply:
                return EvaluationRunResult(reward=float(data["no_such_field"]))
            if "zero" in reply:
                return EvaluationRunResult(reward=1 / 0)
            return EvaluationRunResult(reward=float(reply == data["answer"]))


    @hookimpl
    def nexrl_evaluators():
        return {"picky": Picky}
''')

HOOKS = textwrap.dedent('''
    from nexrl_core import hookimpl

    CALLS = []


    class BrokenSink:
        def __init__(self, config, run_dir):
            pass

        def log(self, metrics, step):
            raise ConnectionError("tracker unreachable")

        def close(self):
            pass


    @hookimpl
    def nexrl_metrics_sinks():
        return {"broken": BrokenSink}


    @hookimpl
    def nexrl_step_end(step, metrics):
        CALLS.append(step)
        raise RuntimeError(f"cannot upload step {step}")
''')

ROWS = [{"prompt": "alpha", "answer": "alpha"}, {"prompt": "beta", "answer": "beta"},
        {"prompt": "gamma", "answer": "gamma"}, {"prompt": "the key one", "answer": "x"},
        {"prompt": "zero, then", "answer": "x"}, {"prompt": "delta", "answer": "delta"}]


def _load(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _recipe(tmp_path, steps=2, validation=True, **sections):
    """ROWS in file order, echoed by the mock model and scored by the picky evaluator; validated on
    ROWS before training unless not ``validation``; ``sections`` merge in (the kit's make_recipe)."""
    recipe = make_recipe(
        None, run_dir=str(tmp_path / "run"),
        data={"type": "inline", "rows": ROWS, "shuffle": False},
        rollout_worker={"num_workers": 2, "evaluator": {"type": "picky"}},
        service={"inference_service": {"backend": "mock", "mode": "echo"}},
        trainer={"type": "mock", "total_train_steps": steps},
        trajectory_pool={"batch_size": 6, "group_size": 1, "key_list": []},
        validate={"validate_before_train": True, "data": {"type": "inline", "rows": ROWS}} if validation
        else {"validate_before_train": False},
        runtime_monitor={"stop_timeout": 10, "health_check": {"check_interval": 0.5},
                         "exception_handling": {"check_interval": 0.05}, "failed_samples": {"enabled": False}})
    return Path(write_recipe(make_recipe(recipe, **sections), tmp_path / "recipe.yaml"))


def test_evaluator_errors_once_on_console_every_one_in_run_log_with_the_reply(tmp_path, core_pm, capfd,
                                                                              reset_loguru, monkeypatch):
    module = _load(tmp_path, "picky_eval_plugin", EVALUATOR)
    core_pm.register(module, name="picky", distribution="nexrl-evaluator-picky")
    recipe = _recipe(tmp_path)
    assert main(["run", str(recipe)]) == 0
    err = capfd.readouterr().err

    key_line = "evaluator 'picky' (nexrl-evaluator-picky) raised KeyError: 'no_such_field' " \
               f"({tmp_path}/picky_eval_plugin.py:9 in evaluate)"
    zero_line = "evaluator 'picky' (nexrl-evaluator-picky) raised ZeroDivisionError: division by zero " \
                f"({tmp_path}/picky_eval_plugin.py:11 in evaluate)"
    # 3 passes (validation + 2 steps) x 2 failing rows: each distinct error once on the console
    assert err.count(key_line) == 1 and err.count(zero_line) == 1, err
    assert "Traceback" not in err
    log = (tmp_path / "run" / "run.log").read_text()
    # every occurrence (a rollout started for a step the run did not reach may add one)
    assert log.count(key_line) >= 3 and log.count(zero_line) >= 3
    assert log.count("Traceback (most recent call last)") == 2  # the first of each, in full
    assert 'in evaluate\n    return EvaluationRunResult(reward=float(data["no_such_field"]))' in log

    errors = [json.loads(line) for line in (tmp_path / "run" / "errors.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(errors) == 2 + sum(r.get("train/num_failed", 0) for r in metrics)  # validation + training
    assert {(e["item"]["prompt"], e["response"]) for e in errors} == {("the key one", "the key one"),
                                                                      ("zero, then", "zero, then")}
    assert all(e["cause"] == "evaluator_exception" and "Traceback" in e["error_traceback"] for e in errors)

    # nexrl eval keeps the reply with the failure in --samples-out
    samples = tmp_path / "samples.jsonl"
    code = main(["eval", str(recipe), "--samples-out", str(samples)])
    assert code == 0
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    failed = {r["response"]: r["error"] for r in rows if r["failed"]}
    assert set(failed) == {"the key one", "zero, then"}
    assert "picky_eval_plugin.py:11 in evaluate" in failed["zero, then"]


def test_a_failing_step_end_hook_or_sink_is_named_and_training_goes_on(tmp_path, core_pm, capfd, reset_loguru):
    _load(tmp_path, "picky_eval_plugin2", EVALUATOR.replace('"picky"', '"picky2"'))
    hooks = _load(tmp_path, "hooks_plugin", HOOKS)
    core_pm.register(sys.modules["picky_eval_plugin2"], name="picky2", distribution="nexrl-evaluator-picky")
    core_pm.register(hooks, name="uploader", distribution="nexrl-uploader")
    recipe = _recipe(tmp_path, steps=3, logger={"backend": ["console", "broken"], "level": "INFO"})
    code = main(["run", str(recipe), "rollout_worker.evaluator.type=picky2"])
    err = capfd.readouterr().err
    assert code == 0, err
    assert hooks.CALLS == [1, 2, 3]  # called every step although it raised every time
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "train/reward_mean" in r] == [1, 2, 3]

    hook_line = "plugin 'uploader' (nexrl-uploader): nexrl_step_end raised RuntimeError: cannot upload step"
    sink_line = "metrics sink 'broken' (nexrl-uploader): log raised ConnectionError: tracker unreachable " \
                f"({tmp_path}/hooks_plugin.py:12 in log); training goes on"
    assert err.count(hook_line) == 1 and err.count(sink_line) == 1, err
    assert f"({tmp_path}/hooks_plugin.py:26 in nexrl_step_end); training goes on" in err
    log = (tmp_path / "run" / "run.log").read_text()
    assert log.count(hook_line) == 3
    assert log.count(sink_line) == 4  # validation row + 3 training rows
    assert "step 3/3" in err  # the console still reports every step (plain progress lines off a terminal)


# -- one error, one message (issue 31, items 3 and 4) -----------------------------------------------

WORKERS = textwrap.dedent('''
    from nexrl_core import hookimpl
    from nexrl_core.builtins.workers import SimpleRolloutWorker


    class NoReward(SimpleRolloutWorker):
        def _put_trajectory(self, trajectory):
            if not trajectory.get("failed"):
                trajectory["reward"] = None  # (a trajectory without the key is scored by the evaluator)
            return super()._put_trajectory(trajectory)


    class Crashing(SimpleRolloutWorker):
        def step(self, task):
            secret_prompt = "SECRET-" + str(task["prompt"])
            return {"len": len(secret_prompt)}["width"]


    @hookimpl
    def nexrl_rollout_workers():
        return {"no_reward": NoReward, "crashing": Crashing}
''')

LOCAL_VARIABLES = ("│", "└", "SECRET-")  # what loguru's `diagnose` draws under each traceback line


def _run_broken_worker(tmp_path, core_pm, capfd, worker, *overrides):
    module = _load(tmp_path, f"broken_workers_{worker}", WORKERS)
    core_pm.register(module, name="broken", distribution="nexrl-broken-workers")
    recipe = _recipe(tmp_path, steps=3, validation=False)
    code = main(["run", str(recipe), f"rollout_worker.type={worker}", "rollout_worker.evaluator.type=exact_match",
                 *overrides])
    return code, capfd.readouterr().err, (tmp_path / "run")


BROKEN = {
    "no_reward": ("rollout worker 'no_reward' (nexrl-broken-workers) handed on a trajectory without a 'reward': "
                  "every trajectory needs a finite number 'reward'", "bad_trajectory"),
    "crashing": ("rollout worker 'crashing' (nexrl-broken-workers) raised KeyError: 'width' ({}/"
                 "broken_workers_crashing.py:16 in step)", "worker_exception"),
}


@pytest.mark.parametrize("worker", sorted(BROKEN))
def test_a_broken_worker_stops_the_run_with_one_message_naming_it(tmp_path, core_pm, capfd, reset_loguru, worker):
    # the default error policy (stop_on_error) ends the run on a worker's bug: said once, in its error line
    code, err, run = _run_broken_worker(tmp_path, core_pm, capfd, worker)
    message = BROKEN[worker][0].format(tmp_path)
    assert code == 1, err
    assert err.count(message) == 1, err
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0]
    assert error_lines[0].startswith("error: stopping on error (policy stop_on_error): rollout_worker_")
    assert "Traceback" not in err and not any(mark in err for mark in LOCAL_VARIABLES), err
    # Short: the header, the footer and one line a step (how many steps run before the monitor
    # stops the run depends on its check interval and the machine's load).
    assert len([line for line in err.splitlines() if not line.lstrip().startswith("step ")]) < 20, err
    log = (run / "run.log").read_text()
    assert message in log and not any(mark in log for mark in LOCAL_VARIABLES)
    if worker == "crashing":
        assert "Traceback (most recent call last)" in log and \
            'return {"len": len(secret_prompt)}["width"]' in log


@pytest.mark.parametrize("worker", sorted(BROKEN))
def test_a_broken_worker_under_policy_continue_is_one_warning_and_errors_jsonl(tmp_path, core_pm, capfd,
                                                                               reset_loguru, worker):
    code, err, run = _run_broken_worker(tmp_path, core_pm, capfd, worker,
                                        "runtime_monitor.exception_handling.policy=continue")
    message, cause = BROKEN[worker][0].format(tmp_path), BROKEN[worker][1]
    assert code == 0, err  # (runtime_monitor.failed_samples is off in this recipe)
    assert err.count(message) == 1, err  # 18 failed samples, one line
    assert not any(mark in err for mark in LOCAL_VARIABLES) and "Traceback" not in err
    errors = [json.loads(line) for line in (run / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == 18 and {e["cause"] for e in errors} == {cause}
    assert all(e["message"].startswith(message) for e in errors)
    if worker == "crashing":
        assert all("KeyError: 'width'" in e["error_traceback"] and "SECRET-" not in e["error_traceback"]
                   for e in errors)
    rewards = [r["train/reward_mean"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if "train/reward_mean" in r]
    assert rewards == [0.0, 0.0, 0.0]  # nothing trained on: no trajectory passed with a made-up reward
