"""What a person running a recipe sees and gets (issue 18, items 1-3 and 10): the progress display
(plain off a terminal, rich on one), the run directory's own records, `nexrl plot`, `nexrl config`,
`--version`, the wandb and TensorBoard sinks, and the CLI's manners. Real `nexrl` processes with
the mock components; core plugins only."""

from __future__ import annotations

import glob
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from nexrl_core.launch.recipe import load_recipe
from nexrl_core.runtime.run_info import plain_config

REPO = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

RECIPE = """\
experiment_name: demo
run_dir: {run_dir}
data:
  type: inline
  rows:
    - {{prompt: "1 + 2", answer: "3"}}
    - {{prompt: "2 + 2", answer: "4"}}
validate:
  validate_before_train: true
  data:
    type: inline
    rows:
      - {{prompt: "1 + 1", answer: "2"}}
      - {{prompt: "3 + 1", answer: "4"}}
rollout_worker: {{num_workers: 2}}
trajectory_pool: {{batch_size: 4, group_size: 2}}
trainer: {{type: mock, total_train_steps: 4, save_freq: 2}}
weight: {{validate_freq: 2}}
logger: {{samples_every: 2, samples_per_step: 3}}
service:
  inference_service: {{backend: mock, mode: sum}}
"""


def write_recipe(folder: Path, text: str = RECIPE, **fmt) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    path.write_text(textwrap.dedent(text).format(run_dir=fmt.get("run_dir", folder / "run")))
    return path


def nexrl_cmd() -> list[str]:
    script = Path(sys.executable).parent / "nexrl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "nexrl_core.cli"]


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Core plugins only; no wandb key or login (HOME without a netrc); nothing inherited from WANDB_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(NEXRL_LOAD_PLUGINS="", HOME=str(home), NETRC=str(home / ".netrc"), PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def nexrl(tmp_path: Path, *args, env: dict | None = None, cwd: Path | None = None, timeout: int = 180):
    return subprocess.run([*nexrl_cmd(), *map(str, args)], capture_output=True, text=True,
                          env=env or clean_env(tmp_path), cwd=cwd or tmp_path, timeout=timeout)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- a run, off a terminal


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """`nexrl run` of the recipe for 5 steps, off a terminal: (recipe, the finished process, when it
    started). One run for the tests that only read its output and its run directory."""
    folder = tmp_path_factory.mktemp("plain_run")
    recipe = write_recipe(folder)
    started = time.time()
    return recipe, nexrl(folder, "run", recipe, "trainer.total_train_steps=5"), started


def test_plain_progress_header_footer_and_the_run_directory(plain_run, tmp_path):
    recipe, run, started = plain_run
    assert run.returncode == 0, run.stderr
    err = run.stderr
    assert not ANSI.search(err), "no control codes when stderr is not a terminal"
    assert "Traceback" not in err
    # header: recipe, run_dir, model, plugins with versions
    header = err.split("validation @ step 0")[0]
    assert f"recipe      {recipe} trainer.total_train_steps=5" in header
    assert f"run_dir     {recipe.parent / 'run'}" in header
    assert "model       " in header
    assert f"nexrl-core {version('nexrl-core')}" in header
    # one line per training step with step/total, ETA, step time, throughput, reward, val, staleness, failed
    steps = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split(" ")[1] for line in steps] == [f"{i}/5" for i in range(1, 6)]
    for line in steps:
        for part in ("| step time ", "| eta ", " samples/s", " tok/s", "| reward ", "| val ", "| staleness ",
                     "| failed 0", "| split gen "):
            assert part in line, (part, line)
    assert "step 5/5 (100%)" in steps[-1] and "val 1.000 @4" in steps[-1]
    assert re.search(r"validation @ step 2: val/reward=1 .*\(2 samples, 0 failed\)", err)
    # the console sink's own per-step lines give way to the display (run.log keeps them)
    assert "INFO    step 1:" not in err
    # footer: where things are, how to go on
    footer = err.split("finished: 5/5 steps in ")[1]
    run_dir = recipe.parent / "run"
    assert f"checkpoints  {run_dir / 'checkpoints' / 'global_step_5'}" in footer
    assert f"plot         {run_dir / 'metrics.png'}" in footer
    assert f"samples      nexrl show {run_dir}" in footer
    assert f"report       nexrl report {run_dir}" in footer
    assert "nexrl export" not in footer  # the mock trainer's checkpoints hold no model (a GRPO run's do)
    assert f"train on     nexrl run {recipe} resume.mode=auto trainer.total_train_steps=10" in footer
    # the JSON summary stays alone on stdout
    assert json.loads(run.stdout)["global_step"] == 5

    # config.yaml: the resolved recipe, which `nexrl run` accepts as it is
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["total_train_steps"] == 5 and saved["run_dir"] == str(run_dir)
    assert saved["weight"]["sync_mode"] == "sync"  # defaults included
    assert "recipe_dir" not in saved
    again = load_recipe(str(run_dir / "config.yaml"))
    assert again.trainer.total_train_steps == 5 and again.trajectory_pool.batch_size == 4
    # run.json: what ran, where, with which versions, when, how it ended
    info = json.loads((run_dir / "run.json").read_text())
    assert info["exit_status"] == "finished" and info["exit_code"] == 0 and info["global_step"] == 5
    assert info["overrides"] == ["trainer.total_train_steps=5"] and info["recipe"] == str(recipe)
    assert info["versions"]["nexrl-core"] == version("nexrl-core")
    assert started - 1 <= info["start"] <= info["end"] <= time.time() + 1
    # every metrics row is time-stamped, in order
    metrics = rows(run_dir / "metrics.jsonl")
    stamps = [r["time"] for r in metrics]
    assert stamps == sorted(stamps) and started - 1 <= stamps[0] and stamps[-1] <= info["end"]
    for r in (r for r in metrics if "train/num_trajectories" in r):  # the step's split and throughput
        step_s = r["timing/wait_batch_s"] + r["timing/train_s"] + r["timing/weight_sync_s"]
        assert r["timing/response_tokens_per_s"] == pytest.approx(r["train/num_response_tokens"] / step_s)
    # samples.jsonl: 3 generations of every 2nd step, and of the first and the last, with prompt,
    # response and reward
    samples = rows(run_dir / "samples.jsonl")
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2, 4, 4, 4, 5, 5, 5]
    for s in samples:
        right = s["response"] == str(eval(s["prompt"][0]["content"]))  # the mock model learns to sum
        assert s["reward"] == float(right) and (right or s["step"] == 1)
        assert "time" in s and s["model_version"] is not None
        assert s["token_versions"] == [s["model_version"]] * len(s["response"].encode())  # one per token
        assert s["sampling"]["temperature"] == 1.0  # the sampling record that produced it
    # nexrl show: the newest step's samples, readable; --last N the N newest
    show = nexrl(tmp_path, "show", run_dir)
    assert show.returncode == 0, show.stderr
    blocks = show.stdout.strip().split("\n\n")
    assert blocks[0] == f"{run_dir / 'samples.jsonl'}: 3 of 12 samples (step 5)"
    for block, sample in zip(blocks[1:], samples[-3:]):
        lines = block.splitlines()
        assert lines[0] == f"step 5 · sample {sample['uid']}#{sample['sample_index']} · weights v4 · reward 1"
        assert lines[1] == f"  prompt   [user] {sample['prompt'][0]['content']}"
        assert lines[2] == f"  reply    {sample['response']}"
    assert len(blocks) == 4
    last = nexrl(tmp_path, "show", run_dir, "--last", "4")
    assert last.stdout.startswith(f"{run_dir / 'samples.jsonl'}: 4 of 12 samples (steps 4-5)")
    assert [b.split(" · ")[0] for b in last.stdout.strip().split("\n\n")[1:]] == ["step 4", "step 5", "step 5",
                                                                                   "step 5"]
    # metrics.png: a real PNG
    png = (run_dir / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 400 and height > 300


def test_progress_off_keeps_the_console_sinks_lines(tmp_path):
    recipe = write_recipe(tmp_path)
    run = nexrl(tmp_path, "run", recipe, "logger.progress=off")
    assert run.returncode == 0, run.stderr
    assert "INFO    step 1:" in run.stderr
    assert not any(line.startswith(("step 1/", "nexrl run ·", "finished:")) for line in run.stderr.splitlines())


def run_on_terminal(tmp_path: Path, recipe: Path, env: dict[str, str]) -> tuple[int, str]:
    """`nexrl run` with a pseudo-terminal as stdin, stdout and stderr: (exit code, what it showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([*nexrl_cmd(), "run", str(recipe)], stdin=slave, stdout=slave, stderr=slave,
                            env={**env, "TERM": "xterm-256color", "COLUMNS": "160"}, cwd=tmp_path)
    os.close(slave)
    out = b""
    deadline = time.time() + 180
    while time.time() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    return proc.returncode, out.decode("utf-8", "replace")


def test_rich_display_on_a_terminal(tmp_path):
    """On a terminal (a pseudo-terminal here) `auto` picks the live rich display."""
    code, text = run_on_terminal(tmp_path, write_recipe(tmp_path), clean_env(tmp_path))
    assert code == 0, text[-3000:]
    assert ANSI.search(text), "a terminal gets the live display's control codes"
    plain = ANSI.sub("", text)
    assert "━" in plain  # rich's progress bar
    assert "4/4" in plain and "100%" in plain and "eta" in plain and "throughput" in plain
    assert "validation @ step 2" in plain
    assert "finished: 4/4 steps" in plain and "train on" in plain


def test_a_terminal_without_rich_gets_plain_lines(tmp_path):
    code, text = run_on_terminal(tmp_path, write_recipe(tmp_path), hiding(tmp_path, "rich"))
    assert code == 0, text[-3000:]
    assert "━" not in text and "Traceback" not in text
    assert "step 4/4 (100%) | step time" in text and "finished: 4/4 steps" in text


def test_sigint_is_acknowledged_with_the_resume_command(tmp_path):
    recipe = write_recipe(tmp_path)
    proc = subprocess.Popen([*nexrl_cmd(), "run", str(recipe), "trainer.total_train_steps=400",
                             "+trainer.step_time_s=0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=clean_env(tmp_path), cwd=tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and "train/reward_mean" in metrics.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "SIGINT received: stopping after the work in flight" in err
    assert f"resume with: nexrl run {recipe} trainer.total_train_steps=400 +trainer.step_time_s=0.05 " \
           f"resume.mode=auto" in err
    assert re.search(r"stopped at step \d+/400 after", err)
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["exit_status"] == "signal" and info["exit_code"] == 130


def test_resume_keeps_the_earlier_attempt_in_run_json(tmp_path):
    recipe = write_recipe(tmp_path)
    assert nexrl(tmp_path, "run", recipe).returncode == 0
    first = json.loads((tmp_path / "run" / "run.json").read_text())
    resumed = nexrl(tmp_path, "run", recipe, "resume.mode=auto", "trainer.total_train_steps=6")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr and "step 5/6" in resumed.stderr and "step 4/6" not in resumed.stderr
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["global_step"] == 6 and info["resume_mode"] == "auto"
    assert [p["start"] for p in info["previous"]] == [first["start"]]
    # samples of steps 1, 2 and 4 (the first run's first, 2nd and last), then 5 and 6 (the resumed run's first
    # and last)
    assert [s["step"] for s in rows(tmp_path / "run" / "samples.jsonl")] == [1] * 3 + [2] * 3 + [4] * 3 + \
        [5] * 3 + [6] * 3


def test_secrets_never_reach_config_yaml(tmp_path):
    recipe = write_recipe(tmp_path, RECIPE.replace("experiment_name: demo", "experiment_name: ${{oc.env:MY_API_KEY}}"))
    run = nexrl(tmp_path, "run", recipe, env=clean_env(tmp_path, MY_API_KEY="sk-very-secret-value"))
    assert run.returncode == 0, run.stderr
    for name in ("config.yaml", "run.json"):
        assert "sk-very-secret-value" not in (tmp_path / "run" / name).read_text()
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["experiment_name"] == "***"


# ----------------------------------------------------------------------------- plot


def test_nexrl_plot_draws_a_finished_runs_metrics(plain_run, tmp_path):
    recipe, run, _ = plain_run
    assert run.returncode == 0, run.stderr
    out = tmp_path / "figs" / "demo.png"
    plot = nexrl(tmp_path, "plot", recipe.parent / "run", "-o", out)
    assert plot.returncode == 0, plot.stderr
    assert plot.stdout.strip() == str(out)
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_nexrl_plot_problems_are_short_messages(plain_run, tmp_path):
    missing = nexrl(tmp_path, "plot", tmp_path / "nowhere")
    assert missing.returncode == 2 and "no such run directory" in missing.stderr
    (tmp_path / "empty").mkdir()
    empty = nexrl(tmp_path, "plot", tmp_path / "empty")
    assert empty.returncode == 2 and "no metrics.jsonl here" in empty.stderr
    # without matplotlib: the extra to install, no traceback
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    recipe, run, _ = plain_run
    assert run.returncode == 0, run.stderr
    env = clean_env(tmp_path, PYTHONPATH=os.pathsep.join([str(tmp_path / "shadow"), str(REPO)]))
    no_mpl = nexrl(tmp_path, "plot", recipe.parent / "run", env=env)
    assert no_mpl.returncode == 1
    assert "pip install 'nexrl-core[plot]'" in no_mpl.stderr and "Traceback" not in no_mpl.stderr


# ----------------------------------------------------------------------------- trackers


def test_wandb_offline_without_a_key_and_the_same_wandb_run_on_resume(tmp_path):
    pytest.importorskip("wandb")
    from tests.support.wandb_offline import summary

    recipe = write_recipe(tmp_path)
    first = nexrl(tmp_path, "run", recipe, "logger.backend=[console,wandb]", "+logger.wandb.group=sweep-1",
                  "+logger.wandb.tags=[a,b]", "+logger.wandb.name=first try",
                  env=clean_env(tmp_path, WANDB_PROJECT="from-env"))
    assert first.returncode == 0, first.stderr
    assert "no API key configured, logging offline" in first.stderr
    run_id = json.loads((tmp_path / "run" / "wandb_run.json").read_text())["id"]
    [log] = glob.glob(str(tmp_path / "run" / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    got = summary(log)
    assert got["run"] == {"id": run_id, "project": "from-env", "entity": "", "name": "first try",
                          "group": "sweep-1", "tags": ["a", "b"]}
    train = {h["global_step"]: h["train/reward_mean"] for h in got["history"] if "train/reward_mean" in h}
    recorded = {r["step"]: r["train/reward_mean"] for r in rows(tmp_path / "run" / "metrics.jsonl")
                if "train/reward_mean" in r}
    assert train == recorded and sorted(train) == [1, 2, 3, 4]
    assert [h["global_step"] for h in got["history"] if "val/reward" in h] == [0, 2, 4]

    resumed = nexrl(tmp_path, "run", recipe, "logger.backend=[console,wandb]", "resume.mode=auto",
                    "trainer.total_train_steps=6", env=clean_env(tmp_path, WANDB_PROJECT="from-env"))
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((tmp_path / "run" / "wandb_run.json").read_text())["id"] == run_id
    logs = sorted(glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(logs) == 2 and all(p.endswith(f"run-{run_id}.wandb") for p in logs)
    later = max(logs, key=os.path.getmtime)
    assert sorted(h["global_step"] for h in summary(later)["history"] if "train/reward_mean" in h) == [5, 6]


def test_wandb_mode_from_the_environment_is_honoured(tmp_path):
    pytest.importorskip("wandb")
    recipe = write_recipe(tmp_path)
    run = nexrl(tmp_path, "run", recipe, "logger.backend=[wandb]", env=clean_env(tmp_path, WANDB_MODE="disabled"))
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / "run" / "wandb").exists() and "logging offline" not in run.stderr


def test_tensorboard_event_files_hold_the_runs_metrics(tmp_path):
    pytest.importorskip("tensorboardX")
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    recipe = write_recipe(tmp_path)
    run = nexrl(tmp_path, "run", recipe, "logger.backend=[console,tensorboard]")
    assert run.returncode == 0, run.stderr
    acc = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    recorded = {r["step"]: r["train/reward_mean"] for r in rows(tmp_path / "run" / "metrics.jsonl")
                if "train/reward_mean" in r}
    assert {e.step: pytest.approx(e.value) for e in acc.Scalars("train/reward_mean")} == recorded
    assert [e.step for e in acc.Scalars("val/reward")] == [0, 2, 4]


def hiding(tmp_path: Path, module: str) -> dict[str, str]:
    """An environment whose interpreters cannot find ``module`` (as if the extra were not installed)."""
    folder = tmp_path / f"hide-{module}"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import sys\nclass _Hide:\n    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] == {module!r}:\n            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, _Hide())\n")
    return clean_env(tmp_path, PYTHONPATH=os.pathsep.join([str(folder), str(REPO)]))


@pytest.mark.parametrize("override, message", [
    ("logger.backend=[tensorboard]",
     "error: logger.backend: 'tensorboard' needs the tensorboardX package: pip install 'nexrl-core[tensorboard]'"),
    ("logger.backend=[console,wandb]",
     "error: logger.backend: 'wandb' needs the wandb package: pip install 'nexrl-core[wandb]'"),
    ("logger.progress=rich",
     "error: logger.progress: the live progress display needs rich: pip install 'nexrl-core[progress]'"),
])
def test_a_missing_extra_is_reported_by_validate_and_run_alike(tmp_path, override, message):
    module = {"tensorboard": "tensorboardX", "wandb": "wandb", "rich": "rich"}[override.split("[")[-1].rstrip("]")
                                                                               .split(",")[-1].split("=")[-1]]
    env = hiding(tmp_path, module)
    recipe = write_recipe(tmp_path)
    for command in ("validate", "run"):
        result = nexrl(tmp_path, command, recipe, override, env=env)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- the CLI's manners


def test_version(tmp_path):
    out = nexrl(tmp_path, "--version")
    assert out.returncode == 0
    assert out.stdout.splitlines()[0] == f"nexrl-core {version('nexrl-core')}"


def test_help_shows_the_override_syntax(tmp_path):
    for args in (["--help"], ["run", "--help"]):
        out = nexrl(tmp_path, *args)
        assert out.returncode == 0
        assert "+key.sub=value" in out.stdout and "~key.sub" in out.stdout and "before or after" in out.stdout


def test_cli_manners_a_missing_recipe_and_option_help(tmp_path):
    for command in ("run", "validate", "config", "eval"):
        out = nexrl(tmp_path, command)
        assert out.returncode == 2
        assert f"error: a recipe is required: nexrl {command} RECIPE.yaml [key=value ...]" in out.stderr
        assert "overrides" not in out.stderr and "key=value ..." in out.stderr
    helped = nexrl(tmp_path, "plugins", "--help")
    [json_line] = [line for line in helped.stdout.splitlines() if line.strip().startswith("--json")]
    assert json_line.split("--json", 1)[1].strip().startswith("print the list as JSON")
    checked = nexrl(tmp_path, "plugins", "check", "--help")
    assert re.search(r"--json\s+print the reports as JSON", checked.stdout)
    shown = nexrl(tmp_path, "show", tmp_path / "nowhere")
    assert shown.returncode == 2 and shown.stderr.strip() == f"error: {tmp_path / 'nowhere'}: no such run directory"
    (tmp_path / "empty").mkdir()
    shown = nexrl(tmp_path, "show", tmp_path / "empty")
    assert shown.returncode == 2 and "no samples.jsonl yet" in shown.stderr and "Traceback" not in shown.stderr


def test_nexrl_config_prints_the_resolved_recipe(tmp_path):
    recipe = write_recipe(tmp_path)
    out = nexrl(tmp_path, "config", recipe, "trainer.total_train_steps=9", "weight.sync_mode=batch-async")
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["trainer"]["total_train_steps"] == 9 and printed["weight"]["sync_mode"] == "batch-async"
    assert printed["trainer"]["checkpoint_path"] == str(tmp_path / "run" / "checkpoints")  # interpolated
    assert printed["logger"]["progress"] == "auto"  # defaults the recipe does not name
    loaded = load_recipe(str(recipe), ["trainer.total_train_steps=9", "weight.sync_mode=batch-async"])
    assert printed == plain_config(loaded)
    assert not (tmp_path / "run").exists()  # nothing ran


def test_options_before_between_and_after_overrides(tmp_path):
    recipe = write_recipe(tmp_path)
    bad = "trajectory_pool.batch_size=5"
    for argv in (["config", "--no-check", recipe, bad, "trainer.total_train_steps=3"],
                 ["config", recipe, bad, "--no-check", "trainer.total_train_steps=3"],
                 ["config", recipe, bad, "trainer.total_train_steps=3", "--no-check"]):
        out = nexrl(tmp_path, *argv)
        assert out.returncode == 0, (argv, out.stderr)
        assert yaml.safe_load(out.stdout)["trainer"]["total_train_steps"] == 3


def test_an_invalid_recipe_exits_2_from_validate_config_and_run(tmp_path):
    recipe = write_recipe(tmp_path)
    results = [nexrl(tmp_path, command, recipe, "trajectory_pool.batch_size=5")
               for command in ("validate", "config", "run")]
    assert [r.returncode for r in results] == [2, 2, 2]
    for r in results:
        assert "error: trajectory_pool.batch_size (5) must be a multiple of trajectory_pool.group_size (2)" \
            in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_no_traceback_when_the_reader_of_stdout_is_gone(tmp_path):
    """`nexrl plugins | head`: the pipe is closed before nexrl writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([*nexrl_cmd(), "plugins"], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              env=clean_env(tmp_path), timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141
    assert proc.stderr == ""


def test_relative_paths_in_a_recipe_are_next_to_the_recipe(tmp_path):
    folder = tmp_path / "experiments" / "adding"
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 1", "answer": str(i + 1)}) + "\n"
                                                for i in range(4)))
    recipe = write_recipe(folder, RECIPE.replace("""  type: inline
  rows:
    - {{prompt: "1 + 2", answer: "3"}}
    - {{prompt: "2 + 2", answer: "4"}}
""", "  type: file\n  path: train.jsonl\n"), run_dir="runs/adding")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cfg_out = nexrl(tmp_path, "config", recipe, cwd=elsewhere)
    assert cfg_out.returncode == 0, cfg_out.stderr
    assert yaml.safe_load(cfg_out.stdout)["data"]["path"] == str(folder / "train.jsonl")
    run = nexrl(tmp_path, "run", recipe, cwd=elsewhere)
    assert run.returncode == 0, run.stderr
    assert (elsewhere / "runs" / "adding" / "metrics.jsonl").exists()  # outputs: relative to where nexrl runs
    # a path given on the command line is relative to the current folder
    (elsewhere / "other.jsonl").write_text((folder / "train.jsonl").read_text())
    given = nexrl(tmp_path, "config", recipe, "data.path=other.jsonl", cwd=elsewhere)
    assert yaml.safe_load(given.stdout)["data"]["path"] == "other.jsonl"


def test_the_plots_validation_lines():
    from nexrl_core.cli.plot import series, validation_keys

    found = series([
        {"step": 0, "time": 1.0, "val/reward": 0.5, "val/accuracy": 0.5, "val/response_chars": 16.0,
         "val/num_samples": 64.0, "val/gsm_reward": 0.4, "val/gsm_accuracy": 0.4, "val/math_reward": 0.6},
        {"step": 1, "train/reward_mean": 0.25, "flag": True},
        {"step": 1, "train/reward_mean": 0.75},  # a step recorded again keeps its last value
    ])
    assert found["train/reward_mean"] == [(1, 0.75)] and "flag" not in found and "time" not in found
    # overall fractions, then each data source's reward; not counts, not other scales
    assert validation_keys(found) == ["val/reward", "val/accuracy", "val/gsm_reward", "val/math_reward"]


def test_the_plot_draws_each_domains_training_reward(tmp_path):
    pytest.importorskip("matplotlib")
    from nexrl_core.cli.plot import domain_reward_keys, plot_run, series

    rows = [{"step": s, "train/reward_mean": 0.1 * s, "train/code/reward_mean": 0.05 * s,
             "train/arithmetic/reward_mean": 0.2 * s, "train/code/num_groups": 2.0, "val/code_reward": 0.1}
            for s in range(1, 4)]
    found = series(rows)
    assert domain_reward_keys(found) == ["train/arithmetic/reward_mean", "train/code/reward_mean"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_run(str(tmp_path))
    assert os.path.getsize(out) > 0


def test_the_plots_third_panel_is_the_gradient_norm_of_an_rl_run_and_the_loss_of_a_supervised_one():
    from nexrl_core.cli.plot import series, update_key

    rl = series([{"step": 1, "train/loss": 1e-9, "train/grad_norm": 2.5, "train/advantages_abs_mean": 0.7}])
    assert update_key(rl) == "train/grad_norm"  # the surrogate's value is ~0 on-policy: not a progress signal
    sft = series([{"step": 1, "train/loss": 1.7, "train/grad_norm": 2.5}])
    assert update_key(sft) == "train/loss"
    assert update_key(series([{"step": 1, "train/reward_mean": 0.5}])) is None


def test_a_train_service_path_is_next_to_the_recipe(tmp_path):
    from nexrl_core.launch.recipe import resolve_recipe_paths

    (tmp_path / "weights").mkdir()
    values = {"trainer": {"type": "self_hosted_grpo"},
              "service": {"train_service": {"model_path": "weights", "lr": 1e-5}}}
    resolve_recipe_paths(values, str(tmp_path))  # the selected service (local_torch) declares model_path a path
    assert values["service"]["train_service"]["model_path"] == str(tmp_path / "weights")
    unknown = {"trainer": {"type": "self_hosted_grpo"},
               "service": {"train_service": {"backend": "nope", "model_path": "weights"}}}
    resolve_recipe_paths(unknown, str(tmp_path))  # the checks report the backend; paths are left as written
    assert unknown["service"]["train_service"]["model_path"] == "weights"


@pytest.mark.parametrize("argv,line", [
    (["valdate", "recipe.yaml"], "nexrl: error: unknown command 'valdate'; did you mean 'validate'? (commands: run, "),
    (["frobnicate"], "nexrl: error: unknown command 'frobnicate' (commands: run, validate, "),
])
def test_a_misspelled_command_gets_one_line_with_the_nearest(argv, line, capsys):
    from nexrl_core.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    [said] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("nexrl: error:")]
    assert said.startswith(line), said


def test_a_step_without_learning_signal_says_so_on_the_progress_line():
    """Every group tied (grad norm 0): the line says the step could not move the weights; a step
    with signal shows the share of rows in tied groups only."""
    from nexrl_core.cli.progress import StepStats

    stats = StepStats(total_steps=3)
    base = {"train/num_trajectories": 16, "train/reward_mean": 1.0, "timing/train_s": 1.0}
    stats.add({**base, "train/rows_in_flat_groups": 1.0, "train/grad_norm": 0.0}, 1)
    assert dict(stats.fields())["flat groups"] == "100% (no learning signal this step: grad norm 0)"
    stats.add({**base, "train/rows_in_flat_groups": 0.25, "train/grad_norm": 0.7}, 2)
    assert dict(stats.fields())["flat groups"] == "25%"
    stats.add({**base, "train/update_skipped": 1.0}, 3)  # a trainer without the share
    assert dict(stats.fields())["flat groups"] == "(no learning signal this step: grad norm 0)"
