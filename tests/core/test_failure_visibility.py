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

import yaml

from nexrl_core.cli import main

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


def _recipe(tmp_path, steps=2, **extra):
    recipe = {
        "run_dir": str(tmp_path / "run"),
        "data": {"type": "inline", "rows": ROWS, "shuffle": False},
        "rollout_worker": {"num_workers": 2, "evaluator": {"type": "picky"}},
        "service": {"inference_service": {"backend": "mock", "mode": "echo"}},
        "trainer": {"type": "mock", "total_train_steps": steps},
        "trajectory_pool": {"batch_size": 6, "group_size": 1, "key_list": []},
        "validate": {"validate_before_train": True, "data": {"type": "inline", "rows": ROWS}},
        "runtime_monitor": {"stop_timeout": 10, "health_check": {"check_interval": 0.5},
                            "exception_handling": {"check_interval": 0.05},
                            "failed_samples": {"enabled": False}},
        **extra,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


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
