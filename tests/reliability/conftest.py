"""Fixtures of the reliability suite: the tiny model, the test plugin as an installed
distribution, and ``start_run`` (a ``nexrl run`` subprocess, see helpers.py).

Subprocesses get ``OMP_NUM_THREADS=1`` and the recipes ``num_threads: 1``: the suite shares two
cores with other work.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.reliability.helpers import Run  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny Llama + tokenizer of tests/grpo_plugin (an HF folder), built once per session."""
    pytest.importorskip("torch")
    pytest.importorskip("nexrl_grpo")
    from tests.support.torch_fixtures import build_model, build_tokenizer

    folder = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def plugin_env(tmp_path_factory) -> dict[str, str]:
    """Environment for ``nexrl run`` subprocesses: the test plugin (tests/reliability/reltest_plugin.py)
    installed as distribution ``nexrl-reltest`` with an entry point, one torch thread, offline HF."""
    root = tmp_path_factory.mktemp("reltest_dist")
    info = root / "nexrl_reltest-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nexrl-reltest\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[nexrl]\nreltest = tests.reliability.reltest_plugin\n")
    env = dict(os.environ)
    env.pop("NEXRL_LOAD_PLUGINS", None)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(root), str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
    })
    return env


@pytest.fixture
def start_run(plugin_env, tmp_path):
    """``start_run(recipe_path, *overrides, env=None)`` -> :class:`Run` (killed at teardown if still
    running); ``env`` entries are added to ``plugin_env``."""
    runs: list[Run] = []

    def start(recipe: str, *overrides: str, env: dict[str, str] | None = None) -> Run:
        run = Run(recipe, list(overrides), {**plugin_env, **(env or {})}, tmp_path / f"nexrl_run_{len(runs)}.log")
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill()
