"""`nexrl run` end to end: the mock policy, the llm_judge evaluator from the installed
nexrl-rewards plugin, and a loopback judge server that fails on some rows. A judge failure must
be a failed sample (errors.jsonl, train/num_failed, val/num_failed), never a 0 in the reward mean."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from nexrl_core.testing import make_recipe, write_recipe
from tests.support.judge import judge_service

# The mock policy echoes the prompt, so each row's prompt is the reply the judge sees; its
# <<...>> part is what the loopback judge answers (see tests/support/judge.py).
ROWS = [
    ("q0 <<correct>>", 1.0),
    ("q1 <<incorrect>>", 0.0),
    ("q2 <<lorem ipsum>>", None),          # unparseable on every attempt: a judge failure
    ("q3 <<Score: 1/2>>", 0.5),
    ("q4 <<HTTP-500>>", None),             # the server errors on every attempt
    ("q5 <<garbage|correct>>", 1.0),       # garbage once, then a verdict: recovered by a retry
]
GROUP = 2
MAX_RETRIES = 1


def _nexrl() -> list[str]:
    exe = shutil.which("nexrl", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "nexrl_core.cli"]


def test_judge_failures_are_failed_samples_not_zero_rewards(judge_server, tmp_path):
    recipe = make_recipe(
        run_dir=str(tmp_path / "run"),
        data={"type": "inline", "shuffle": False, "rows": [{"prompt": p, "data_source": "judge"} for p, _ in ROWS]},
        trajectory_pool={"batch_size": len(ROWS) * GROUP, "group_size": GROUP},
        trainer={"total_train_steps": 1},
        rollout_worker={"num_workers": 3,
                        "evaluator": {"type": "llm_judge", "service": judge_service(judge_server),
                                      "prompt_template": "Judge this reply: {response}", "max_retries": MAX_RETRIES}},
        validate={"validate_before_train": True, "n_samples": 1,
                  "data": {"type": "inline", "rows": [{"prompt": p, "data_source": "judge"} for p, _ in ROWS]}},
        service={"inference_service": {"backend": "mock", "mode": "echo"}})
    path = write_recipe(recipe, tmp_path / "recipe.yaml")
    # Only this plugin besides the core's built-ins (found through its entry point, as installed).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NEXRL_LOAD_PLUGINS": "nexrl-rewards"}
    checked = subprocess.run(_nexrl() + ["validate", str(path)], capture_output=True, text=True, env=env)
    assert checked.returncode == 0, checked.stderr
    run = subprocess.run(_nexrl() + ["run", str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/reward_mean" in r]
    val = next(r for r in rows if "val/num_samples" in r)
    errors = [json.loads(line) for line in (tmp_path / "run" / "errors.jsonl").read_text().splitlines()]

    judged = [reward for _, reward in ROWS if reward is not None]
    failing = [p for p, reward in ROWS if reward is None]
    # training: failed samples are counted apart and left out of the mean
    assert len(train) == 1
    assert train[0]["train/num_failed"] == len(failing) * GROUP
    assert train[0]["train/num_trajectories"] == len(judged) * GROUP
    assert abs(train[0]["train/reward_mean"] - sum(judged) / len(judged)) < 1e-9
    # validation: every sample recorded, the failed ones counted as failed
    assert val["val/num_samples"] == len(ROWS) and val["val/num_failed"] == len(failing)
    # errors.jsonl: one line per failed sample, naming the judge's problem
    assert sorted(e["item"]["prompt"] for e in errors) == sorted(failing * GROUP + failing)
    assert {e["cause"] for e in errors} == {"evaluator_exception"}
    for e in errors:
        assert "JudgeError" in e["message"] and f"no usable score in {MAX_RETRIES + 1} attempts" in e["message"]
        expected = "HTTP 500" if "HTTP-500" in e["item"]["prompt"] else "unparseable reply 'lorem ipsum'"
        assert expected in e["message"], e["message"]
