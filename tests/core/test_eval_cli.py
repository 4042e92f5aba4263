"""`nexrl eval` as a user runs it (a subprocess) - docs/evaluation.md §`nexrl eval`.

- stdout is exactly one JSON object holding exactly the metrics of §Metrics;
- `--samples-out` writes one JSON line per sample with the documented fields;
- the numbers equal the training-time validation of the same served weight version: version 0
  (`validate_before_train`) without a checkpoint, version N with `checkpoint=.../global_step_N`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nexrl_core.testing import make_recipe, write_recipe
from tests.support.metrics import read_metrics

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "evaluation.md"
SAMPLE_FIELDS = {"uid", "sample_index", "data_source", "domain", "prompt", "response", "reward", "score", "failed", "error",
                 "model_version"}
VAL_ROWS = [{"prompt": f"{a} + {b}", "answer": str(a + b), "data_source": src} for a, b, src in
            [(1, 1, "easy"), (2, 3, "easy"), (4, 0, "easy"), (9, 9, "hard"), (7, 6, "hard"), (5, 8, "hard")]]
FAILING_ROW = {"prompt": "", "answer": "0", "data_source": "hard"}  # no prompt: a failed sample
N_SAMPLES = 2


def documented_names(score_keys, sources, n, expected_known=True) -> set[str]:
    """The metric names of the §Metrics table, instantiated (for rows without a tag)."""
    section = DOC.read_text(encoding="utf-8").split("## Metrics", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        m = re.match(r"\|\s*`(val/[^`]+)`\s*\|.*\|\s*([^|]+?)\s*\|\s*$", line)
        if not m:
            continue
        template, when = m.groups()
        if ("n > 1" in when and n <= 1) or ("expected" in when and not expected_known) or "a `tag`" in when or \
                ("unless `default` is the only data source" in when and set(sources) == {"default"}):
            continue
        expanded = {template.replace("<n>", str(n))}
        if "<data_source>" in template:
            expanded = {x.replace("<data_source>", s) for x in expanded for s in sources}
        if "<score_key>" in template:
            expanded = {x.replace("<score_key>", k) for x in expanded for k in score_keys}
        names |= expanded
    return names


def recipe_file(tmp_path, backend="mock", val_rows=(*VAL_ROWS, FAILING_ROW), **inference) -> Path:
    """4 mock steps validated every 2 on ``val_rows`` (the mock model ``backend``, mode: sum, with
    ``inference``'s keys), a checkpoint every 2; written to tmp_path/recipe.yaml."""
    recipe = make_recipe(
        None, run_dir=str(tmp_path / "run"), logger={"backend": [], "level": "WARNING"},
        data={"type": "inline", "rows": [{"prompt": "1 + 2", "answer": "3"}, {"prompt": "3 + 3", "answer": "6"}]},
        validate={"validate_before_train": True, "n_samples": N_SAMPLES,
                  "data": {"type": "inline", "rows": list(val_rows)}},
        rollout_worker={"num_workers": 3, "evaluator": {"type": "exact_match"}},
        trajectory_pool={"batch_size": 4, "group_size": 2, "key_list": ["uid"]},
        trainer={"type": "mock", "total_train_steps": 4, "save_freq": 2},
        weight={"sync_mode": "sync", "validate_freq": 2},
        service={"inference_service": {"backend": backend, "mode": "sum", "learn_steps": 8, "delay_s": 0.001,
                                       **inference}},
        runtime_monitor={"stop_timeout": 10, "exception_handling": {"check_interval": 0.05}})
    return Path(write_recipe(recipe, tmp_path / "recipe.yaml"))


def nexrl(*args, env_extra=None):
    """The `nexrl` console script (core plugins only unless ``env_extra`` says otherwise)."""
    env = dict(os.environ, NEXRL_LOAD_PLUGINS="")
    env.update(env_extra or {})
    script = Path(sys.executable).parent / "nexrl"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "nexrl_core.cli"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, env=env, timeout=120)


def val_rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in read_metrics(run_dir)
            if "val/num_samples" in r}


def test_eval_prints_one_json_summary_and_writes_samples(tmp_path):
    recipe = recipe_file(tmp_path)
    samples = tmp_path / "samples.jsonl"
    out = tmp_path / "eval"
    proc = nexrl("eval", recipe, "--samples-out", samples, "--out", out)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"stdout must hold exactly the JSON summary, got:\n{proc.stdout}"
    metrics = json.loads(lines[0])
    # docs/evaluation.md §Metrics: exactly the documented names
    assert set(metrics) == documented_names({"reward", "accuracy"}, {"easy", "hard"}, N_SAMPLES)
    n_rows = len(VAL_ROWS) + 1
    assert metrics["val/num_samples"] == n_rows * N_SAMPLES
    assert metrics["val/num_failed"] == N_SAMPLES and metrics["val/num_missing"] == 0
    assert metrics["val/num_prompts"] == n_rows

    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(records) == n_rows * N_SAMPLES  # one line per sample
    assert all(set(r) == SAMPLE_FIELDS for r in records)
    assert len({(r["uid"], r["sample_index"]) for r in records}) == len(records)
    assert all(isinstance(r["failed"], bool) for r in records)  # true or false, never null
    failed = [r for r in records if r["failed"]]
    assert len(failed) == N_SAMPLES and all(r["error"] for r in failed)
    # docs/evaluation.md §Denominators: the summary is recomputable from the sample lines
    rewards = [0.0 if r["failed"] else r["reward"] for r in records]
    assert metrics["val/reward"] == pytest.approx(sum(rewards) / len(rewards))
    hard = [0.0 if r["failed"] else r["reward"] for r in records if r["data_source"] == "hard"]
    assert metrics["val/hard_reward"] == pytest.approx(sum(hard) / len(hard))
    assert {r["model_version"] for r in records} == {0}
    # docs/evaluation.md §Failed samples: failures land in the evaluation's own errors.jsonl, never
    # in the training run's run_dir (which eval does not create or touch)
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == N_SAMPLES and all(e["validation"] for e in errors)
    assert not (tmp_path / "run").exists()
    assert json.loads((out / "metrics.json").read_text()) == metrics
    # it says what it scores and when it is done (stderr), and records what it scored
    said = [line for line in proc.stderr.splitlines() if line.startswith("eval: ")]
    assert said[0].startswith(f"eval: {recipe}: scoring validate.data with ") and \
        said[-1].startswith(f"eval: {n_rows * N_SAMPLES} samples scored in "), proc.stderr
    record = json.loads((out / "eval.json").read_text())
    assert record["recipe"] == str(Path(recipe).resolve()) and record["checkpoint"] is None
    assert record["num_samples"] == n_rows * N_SAMPLES and record["model"]
    assert (out / "samples.jsonl").exists() is False  # --samples-out named another file
    # a second evaluation into the same folder replaces its outputs, never appends
    again = nexrl("eval", recipe, "--out", out)
    assert again.returncode == 0, again.stderr
    assert len((out / "errors.jsonl").read_text().splitlines()) == N_SAMPLES
    assert len((out / "samples.jsonl").read_text().splitlines()) == n_rows * N_SAMPLES


def test_eval_never_writes_into_the_training_run(tmp_path):
    recipe = recipe_file(tmp_path)
    run = nexrl("run", recipe)
    assert run.returncode == 0, run.stderr
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    ev = nexrl("eval", recipe)
    assert ev.returncode == 0, ev.stderr
    after = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert after == before
    refused = nexrl("eval", recipe, "--out", tmp_path / "run")
    assert refused.returncode == 2 and "--out: " in refused.stderr and "is the training run's run_dir" in refused.stderr


def test_eval_exits_1_when_no_sample_could_be_scored(tmp_path):
    # no prompt: every sample fails
    recipe = recipe_file(tmp_path, val_rows=[FAILING_ROW, dict(FAILING_ROW, answer="1")])
    proc = nexrl("eval", recipe)
    assert proc.returncode == 1
    metrics = json.loads(proc.stdout)  # the summary is still printed
    assert metrics["val/num_failed"] == metrics["val/num_samples"] == 2 * N_SAMPLES
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: no sample could be scored: {2 * N_SAMPLES} of {2 * N_SAMPLES} failed; most common "
                      f"error: missing_prompt ({2 * N_SAMPLES} of {2 * N_SAMPLES}): task has no 'prompt' field"]
    assert "Traceback" not in proc.stderr


def test_eval_errors_are_one_message_on_stderr(tmp_path):
    proc = nexrl("eval", tmp_path / "missing.yaml")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "missing.yaml" in proc.stderr and "Traceback" not in proc.stderr


PLUGIN = textwrap.dedent("""
    from nexrl_core import Option, hookimpl
    from nexrl_core.builtins.mock import MockInferenceClient

    class CheckpointMock(MockInferenceClient):
        # the mock model, loadable from a checkpoint path like a real backend
        OPTIONS = {"model_path": Option(None, str)}

    @hookimpl
    def nexrl_inference_backends():
        return {"mock_ckpt": CheckpointMock}
""")


def install_plugin(root: Path) -> Path:
    root.mkdir()
    (root / "nexrl_evaltest_plugin.py").write_text(PLUGIN)
    info = root / "nexrl_evaltest-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nexrl-evaltest\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[nexrl]\nevaltest = nexrl_evaltest_plugin\n")
    return root


def test_eval_equals_training_time_validation_of_the_same_version(tmp_path):
    site = install_plugin(tmp_path / "site")
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "NEXRL_LOAD_PLUGINS": "nexrl-evaltest"}
    recipe = recipe_file(tmp_path, backend="mock_ckpt", model_path="initial")
    run = nexrl("run", recipe, env_extra=env)
    assert run.returncode == 0, run.stderr
    training = val_rows(tmp_path / "run")
    assert sorted(training) == [0, 2, 4]
    assert training[0]["val/reward"] != training[2]["val/reward"]  # the version matters to the mock model

    # the initial weights are version 0: validate_before_train's numbers
    ev = nexrl("eval", recipe, env_extra=env)
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout) == training[0]

    # checkpoint=.../global_step_2 is served as version 2: the validation of step 2
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_2"
    assert ckpt.is_dir()
    samples = tmp_path / "samples.jsonl"
    ev = nexrl("eval", recipe, f"checkpoint={ckpt}", "--samples-out", samples, env_extra=env)
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout) == training[2], "eval of global_step_2 != training-time validation of step 2"
    assert {json.loads(line)["model_version"] for line in samples.read_text().splitlines()} == {2}
