"""Helpers of the reliability suite: run ``nexrl run`` in a subprocess, poll it, kill it, read its outputs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from nexrl_core.testing import make_recipe
from tests.support.metrics import read_metrics

REPO_ROOT = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).parent / "nexrl"  # the console script of this environment
NEXRL = [str(_SCRIPT)] if _SCRIPT.exists() else \
    [sys.executable, "-c", "import sys; from nexrl_core.cli import main; sys.exit(main())"]


STEPS = 5
PROMPTS = ["the quick brown fox", "what is two plus three?", "count: one, two, three", "hello world!",
           "grpo trains language models"]


def grpo_recipe(run_dir: Path, model_dir: str) -> dict:
    """The tiny-Llama GRPO recipe of the resume and signal tests (run it with `plugin_env`: its
    ``letter_share`` is reltest_plugin's, not tests.support.letters')."""
    return make_recipe(
        None, run_dir=str(run_dir), seed=3,
        data={"type": "inline", "rows": [{"prompt": p} for p in PROMPTS]},  # 5 rows: epochs wrap mid-run
        validate={"validate_before_train": True, "n_samples": 2,
                  "data": {"type": "inline", "rows": [{"prompt": "the lazy dog"}, {"prompt": "nine, ten"}]}},
        rollout_worker={"type": "simple", "num_workers": 1, "sampling": {"max_tokens": 6, "temperature": 1.0},
                        "evaluator": {"type": "letter_share"}},  # continuous rewards: non-zero advantages
        trajectory_pool={"batch_size": 4, "group_size": 2, "key_list": ["uid"]},
        trainer={"type": "self_hosted_grpo", "total_train_steps": STEPS, "save_freq": 1},
        weight={"sync_mode": "sync", "backend": "in_process", "validate_freq": 2},
        service={"train_service": {"model_path": model_dir, "lr": 0.01, "num_threads": 1},
                 "inference_service": {"backend": "hf", "model_path": model_dir, "num_threads": 1}},
        logger={"backend": ["console"], "level": "INFO"},
        runtime_monitor={"stop_timeout": 20, "health_check": {"check_interval": 1.0, "timeout": 10.0},
                         "exception_handling": {"check_interval": 0.05}})


class Run:
    """A ``nexrl run`` subprocess; its output goes to ``<log>`` (read it with :meth:`output`)."""

    def __init__(self, recipe: str, overrides: list[str], env: dict[str, str], log: Path):
        self.log = log
        self._fh = open(log, "wb")
        self.proc = subprocess.Popen(NEXRL + ["run", recipe, *overrides], cwd=str(REPO_ROOT), env=env,
                                     stdout=self._fh, stderr=subprocess.STDOUT)

    def wait_for(self, condition, timeout: float = 180.0, poll: float = 0.005) -> None:
        """Poll ``condition()`` until true; fail (with the output) if the process exits first."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"nexrl run exited ({self.proc.returncode}) before the condition held:\n"
                                     f"{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"condition not met within {timeout}s:\n{self.output()[-4000:]}")
            time.sleep(poll)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._fh.close()

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 240.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"nexrl run still running after {timeout}s:\n{self.output()[-4000:]}") from None
        self._fh.close()
        return code

    def output(self) -> str:
        if not self._fh.closed:
            self._fh.flush()
        return self.log.read_text(errors="replace")


def run_to_end(start_run, recipe: str, *overrides: str, timeout: float = 240.0) -> Run:
    run = start_run(recipe, *overrides)
    code = run.wait(timeout)
    assert code == 0, run.output()[-4000:]
    return run


def metrics_rows(run_dir: Path, drop_timing: bool = True) -> list[dict]:
    return read_metrics(run_dir, clock=not drop_timing)


def error_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "errors.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
