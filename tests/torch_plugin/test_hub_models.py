"""``model_path`` as a Hugging Face Hub id, resolved offline through a cache folder built here in
the Hub's layout (``models--org--name/refs/main`` naming a snapshot folder): the train service and
the engine load it, a run trains on it, and an id that is not cached while offline is one line
naming the cache and the command that fetches it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from nexrl_core.controller import NexRLController
from nexrl_core.errors import ConfigError
from nexrl_core.launch.recipe import load_recipe
from nexrl_torch.models import model_path_problem, resolve_model_path
from tests.support.letters import grpo_plugin_manager, tiny_grpo_recipe

REPO_ID = "nexrl-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tiny_model_dir, tmp_path, monkeypatch):
    """A Hub cache holding REPO_ID (the tiny model) at COMMIT, offline."""
    cache = tmp_path / "hub"
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    shutil.copytree(tiny_model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_cached_hub_id_resolves_to_its_snapshot(hub_cache):
    assert model_path_problem(REPO_ID) is None
    assert Path(resolve_model_path(REPO_ID)) == hub_cache / f"models--nexrl-test--tiny-llama/snapshots/{COMMIT}"


def test_an_uncached_hub_id_offline_names_the_cache_and_the_fetch_command(hub_cache):
    problem = model_path_problem("Qwen/Qwen3-0.6B")
    assert problem == (f"model_path: 'Qwen/Qwen3-0.6B' is no local folder, and the Hugging Face Hub model of that id "
                       f"is not in the cache ({hub_cache}) while HF_HUB_OFFLINE is set: fetch it once online with "
                       f"`hf download Qwen/Qwen3-0.6B`, or give a model folder")
    with pytest.raises(ConfigError, match="hf download Qwen/Qwen3-0.6B"):
        resolve_model_path("Qwen/Qwen3-0.6B")
    # a path that exists but holds no model, and one that cannot be an id, stay what they were
    assert "is not a model folder (no config.json)" in model_path_problem(str(hub_cache))
    assert "is not a model folder (no config.json)" in model_path_problem("./no/such/folder")


def test_a_run_trains_a_hub_model_offline_and_validate_names_a_missing_one(hub_cache, tmp_path, capsys):
    from nexrl_core.cli import main

    cfg = tiny_grpo_recipe(tmp_path / "run", REPO_ID, group=4, steps=2)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    NexRLController(load_recipe(str(path)), plugin_manager=grpo_plugin_manager()).run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2]

    cfg["service"]["train_service"]["model_path"] = "Qwen/Qwen3-0.6B"
    cfg["run_dir"] = str(tmp_path / "other")
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert ("error: service.train_service.model_path: 'Qwen/Qwen3-0.6B' is no local folder, and the Hugging Face "
            "Hub model of that id is not in the cache") in err, err
