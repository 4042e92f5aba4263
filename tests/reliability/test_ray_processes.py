"""``nexrl run`` with ``launch_mode: ray`` and no cluster to attach to starts a local Ray cluster
and stops it again, however the run ends: every process of that cluster (GCS, raylet, the
actors' workers) is gone afterwards. Each run gets its own RAY_TMPDIR, which every process of its
cluster names on its command line: that is how the process table is searched."""

from __future__ import annotations

import json
import shutil
import signal
import tempfile

import pytest

from nexrl_core.testing import write_recipe
from tests.support.ray_cluster import processes_mentioning, wait_until_gone

pytest.importorskip("ray")


def mock_recipe(run_dir, **trainer) -> dict:
    return {
        "launch_mode": "ray",
        "run_dir": str(run_dir),
        "data": {"type": "inline", "rows": [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(6)]},
        "rollout_worker": {"num_workers": 2, "evaluator": {"type": "exact_match"}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
        "trainer": {"type": "mock", "total_train_steps": 100000, "save_freq": 0, "step_time_s": 0.05, **trainer},
        "service": {"inference_service": {"backend": "mock", "mode": "sum", "learn_steps": 3}},
        "logger": {"backend": ["console"], "level": "INFO"},
        "runtime_monitor": {"stop_timeout": 10, "health_check": {"check_interval": 0.5, "timeout": 5.0}},
        "ray": {"num_cpus": 2},
    }


@pytest.fixture
def ray_tmpdir():
    path = tempfile.mkdtemp(prefix="nxrun")  # short: Ray's socket paths live under it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _train_rows(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return sum("train/reward_mean" in json.loads(line) for line in path.read_text().splitlines()) \
        if path.exists() else 0


def test_sigterm_stops_the_run_and_its_cluster(start_run, tmp_path, ray_tmpdir):
    run_dir = tmp_path / "run"
    run = start_run(write_recipe(mock_recipe(run_dir), tmp_path / "recipe.yaml"), env={"RAY_TMPDIR": ray_tmpdir})
    run.wait_for(lambda: _train_rows(run_dir) >= 3, timeout=240, poll=0.1)
    assert processes_mentioning(ray_tmpdir)  # the run's cluster is up
    run.signal(signal.SIGTERM)
    assert run.proc.wait(120) == 130, run.output()[-3000:]
    assert not wait_until_gone(lambda: processes_mentioning(ray_tmpdir), 30)
    assert '"stopped_by": "signal"' in run.output()


def test_a_failed_run_stops_its_cluster(start_run, plugin_env, tmp_path, ray_tmpdir, write_dist):
    """The trainer raises in its actor: the run fails with that error and takes its cluster down."""
    site = write_dist(tmp_path / "site", "nexrl-failing", {"failing": "nexrl_failing"}, {"nexrl_failing": """
        from nexrl_core import hookimpl
        from nexrl_core.builtins.mock import MockTrainer

        class Failing(MockTrainer):
            def train(self, trajectories):
                if self.global_step == 2:
                    raise RuntimeError("injected trainer failure")
                return super().train(trajectories)

        @hookimpl
        def nexrl_trainers():
            return {"failing_mock": Failing}
    """})
    run_dir = tmp_path / "run"
    recipe = mock_recipe(run_dir, type="failing_mock")
    run = start_run(write_recipe(recipe, tmp_path / "recipe.yaml"),
                    env={"RAY_TMPDIR": ray_tmpdir, "PYTHONPATH": f"{site}:{plugin_env['PYTHONPATH']}"})
    assert run.proc.wait(240) == 1, run.output()[-3000:]
    assert "the trainer stopped at step 3: RuntimeError: injected trainer failure" in run.output()
    assert not wait_until_gone(lambda: processes_mentioning(ray_tmpdir), 30)
