"""README's "Train on your own data", run as printed (issue #45): its three files written into a
fresh folder, then its command, on the real SmolLM2. The run trains all its steps, the reward
rises (the model learns to answer in one word), and the last step is kept by default."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.slow.test_quickstart import _nexrl_cmd, _skip_reason
from tests.support.metrics import read_metrics

README = Path(__file__).resolve().parents[2] / "README.md"


def _section() -> str:
    text = README.read_text()
    start = text.index("## Train on your own data\n")
    return text[start:text.index("\n## ", start + 1)]


def _printed() -> tuple[dict[str, str], str]:
    """The files (path -> text) and the command of the section, as printed."""
    section = _section()
    files = {m.group(1): m.group(2) for m in re.finditer(r"^`(my_task/[\w.]+)`[^\n]*\n\n```\w+\n(.*?)```",
                                                         section, re.S | re.M)}
    commands = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(commands) == 1, commands
    return files, commands[0].strip()


def test_the_section_prints_three_files_and_one_command():
    files, command = _printed()
    assert sorted(files) == ["my_task/recipe.yaml", "my_task/rewards.py", "my_task/train.jsonl"]
    assert command == "nexrl run my_task/recipe.yaml"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_own_data_example_trains_as_printed(tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    files, command = _printed()
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    argv = shlex.split(command)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("NEXRL_LOAD_PLUGINS", None)
    proc = subprocess.run(_nexrl_cmd() + argv[1:], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, f"{command} exited {proc.returncode}\n{proc.stderr[-6000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stopped_by"] == "finished" and summary["global_step"] == 10, summary
    rewards = [r["train/reward_mean"] for r in read_metrics(tmp_path / "runs" / "my_task") if "train/reward_mean" in r]
    assert len(rewards) == 10
    assert sum(rewards[-3:]) / 3 > rewards[0], rewards  # it learns
    final = tmp_path / "runs" / "my_task" / "checkpoints" / "global_step_10"
    assert (final / "model.safetensors").is_file()  # kept with no save_freq in the recipe
    assert "export       nexrl export runs/my_task/checkpoints/global_step_10" in proc.stderr + proc.stdout
