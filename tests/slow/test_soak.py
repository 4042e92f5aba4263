"""Soak (issue #29 item 10, docs/reliability.md): long runs on the mock components with faults
injected all along, judged on what a user relies on.

- ``test_soak_300_steps_with_faults``: 300 steps in process, with rollout-worker exceptions (the
  error policy ``continue``), an evaluator that is slow on some samples and raises on others, and a
  full disk met by one checkpoint save (``resume.on_failure: restart`` resumes from the save
  before). It finishes; every step is trained once; every failed training sample is in
  errors.jsonl once and counted in ``train/num_failed``; run.json counts the restart; no thread is
  left; RSS grows less than 10 % after warm-up.
- ``test_soak_ray_with_a_killed_actor``: ``launch_mode: ray``, a rollout-worker actor's process
  dies mid-run; the run restarts from its checkpoint, finishes with every step once, and no Ray
  process is left.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from nexrl_core import EvaluationRunResult, Evaluator, hookimpl
from nexrl_core.builtins.mock import MockTrainer
from nexrl_core.builtins.workers import SimpleRolloutWorker
from nexrl_core.cli import main
from nexrl_core.testing import make_recipe, use_plugins, write_recipe

pytestmark = pytest.mark.slow

STEPS, WARMUP, SAVE_FREQ, FULL_DISK_AT = 300, 100, 25, 150
RSS: dict[int, int] = {}  # step -> resident bytes of this process
STATE: dict[str, Any] = {}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class SoakTrainer(MockTrainer):
    """Keeps only the seqs it trained on (not the trajectories: memory must stay flat); the disk is
    full at one save."""

    def train(self, trajectories):
        STATE.setdefault("trained", Counter()).update(t["seq"] for t in trajectories if not t.get("failed"))
        return {"train/loss": 0.0}

    def save_model_state(self, folder: str) -> None:
        if self.global_step == FULL_DISK_AT and not STATE.get("disk_was_full"):
            STATE["disk_was_full"] = True
            raise OSError(errno.ENOSPC, "No space left on device", folder)
        super().save_model_state(folder)


SoakTrainer.CAPABILITIES = MockTrainer.CAPABILITIES


class FaultyWorker(SimpleRolloutWorker):
    """A bug every 41st task (an error the policy ``continue`` lets pass)."""

    def step(self, task):
        if task.get("seq", 0) % 41 == 40 and not task.get("validation"):
            raise KeyError("injected worker bug")
        return super().step(task)


class SlowFailingEvaluator(Evaluator):
    """Right answers score 1; slow on every 7th sample, raises on every 19th."""

    def evaluate(self, data: dict[str, Any], evaluation_target: Any) -> EvaluationRunResult:
        n = STATE["evaluated"] = STATE.get("evaluated", 0) + 1
        if n % 7 == 0:
            time.sleep(0.02)
        if n % 19 == 0:
            raise ValueError("injected evaluator failure")
        hit = str(data.get("answer")) in str(evaluation_target.final_answer)
        return EvaluationRunResult(reward=float(hit), metrics={})


class Plugin:
    @hookimpl
    def nexrl_trainers(self):
        return {"soak": SoakTrainer}

    @hookimpl
    def nexrl_rollout_workers(self):
        return {"faulty": FaultyWorker}

    @hookimpl
    def nexrl_evaluators(self):
        return {"slow_failing": SlowFailingEvaluator}

    @hookimpl
    def nexrl_step_end(self, step, metrics, config):
        RSS[step] = _rss()


ROWS = [{"prompt": f"{a} + {b}", "answer": str(a + b)} for a in range(5) for b in range(4)]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_soak_300_steps_with_faults(tmp_path, capfd, reset_loguru, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "")
    STATE.clear()
    RSS.clear()
    # the kit's mock recipe (mock model in mode: sum, quick monitor) with the faulty parts above
    recipe = make_recipe(
        run_dir=str(tmp_path / "run"), data={"type": "inline", "rows": ROWS},
        rollout_worker={"type": "faulty", "num_workers": 3, "evaluator": {"type": "slow_failing"}},
        trajectory_pool={"batch_size": 8},
        trainer={"type": "soak", "total_train_steps": STEPS, "save_freq": SAVE_FREQ, "remove_previous_ckpt": True},
        validate={"data": {"type": "inline", "rows": ROWS[:4]}, "n_samples": 2},
        weight={"validate_freq": 100},
        resume={"on_failure": "restart", "max_restarts": 1, "restart_backoff": 0.1},
        logger={"backend": [], "level": "WARNING", "progress": "off", "samples_every": 50},
        runtime_monitor={"health_check": {"timeout": 5.0}, "exception_handling": {"policy": "continue"}})
    write_recipe(recipe, tmp_path / "recipe.yaml")
    threads_before = {t.ident for t in threading.enumerate()}
    started = time.monotonic()
    with use_plugins(Plugin()):
        code = main(["run", "recipe.yaml"])
    _, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert time.monotonic() - started < 240

    run_dir = tmp_path / "run"
    run = json.loads((run_dir / "run.json").read_text())
    assert run["exit_status"] == "finished" and run["global_step"] == STEPS
    assert run["restarts"] == 1 and "No space left on device" in run["restart_causes"][0]["error"]
    assert run["restart_causes"][0]["global_step"] == FULL_DISK_AT  # trained, then its save failed
    # the failed save left nothing half-written; only the newest checkpoint is kept
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"global_step_{STEPS}"]

    # accounting: every step once; every failed training sample in errors.jsonl once, counted per step
    metrics = _rows(run_dir / "metrics.jsonl")
    train = [r for r in metrics if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    errors = [e for e in _rows(run_dir / "errors.jsonl") if not e["validation"]]
    assert sum(int(r["train/num_failed"]) for r in train) == len(errors) > 0
    seqs = [e["seq"] for e in errors]
    assert len(seqs) == len(set(seqs))
    assert {e["cause"] for e in errors} >= {"evaluator_exception", "worker_exception"}
    assert [r["step"] for r in metrics if "val/num_failed" in r] == [100, 200, 300]

    # nothing left running in this process
    deadline = time.monotonic() + 10
    while (left := [t for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [t.name for t in left]

    # memory: flat after warm-up
    assert set(RSS) >= {WARMUP, STEPS}
    growth = (RSS[STEPS] - RSS[WARMUP]) / RSS[WARMUP]
    assert growth < 0.10, f"RSS grew {growth:.1%} from step {WARMUP} to {STEPS}"


# -- Ray mode: an actor's process dies --------------------------------------------------------------

KILLER = """
import os
from nexrl_core import hookimpl
from nexrl_core.builtins.workers import SimpleRolloutWorker


class KillingWorker(SimpleRolloutWorker):
    # its actor's process dies at the 30th task, once (a marker file remembers across restarts)
    def step(self, task):
        marker = os.environ["SOAK_KILL_MARKER"]
        if task.get("seq", 0) >= 30 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(137)
        return super().step(task)


@hookimpl
def nexrl_rollout_workers():
    return {"killing": KillingWorker}
"""


def test_soak_ray_with_a_killed_actor(tmp_path, write_dist):
    pytest.importorskip("ray")
    import subprocess

    from tests.reliability.helpers import NEXRL, REPO_ROOT
    from tests.support.ray_cluster import processes_mentioning, wait_until_gone

    site = write_dist(tmp_path / "site", "nexrl-killing", {"killing": "nexrl_killing"}, {"nexrl_killing": KILLER})
    ray_tmp = tempfile.mkdtemp(prefix="nxsoak")  # short: Ray's socket paths live under it
    run_dir = tmp_path / "run"
    steps = 12
    recipe = make_recipe(
        None, launch_mode="ray", run_dir=str(run_dir), data={"type": "inline", "rows": ROWS},
        rollout_worker={"type": "killing", "num_workers": 2, "num_actors": 2, "evaluator": {"type": "exact_match"}},
        trajectory_pool={"batch_size": 4, "group_size": 2},
        trainer={"type": "mock", "total_train_steps": steps, "save_freq": 2},
        service={"inference_service": {"backend": "mock", "mode": "sum"}},
        resume={"on_failure": "restart", "max_restarts": 1, "restart_backoff": 0.5},
        logger={"backend": [], "level": "INFO", "progress": "off"},
        runtime_monitor={"stop_timeout": 10, "health_check": {"check_interval": 0.5, "timeout": 5.0}},
        ray={"num_cpus": 2})
    path = write_recipe(recipe, tmp_path / "recipe.yaml")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "SOAK_KILL_MARKER": str(tmp_path / "killed"),
           "PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("NEXRL_LOAD_PLUGINS", None)
    try:
        proc = subprocess.run(NEXRL + ["run", str(path)], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                              timeout=400)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert (tmp_path / "killed").exists()  # the actor did die
        run = json.loads((run_dir / "run.json").read_text())
        assert run["restarts"] == 1 and run["global_step"] == steps, run
        assert "rollout_worker" in run["restart_causes"][0]["error"]
        train = [r["step"] for r in _rows(run_dir / "metrics.jsonl") if "train/loss" in r]
        assert train == list(range(1, steps + 1))
        assert not wait_until_gone(lambda: processes_mentioning(ray_tmp), 30)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
