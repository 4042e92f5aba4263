"""Run directories (issue #11 item 5) and failure that reads as success (item 9).

- A fresh run into a run_dir holding an earlier run stops with a message offering the choices;
  `overwrite_run_dir=true` moves the earlier run aside (never appends, never deletes);
  `resume.mode=auto` with nothing to resume drops the earlier run's rows.
- FailedSampleMonitor: the failed fraction of the recent training samples.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from nexrl_core.cli import main
from nexrl_core.runtime.failure_monitor import FailedSampleMonitor, most_common_error

RECIPE = """\
data:
  type: inline
  rows: [{prompt: "1 + 2", answer: "3"}, {prompt: "2 + 2", answer: "4"}]
rollout_worker: {num_workers: 2}
trajectory_pool: {batch_size: 4, group_size: 2}
trainer: {type: mock, total_train_steps: 2, save_freq: 2}
service:
  inference_service: {backend: mock, mode: sum}
runtime_monitor:
  health_check: {check_interval: 0.5}
  exception_handling: {check_interval: 0.05}
logger: {level: WARNING}
"""


@pytest.fixture
def nexrl(core_pm, tmp_path, capfd, reset_loguru):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(textwrap.dedent(RECIPE))

    def call(command: str, *overrides: str):
        code = main([command, str(recipe), *overrides])
        out, err = capfd.readouterr()
        return code, out, err
    return call


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_fresh_run_into_a_used_run_dir_stops_and_offers_the_choices(nexrl, tmp_path):
    run_dir = tmp_path / "run"
    code, _, err = nexrl("run", f"run_dir={run_dir}")
    assert code == 0, err
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    # run refuses it; validate says the same as a note and passes (the recipe is sound: an earlier
    # run on this machine is no fault of it, so `nexrl validate` after the quickstart stays 0)
    for command, code_wanted, prefix in (("run", 2, "error: "), ("validate", 0, "note: nexrl run will refuse it "
                                                                                 "as it is: ")):
        code, out, err = nexrl(command, f"run_dir={run_dir}")
        assert code == code_wanted, err
        [line] = [x for x in err.splitlines() if x.startswith(prefix)]
        assert line.startswith(f"{prefix}run_dir: '{run_dir}' holds an earlier run (metrics.jsonl, 1 checkpoint "
                               f"folder in {run_dir}/checkpoints) and resume.mode is 'disable'. Choose: "
                               f"resume.mode=auto to continue it, another run_dir, or overwrite_run_dir=true")
        assert line.endswith(". It finished (step 2 of trainer.total_train_steps=2): resume.mode=auto trains on "
                             "only with more steps, e.g. trainer.total_train_steps=4")
    assert out.strip().endswith(": ok")
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics  # untouched
    # validate says what `nexrl run` will do with it, for each choice
    ckpt = run_dir / "checkpoints" / "global_step_2"
    notes = {}
    for choice in (["resume.mode=auto"], ["resume.mode=auto", "trainer.total_train_steps=3"],
                   ["overwrite_run_dir=true"]):
        code, out, err = nexrl("validate", f"run_dir={run_dir}", *choice)
        assert code == 0 and out.strip().endswith(": ok"), err
        [notes[" ".join(choice)]] = [x for x in err.splitlines() if x.startswith("note: ")]
    assert notes["resume.mode=auto"] == (
        f"note: run_dir '{run_dir}' holds a finished run ({ckpt}, step 2 of trainer.total_train_steps=2): nexrl "
        f"run resumes from it (resume.mode=auto) and trains no further step; trainer.total_train_steps=4 trains "
        f"on, resume.mode=disable overwrite_run_dir=true starts anew (the earlier run is moved aside), or give "
        f"another run_dir")
    assert notes["resume.mode=auto trainer.total_train_steps=3"].startswith(
        f"note: nexrl run resumes from {ckpt} at step 2 of 3 (resume.mode=auto)")
    assert notes["overwrite_run_dir=true"].startswith(
        f"note: run_dir '{run_dir}' holds an earlier run (metrics.jsonl, 1 checkpoint folder in "
        f"{run_dir}/checkpoints): nexrl run moves it aside to '{run_dir}.old-<time>'")
    code, out, err = nexrl("validate", f"run_dir={tmp_path / 'fresh'}")
    assert code == 0 and "note:" not in err  # a fresh run_dir: nothing to say
    # the earlier run's checkpoint is what resume.mode=auto picks up: nothing left to train
    code, out, err = nexrl("run", f"run_dir={run_dir}", "resume.mode=auto")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["global_step"] == 2
    assert _steps(run_dir / "metrics.jsonl") == [1, 2]


def test_overwrite_run_dir_moves_the_earlier_run_aside(nexrl, tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"  # checkpoints outside run_dir move too
    assert nexrl("run", f"run_dir={run_dir}", f"trainer.checkpoint_path={ckpt}")[0] == 0
    old_metrics = (run_dir / "metrics.jsonl").read_text()
    code, _, err = nexrl("run", f"run_dir={run_dir}", f"trainer.checkpoint_path={ckpt}", "overwrite_run_dir=true",
                         "trainer.total_train_steps=1", "trainer.save_freq=1")
    assert code == 0, err
    assert _steps(run_dir / "metrics.jsonl") == [1]  # a new file, not appended to
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step_1"]
    [moved_run] = tmp_path.glob("run.old-*")
    [moved_ckpt] = tmp_path.glob("ckpt.old-*")
    assert (moved_run / "metrics.jsonl").read_text() == old_metrics  # nothing deleted
    assert (moved_ckpt / "global_step_2" / "nexrl_state.json").is_file()
    assert f"moved the earlier run's {run_dir} to {moved_run}" in err


def test_auto_resume_with_no_checkpoint_drops_the_earlier_rows(nexrl, tmp_path):
    run_dir = tmp_path / "run"
    assert nexrl("run", f"run_dir={run_dir}", "trainer.save_freq=0")[0] == 0  # no checkpoint saved
    code, _, err = nexrl("run", f"run_dir={run_dir}", "trainer.save_freq=0", "resume.mode=auto")
    assert code == 0, err
    assert _steps(run_dir / "metrics.jsonl") == [1, 2]  # started over: one row per step, not two


def test_a_fresh_run_starts_run_log_anew(nexrl, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.log").write_text("a failed start left this\n")  # no metrics: not an earlier run
    assert nexrl("run", f"run_dir={run_dir}")[0] == 0
    assert "a failed start left this" not in (run_dir / "run.log").read_text()


# -- failed samples ----------------------------------------------------------------------------------

def test_monitor_judges_the_recent_window():
    m = FailedSampleMonitor(max_fraction=0.5, window=8, min_samples=4, evaluator="judge")
    m.observe(2, [("evaluator_exception", "boom 1")])  # 1 of 3 seen: too few to judge
    assert m.verdict() is None
    m.observe(1, [("evaluator_exception", "boom 2"), ("rollout_failure", "HTTP 500")])  # 3 of 6
    assert m.verdict() is None  # exactly half is not more than half
    m.observe(4, [])  # the last 8: 2 failed (the oldest fell out of the window)
    m.observe(0, [("evaluator_exception", "boom 3")] * 4)  # the last 8: 4 failed, not more than half
    assert m.verdict() is None
    m.observe(0, [("evaluator_exception", "boom 3")])  # the last 8: 5 failed
    verdict = m.verdict()
    assert verdict is not None and verdict.startswith("5 of the last 8 training samples failed")
    assert "rollout_worker.evaluator: evaluator 'judge'" in verdict
    assert "most common error: evaluator_exception (5 of 5): boom 3" in verdict
    m.observe(8, [])  # the verdict stays: the run is stopping
    assert m.verdict() == verdict


def test_monitor_disabled_and_most_common_error():
    m = FailedSampleMonitor(max_fraction=0.1, window=4, enabled=False)
    m.observe(0, [("x", "y")] * 4)
    assert m.verdict() is None
    assert most_common_error([("a", "first a"), ("b", "b"), ("a", "second a")]) == "a (2 of 3): first a"
    assert most_common_error([]) == ""
