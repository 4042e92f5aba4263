"""Secrets never reach a file, a log line or the console (issue #29 item 1, docs/reliability.md
§Secrets).

One cheap real run per route a secret comes by: the command line, the recipe, the environment,
an option a plugin declares secret. The run's evaluator (tests/support/leaky.py) quotes its
credentials in its log lines, its results and its errors, as a careless plugin would. Every file
the run leaves (run.json, config.yaml, run.log, metrics/samples/errors.jsonl, checkpoints, the
TensorBoard and wandb folders) and the captured stdout/stderr are searched for the value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nexrl_core.cli import main
from nexrl_core.redaction import is_secret_key
from nexrl_core.testing import make_recipe, use_plugins, write_recipe
from tests.support import leaky

REPO = Path(__file__).resolve().parents[2]


def recipe(run_dir: Path, **evaluator) -> dict:
    """Two prompts per step, one of which the evaluator fails on (quoting its credentials); every
    generation goes to samples.jsonl; validated and checkpointed at every step."""
    rows = [{"prompt": "1 + 2", "answer": "3"}, {"prompt": "fail", "answer": "0"}]
    return make_recipe(
        None, run_dir=str(run_dir),
        data={"type": "inline", "rows": rows},
        validate={"validate_before_train": True, "data": {"type": "inline", "rows": rows}},
        rollout_worker={"num_workers": 2, "evaluator": {"type": "leaky", **evaluator}},
        trajectory_pool={"batch_size": 4, "group_size": 2},
        trainer={"type": "mock", "total_train_steps": 2, "save_freq": 1},
        weight={"validate_freq": 1},
        service={"inference_service": {"backend": "mock", "mode": "sum"}},
        logger={"backend": ["console"], "level": "INFO", "samples_every": 1, "samples_per_step": 4},
        runtime_monitor={"stop_timeout": 10, "health_check": {"check_interval": 0.5},
                         "exception_handling": {"check_interval": 0.05}, "failed_samples": {"max_fraction": 0.9}})


def leaks(secret: str, run_dir: Path, *streams: str) -> list[str]:
    """Every file under ``run_dir`` and every stream that holds ``secret``."""
    found = [f"stream {i}" for i, text in enumerate(streams) if secret in text]
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) > 5, "the run left too little to search"
    found += [str(p.relative_to(run_dir)) for p in files if secret.encode() in p.read_bytes()]
    return found


def assert_it_was_quoted_and_hidden(run_dir: Path) -> None:
    """The careless evaluator did quote the secret (so the search above could have found it)."""
    errors = [json.loads(line) for line in (run_dir / "errors.jsonl").read_text().splitlines()]
    assert errors and all("the judge refused the credentials ***" in e["message"] for e in errors)
    samples = (run_dir / "samples.jsonl").read_text()
    assert "the judge refused the credentials ***" in samples
    assert "leaky evaluator: again, for run.log: ***" in (run_dir / "run.log").read_text()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["global_step_1", "global_step_2"]


@pytest.fixture
def nexrl(tmp_path, capfd, reset_loguru, monkeypatch):
    """``nexrl(*argv)`` -> (exit code, stdout, stderr): the CLI in this process, as `nexrl` would run
    it (sys.argv included), with the leaky evaluator registered."""
    monkeypatch.chdir(tmp_path)

    def call(*argv: str):
        monkeypatch.setattr(sys, "argv", ["nexrl", *argv])
        with use_plugins(leaky):
            code = main(list(argv))
        out, err = capfd.readouterr()
        return code, out, err
    return call


def test_a_secret_in_the_recipe(nexrl, tmp_path):
    secret = "sk-recipe-4f1d8a2b9c"
    run_dir = tmp_path / "run"
    path = write_recipe(recipe(run_dir, api_key=secret), tmp_path / "recipe.yaml")
    code, out, err = nexrl("run", str(path))
    assert code == 0, err
    assert leaks(secret, run_dir, out, err) == []
    assert_it_was_quoted_and_hidden(run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["rollout_worker"]["evaluator"]["api_key"] == "***"
    assert "leaky evaluator: configured with ***" in err  # the console's log line
    for command in ("validate", "config"):
        code, out, err = nexrl(command, str(path), f"run_dir={tmp_path / 'another'}")
        assert code == 0 and secret not in out + err, err


def test_a_secret_from_the_environment_under_any_key(nexrl, tmp_path, monkeypatch):
    """``${oc.env:...}`` puts it under an ordinary key (``note``): the variable's name makes it secret."""
    secret = "hf-env-93c0e7d15a"
    monkeypatch.setenv("NEXRL_TEST_API_KEY", secret)
    run_dir = tmp_path / "run"
    path = write_recipe(recipe(run_dir, note="${oc.env:NEXRL_TEST_API_KEY}"), tmp_path / "recipe.yaml")
    code, out, err = nexrl("run", str(path))
    assert code == 0, err
    assert leaks(secret, run_dir, out, err) == []
    assert_it_was_quoted_and_hidden(run_dir)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["rollout_worker"]["evaluator"]["note"] == "***"


def test_an_option_a_plugin_declares_secret(nexrl, tmp_path):
    secret = "correct horse battery staple"
    assert not is_secret_key("passphrase")  # only the declaration makes it secret
    run_dir = tmp_path / "run"
    path = write_recipe(recipe(run_dir, passphrase=secret), tmp_path / "recipe.yaml")
    code, out, err = nexrl("run", str(path))
    assert code == 0, err
    assert leaks(secret, run_dir, out, err) == []
    assert_it_was_quoted_and_hidden(run_dir)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["rollout_worker"]["evaluator"]["passphrase"] == "***"
    code, out, err = nexrl("config", str(path), "--no-check")
    assert code == 0 and "passphrase: '***'" in out and secret not in out + err
    # a wrong value is reported without being quoted
    code, out, err = nexrl("validate", str(path), "rollout_worker.evaluator.passphrase=[31415926, 2718]")
    assert code == 2
    assert err.strip() == "error: rollout_worker.evaluator.passphrase: expected a string or null, got a list"


def test_a_secret_in_a_bad_override_is_not_quoted_by_its_error(nexrl, tmp_path):
    secret = "tml-typo-5e6f7a8b9c"
    # no api_key key to set: it needs '+'
    data = make_recipe(recipe(tmp_path / "run"), rollout_worker={"evaluator": {"type": "exact_match"}})
    path = write_recipe(data, tmp_path / "recipe.yaml")
    for command in ("validate", "run"):
        code, out, err = nexrl(command, str(path), f"rollout_worker.evaluator.api_key={secret}")
        assert code == 2 and secret not in out + err
        assert "override 'rollout_worker.evaluator.api_key=***': key 'rollout_worker.evaluator.api_key' does not " \
               "exist" in err


# -- the command line, in a real `nexrl run` process -----------------------------------------------

@pytest.fixture
def leaky_env(tmp_path, write_dist) -> dict[str, str]:
    """The leaky evaluator installed as a distribution; no wandb key (wandb logs offline)."""
    root = write_dist(tmp_path / "dist", "nexrl-leaky", {"leaky": "tests.support.leaky"}, {})
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NEXRL_LOAD_PLUGINS"}
    home = tmp_path / "home"
    home.mkdir()
    env.update(NEXRL_LOAD_PLUGINS="nexrl-leaky", HOME=str(home), NETRC=str(home / ".netrc"),
               PYTHONPATH=os.pathsep.join([str(root), str(REPO)]))
    return env


def test_a_secret_on_the_command_line_reaches_no_file_tracker_or_console(tmp_path, leaky_env):
    """The issue's case: `service.train_service.api_key=...` was written in clear to run.json and
    shown in the header and the resume command. Here with wandb (which records the command line)
    and TensorBoard as trackers."""
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboardX")
    secret = "tml-cli-0a1b2c3d4e5f"
    run_dir = tmp_path / "run"
    path = write_recipe(recipe(run_dir), tmp_path / "recipe.yaml")
    script = Path(sys.executable).parent / "nexrl"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "nexrl_core.cli"]
    override = f"+rollout_worker.evaluator.api_key={secret}"
    proc = subprocess.run([*cmd, "run", str(path), override, "logger.backend=[console,wandb,tensorboard]"],
                          capture_output=True, text=True, env=leaky_env, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert leaks(secret, run_dir, proc.stdout, proc.stderr) == []
    assert_it_was_quoted_and_hidden(run_dir)
    assert list(run_dir.glob("wandb/offline-run-*")) and list((run_dir / "tensorboard").iterdir())
    run = json.loads((run_dir / "run.json").read_text())
    assert "+rollout_worker.evaluator.api_key=***" in run["command"]
    assert run["overrides"][0] == "+rollout_worker.evaluator.api_key=***"
    assert f"recipe      {path} +rollout_worker.evaluator.api_key=***" in proc.stderr  # the header
    assert "+rollout_worker.evaluator.api_key=***" in proc.stderr.split("finished:")[1]  # the command to go on
    assert "secrets      shown as ***" in proc.stderr


def test_an_interpolation_is_where_a_secret_is_not_the_secret():
    """`api_key: ${oc.env:TINKER_API_KEY}` registered as it was written made every later message
    that names the interpolation (the Tinker plugin's own advice) read `e.g. ***`."""
    from nexrl_core.redaction import add_secret, scrub

    add_secret("${oc.env:NEXRL_TEST_ELSEWHERE_KEY}")
    add_secret("sk-resolved-value-1234")
    assert scrub("set api_key (e.g. ${oc.env:NEXRL_TEST_ELSEWHERE_KEY}), got sk-resolved-value-1234") == \
        "set api_key (e.g. ${oc.env:NEXRL_TEST_ELSEWHERE_KEY}), got ***"
