"""`nexrl validate` and `nexrl run` agree on a recipe that selects the tinker backend without an API key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nexrl_core.testing import make_recipe, write_recipe

NEXRL = str(Path(sys.executable).with_name("nexrl"))


def _recipe(tmp_path: Path, tokenizer_path: str) -> Path:
    recipe = make_recipe(run_dir=str(tmp_path / "run"),
                         data={"type": "inline", "rows": [{"prompt": "What is 1 + 1?", "answer": "2"}] * 4},
                         trajectory_pool={"batch_size": 2, "key_list": ["uid"]}, weight={"backend": "version_only"},
                         service={"inference_service": {"backend": "tinker", "base_model": "tiny",
                                                        "tokenizer_path": tokenizer_path}})
    return Path(write_recipe(recipe, tmp_path / "recipe.yaml"))


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


# -- the remote-API trainers' recipes: `nexrl validate` and `nexrl run` print the same lines --------------

import pytest  # noqa: E402

from tests.tinker_plugin.helpers import grpo_recipe  # noqa: E402


@pytest.fixture
def cli(monkeypatch, capfd, reset_loguru, tmp_path):
    """``cli(command, recipe_dict, *overrides)`` -> (exit code, error lines), nexrl-tinker and nexrl-grpo
    loaded, no Tinker credentials in the environment or in HOME."""
    import nexrl_core.plugins as plugins
    from nexrl_core.cli import main
    from nexrl_core.plugins import PluginManager
    from tests.support.letters import LetterPlugin

    for name in ("TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_CREDENTIAL_CMD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-tinker,nexrl-grpo,nexrl-torch")
    pm = PluginManager()
    pm.register(LetterPlugin(), name="letters", distribution="nexrl-letters (in-process)")
    monkeypatch.setattr(plugins, "_DEFAULT", pm)

    def call(command: str, recipe: dict, *overrides: str):
        path = write_recipe(recipe, tmp_path / "recipe.yaml")
        code = main([command, path, *overrides])
        _, err = capfd.readouterr()
        assert "Traceback" not in err
        return code, [line for line in err.splitlines() if line.startswith("error: ")]
    return call


NO_KEY = [
    "error: service.inference_service.api_key: no Tinker API key: set service.inference_service.api_key (e.g. "
    "${oc.env:TINKER_API_KEY}) or the TINKER_API_KEY environment variable",
    "error: service.train_service.api_key: no Tinker API key: set service.train_service.api_key (e.g. "
    "${oc.env:TINKER_API_KEY}) or the TINKER_API_KEY environment variable",
]
CASES = {
    "no_api_key": ([], NO_KEY),
    "temperature_the_service_cannot_score": (
        ["+service.train_service.api_key=tml-x", "+service.inference_service.api_key=tml-x",
         "rollout_worker.sampling.temperature=0.7"],
        ["error: rollout_worker.sampling.temperature: 0.7, but the Tinker service scores tokens at temperature 1 "
         "only, so the importance ratio of algorithm.loss_fn would compare two different distributions; sample at "
         "temperature 1.0 (or 0, greedy)"]),
    "clip_ratio_without_ppo": (
        ["+service.train_service.api_key=tml-x", "+service.inference_service.api_key=tml-x",
         "+algorithm.clip_ratio_high=0.3"],
        ["error: algorithm.clip_ratio_high: read only with algorithm.loss_fn: ppo (loss_fn is 'importance_sampling'); "
         "delete it"]),
    "local_service_for_a_remote_trainer": (
        ["service.train_service.backend=local_torch", "+service.inference_service.api_key=tml-x"],
        ["error: service.train_service.backend: 'local_torch' is not one of tinker: trainer 'remote_api_grpo' builds "
         "tinker_datums batches, and train service 'local_torch' (nexrl-torch) takes torch_tensors batches"]),
    "self_hosted_trainer_on_tinker": (
        ["trainer.type=self_hosted_grpo", "~algorithm.loss_fn", "weight.backend=in_process",
         "service.inference_service.backend=hf", "~service.inference_service.tokenizer_path",
         "~service.inference_service.base_url", "+service.inference_service.model_path={tiny}"],
        ["error: service.train_service.backend: 'tinker' is not one of local_torch: trainer 'self_hosted_grpo' "
         "builds torch_tensors batches, and train service 'tinker' (nexrl-tinker) takes tinker_datums batches"]),
    "remote_trainer_without_the_tinker_weight_sync": (
        ["+service.train_service.api_key=tml-x", "+service.inference_service.api_key=tml-x",
         "weight.backend=version_only"],
        ["error: trainer.type: trainer 'remote_api_grpo' needs 'weight_sync:tinker_sampler' (it trains on the "
         "Tinker service, and without the tinker weight sync rollouts keep sampling the initial model), which "
         "neither inference backend 'tinker', weight-sync backend 'version_only' provides; it is provided by "
         "weight.backend: tinker (nexrl-tinker)"]),
    "estimator_needing_a_critic": (
        ["+service.train_service.api_key=tml-x", "+service.inference_service.api_key=tml-x",
         "algorithm.type=gae"],
        ["error: algorithm.type: advantage estimator 'gae' needs values, which trainer 'remote_api_grpo' does "
         "not compute (it computes: nothing beyond rewards)"]),
    "train_service_typo": (
        ["+service.train_service.api_key=tml-x", "+service.inference_service.api_key=tml-x",
         "+service.train_service.lora_rnk=4", "service.train_service.lr=-1"],
        ["error: service.train_service.lr: expected a non-negative number, got -1",
         "error: service.train_service.lora_rnk: unknown key; did you mean 'service.train_service.lora_rank'?"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_validate_and_run_refuse_a_remote_recipe_with_the_same_lines(name, cli, tiny_folder, tmp_path):
    overrides, expected = CASES[name]
    recipe = grpo_recipe(tmp_path / "run", "http://127.0.0.1:9", tiny_folder, steps=1, group=2)
    for section in ("train_service", "inference_service"):
        del recipe["service"][section]["api_key"]
    overrides = [o.format(tiny=tiny_folder) for o in overrides]
    results = {command: cli(command, recipe, *overrides) for command in ("validate", "run")}
    for command, (code, errors) in results.items():
        assert code == 2, command
        assert sorted(errors) == sorted(expected), f"{command}: {errors}"
    assert not (tmp_path / "run").exists()  # refused before anything started
