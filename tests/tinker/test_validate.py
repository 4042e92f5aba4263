"""`nexrl validate` and `nexrl run` agree on a recipe that selects the tinker backend without an API key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

NEXRL = str(Path(sys.executable).with_name("nexrl"))


def _recipe(tmp_path: Path, tokenizer_path: str) -> Path:
    recipe = {
        "run_dir": str(tmp_path / "run"),
        "data": {"type": "inline", "rows": [{"prompt": "What is 1 + 1?", "answer": "2"}] * 4},
        "trajectory_pool": {"batch_size": 2, "group_size": 2, "key_list": ["uid"]},
        "trainer": {"type": "mock", "total_train_steps": 1},
        "weight": {"backend": "version_only"},
        "service": {"inference_service": {"backend": "tinker", "base_model": "tiny",
                                          "tokenizer_path": tokenizer_path}},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_a_missing_key_is_reported_by_validate_and_stops_run_before_it_starts(tmp_path, tiny_folder):
    env = {k: v for k, v in os.environ.items() if k not in ("TINKER_API_KEY", "TINKER_CREDENTIAL_CMD")}
    env.update(HOME=str(tmp_path), NEXRL_LOAD_PLUGINS="nexrl-tinker", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    recipe = _recipe(tmp_path, tiny_folder)
    expected = "service.inference_service.api_key: no Tinker API key"
    validate = subprocess.run([NEXRL, "validate", str(recipe)], capture_output=True, text=True, env=env, timeout=300)
    assert validate.returncode != 0 and expected in validate.stdout + validate.stderr, validate
    run = subprocess.run([NEXRL, "run", str(recipe)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode != 0 and expected in run.stdout + run.stderr, run
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    ok = subprocess.run([NEXRL, "validate", str(recipe)], capture_output=True, text=True, timeout=300,
                        env={**env, "TINKER_API_KEY": "tml-abc"})
    assert ok.returncode == 0, ok
