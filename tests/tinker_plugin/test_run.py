"""`nexrl run` subprocesses against the stand-in: recipes/tinker_grpo.yaml end to end (the API key never
reaches the run directory or the output), exact resume after a kill, and `nexrl plugins` listing the
remote-API trainers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from nexrl_tinker.standin import BaseModel, StandinServer
from tests.reliability.helpers import NEXRL, REPO_ROOT, Run
from tests.support.tiny_lm import build_model
from tests.tinker_plugin.helpers import MODEL, grpo_recipe, metrics_rows

pytestmark = pytest.mark.timeout(600)
RECIPE = str(REPO_ROOT / "recipes" / "tinker_grpo.yaml")


@pytest.fixture
def serve(tokenizer, tmp_path):
    """``serve(**kwargs)`` -> a started stand-in serving ``tiny`` (stopped at the end)."""
    servers = []

    def make(**kwargs):
        server = StandinServer({MODEL: BaseModel(MODEL, build_model(tokenizer), tokenizer)},
                               state_dir=str(tmp_path / "state"), **kwargs).start()
        servers.append(server)
        return server
    yield make
    for server in servers:
        server.stop()


def _nexrl(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(NEXRL + list(args), capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=str(REPO_ROOT))


def test_the_recipe_runs_end_to_end_against_the_standin_and_the_key_stays_secret(serve, run_env, tiny_folder,
                                                                                  tmp_path):
    canary = "tml-CANARY-5d1e0c9a77"
    server = serve(api_key=canary)  # the only key the stand-in accepts: the run must send it
    env = {**run_env, "TINKER_API_KEY": canary, "TINKER_BASE_URL": server.url}
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", f"service.train_service.base_model={MODEL}",
                 f"service.inference_service.tokenizer_path={tiny_folder}", "service.train_service.lora_rank=4",
                 "data.num_rows=8", "data.max_value=9", "validate.data.num_rows=4", "validate.data.max_value=9",
                 "rollout_worker.num_workers=4", "rollout_worker.sampling.max_tokens=6",
                 "trajectory_pool.batch_size=8", "trajectory_pool.group_size=4", "trainer.total_train_steps=3",
                 "trainer.save_freq=2", "weight.validate_freq=2", "logger.level=DEBUG"]
    validate = _nexrl("validate", RECIPE, *overrides, env=env)
    assert validate.returncode == 0, validate.stdout + validate.stderr
    run = _nexrl("run", RECIPE, *overrides, env=env)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "val/num_samples" in r] == [0, 2]
    assert all("train/loss_sum" in r and "train/rollout_kl_k3" in r for r in rows if "train/reward_mean" in r)
    for step in (2, 3):
        state = json.loads((run_dir / "checkpoints" / f"global_step_{step}" / "tinker_state.json").read_text())
        assert state["optimizer_steps"] == step and state["tinker_path"].startswith("tinker://")
    assert server.count("POST /api/v1/forward_backward") == 3

    # `nexrl eval` of a checkpoint samples its recorded snapshot: greedy validation of step 2 again.
    evaluation = _nexrl("eval", RECIPE, *overrides, f"checkpoint={run_dir / 'checkpoints' / 'global_step_2'}", env=env)
    assert evaluation.returncode == 0, (evaluation.stdout + evaluation.stderr)[-4000:]
    validation_2 = next(r for r in rows if "val/num_samples" in r and r["step"] == 2)
    assert json.loads(evaluation.stdout.strip().splitlines()[-1]) == {k: v for k, v in validation_2.items()
                                                                      if k != "step"}

    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"metrics.jsonl", "run.log", "nexrl_state.json", "tinker_state.json"} <= {p.name for p in files}
    assert "Tinker" in (run_dir / "run.log").read_text()  # the log is there and speaks of the service
    for path in files:
        assert b"CANARY" not in path.read_bytes(), path
    assert "CANARY" not in run.stdout + run.stderr + evaluation.stdout + evaluation.stderr


def test_a_killed_run_resumes_with_the_same_optimizer_state_and_data(serve, run_env, tiny_folder, tmp_path):
    """Killed right after step 2's checkpoint, then `resume.mode=auto`: the same metrics as an
    uninterrupted run, and the same final remote weights and Adam state, tensor for tensor."""
    import torch
    from safetensors.torch import load_file

    server = serve()
    env = {**run_env, "TINKER_BASE_URL": server.url}
    steps = 4

    def recipe(root: Path) -> str:
        data = grpo_recipe(root / "run", server.url, tiny_folder, steps=steps, group=2, workers=1)
        data["rollout_worker"]["evaluator"] = {"type": "letter_share", "letters": "e"}
        data["trainer"]["save_freq"] = 1
        data["logger"] = {"backend": ["console"], "level": "INFO"}
        root.mkdir()
        path = root / "recipe.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return str(path)

    reference = tmp_path / "reference"
    ref = Run(recipe(reference), [], env, tmp_path / "reference.log")
    assert ref.wait(300) == 0, ref.output()[-4000:]

    resumed = tmp_path / "resumed"
    path = recipe(resumed)
    first = Run(path, [], env, tmp_path / "first.log")
    first.wait_for(lambda: (resumed / "run" / "checkpoints" / "global_step_2" / "nexrl_state.json").exists(),
                   timeout=300)
    first.kill()
    second = Run(path, ["resume.mode=auto"], env, tmp_path / "second.log")
    assert second.wait(300) == 0, second.output()[-4000:]
    assert "resumed from" in second.output()

    assert metrics_rows(resumed / "run") == metrics_rows(reference / "run")

    final = [json.loads((root / "run" / "checkpoints" / f"global_step_{steps}" / "tinker_state.json").read_text())
             for root in (reference, resumed)]
    assert final[0]["optimizer_steps"] == final[1]["optimizer_steps"] == steps
    assert final[0]["model_id"] != final[1]["model_id"]  # the resumed run continued in a new training run
    remote = [server.state_dir / s["tinker_path"].removeprefix("tinker://") for s in final]
    for name in ("weights.safetensors", "optimizer.safetensors"):
        mine, theirs = load_file(str(remote[1] / name)), load_file(str(remote[0] / name))
        assert mine.keys() == theirs.keys() and mine
        different = [k for k in theirs if not torch.equal(mine[k], theirs[k])]
        assert not different, f"{name}: differs from the uninterrupted run: {different[:5]}"
    step_1 = json.loads((reference / "run" / "checkpoints" / "global_step_1" / "tinker_state.json").read_text())
    first_weights = load_file(str(server.state_dir / step_1["tinker_path"].removeprefix("tinker://") /
                                  "weights.safetensors"))
    last_weights = load_file(str(remote[0] / "weights.safetensors"))
    assert any(not torch.equal(first_weights[k], last_weights[k]) for k in last_weights)  # training moved them


def test_nexrl_plugins_lists_the_remote_api_trainers(run_env):
    out = _nexrl("plugins", "--json", env=run_env, timeout=120)
    assert out.returncode == 0, out.stderr
    tinker = next(p for p in json.loads(out.stdout)["plugins"] if p["distribution"] == "nexrl-tinker")
    # remote_api_opd where nexrl-grpo (its distillation keys) is installed, as it is here
    assert tinker["components"]["trainer"] == ["remote_api_cross_entropy", "remote_api_grpo", "remote_api_opd"]
    assert tinker["components"]["train_service"] == ["tinker"]
    assert tinker["components"]["inference_backend"] == tinker["components"]["weight_sync_backend"] == ["tinker"]
