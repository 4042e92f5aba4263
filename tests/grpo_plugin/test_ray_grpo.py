"""The GRPO loop of the tiny Llama in ``launch_mode: ray`` against the same recipe in local mode.

The trainer and the ``hf`` engine sit in different actors, so every weight push crosses a process
boundary (the ``in_process`` backend's deferred export goes through Ray's object store). In sync
mode the Ray run must match the local run number for number and end with bit-identical weights,
although its four rollout workers sit in two actors and take two tasks per call (batches are in
issue order, not completion order: docs/reliability.md, "Reproducibility"). A second Ray run keeps
the default placement (trainer and engine in one actor: the in-process hand-over) and must match
as well.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from nexrl_core import execute
from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.types import NexRLRole
from tests.support.letters import grpo_plugin_manager
from tests.support.metrics import without_clock
from tests.support.torch_fixtures import TINY_RUN_MONITOR

STEPS = 4
PROMPTS = ["the quick", "what is", "count: one", "hello world"]


WORKERS = 4
# Ray only: the workers spread over two actors, each taking two tasks per data-loader call.
RAY_WORKERS = {"num_actors": 2, "tasks_per_call": 2}


def recipe(run_dir: Path, model_dir: str, launch_mode: str, steps: int = STEPS, **ray: dict) -> dict:
    return {
        "launch_mode": launch_mode,
        "run_dir": str(run_dir),
        "seed": 7,
        "logger": {"backend": [], "level": "WARNING"},
        "data": {"type": "inline", "rows": [{"prompt": p} for p in PROMPTS]},
        "validate": {"validate_before_train": True, "n_samples": 2,
                     "data": {"type": "inline", "rows": [{"prompt": "the lazy dog"}, {"prompt": "nine, ten"}]}},
        "rollout_worker": {"num_workers": WORKERS, "sampling": {"max_tokens": 6, "temperature": 1.0},
                           "evaluator": {"type": "letter_share", "letter": "e"},
                           **(RAY_WORKERS if launch_mode == "ray" else {})},
        "trajectory_pool": {"batch_size": 8, "group_size": 4, "key_list": ["uid"]},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": steps, "save_freq": steps},
        "weight": {"sync_mode": "sync", "backend": "in_process", "validate_freq": 2, "rollout_limit": "batch"},
        "service": {"train_service": {"model_path": model_dir, "lr": 5e-2, "grad_clip": 1.0, "num_threads": 1},
                    "inference_service": {"backend": "hf", "model_path": model_dir, "num_threads": 1}},
        "runtime_monitor": TINY_RUN_MONITOR,
        **({"ray": ray} if ray else {}),
    }


def run(root: Path, model_dir: str, launch_mode: str, steps: int = STEPS, **ray) -> dict:
    path = root / f"{launch_mode}_{len(list(root.iterdir()))}.yaml"
    run_dir = path.with_suffix("")
    written = recipe(run_dir, model_dir, launch_mode, steps, **ray)
    path.write_text(yaml.safe_dump(written, sort_keys=False))
    controller = NexRLController(load_recipe(str(path)), plugin_manager=grpo_plugin_manager())
    seen: dict = {}
    release = controller.resource_manager.shutdown

    def read_then_release():
        seen["served_version"] = execute(controller.inference_client.model_version)
        if written["service"]["inference_service"].get("replicas", 1) > 1:
            seen["replicas"] = execute(controller.inference_client.replica_stats)
        release()

    controller.resource_manager.shutdown = read_then_release
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.global_step == steps
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(str(run_dir / "checkpoints" / f"global_step_{steps}" / "model.safetensors"))
    rm = controller.resource_manager
    placement = None
    if launch_mode == "ray":
        placement = (rm.actor_of(NexRLRole.TRAINER).name, rm.actor_of(NexRLRole.INFERENCE_SERVICE).name,
                     len({rm.actor_of(NexRLRole.ROLLOUT_WORKER, i).name for i in range(WORKERS)}))
    return {"rows": rows, "weights": weights, "summary": summary, "placement": placement, **seen}


_comparable = without_clock


@pytest.fixture(scope="module")
def local_run(tiny_model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXRL_LOAD_PLUGINS", "nexrl-grpo,nexrl-torch")
        return run(tmp_path_factory.mktemp("grpo_local"), tiny_model_dir, "local")


@pytest.mark.parametrize("placement", ["apart", "together"])
def test_ray_run_matches_the_local_run(local_run, ray_cluster, tiny_model_dir, tmp_path, monkeypatch, placement):
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-grpo,nexrl-torch")  # the actors load nexrl-grpo (+ the in-process evaluator)
    ray_run = run(tmp_path, tiny_model_dir, "ray", **({"colocation": {"trainer": None}} if placement == "apart" else {}))
    trainer_actor, engine_actor, worker_actors = ray_run["placement"]
    assert (trainer_actor != engine_actor) == (placement == "apart")
    assert worker_actors == RAY_WORKERS["num_actors"]
    assert ray_run["served_version"] == STEPS  # the engine in its actor serves the last push

    local_rows, ray_rows = _comparable(local_run["rows"]), _comparable(ray_run["rows"])
    assert [r["step"] for r in ray_rows] == [r["step"] for r in local_rows]
    assert ray_rows == local_rows  # rewards, losses, validation numbers: the same run
    assert ray_run["summary"].validation == local_run["summary"].validation
    assert len({r["train/reward_mean"] for r in ray_rows if "train/reward_mean" in r}) > 1  # the weights moved
    assert ray_run["weights"].keys() == local_run["weights"].keys()
    for name, tensor in local_run["weights"].items():
        assert torch.equal(ray_run["weights"][name], tensor), name


def test_two_trainer_ranks_in_ray_mode(local_run, ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    """`service.train_service.world_size: 2` in launch_mode ray: rank 1 is a Ray actor the trainer's
    actor starts in a placement group; the first step matches the one-process local run (later steps
    may sample other tokens once float sums differ: the weights' equivalence is test_distributed's)."""
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-grpo,nexrl-torch")
    original = recipe

    def two_ranks(*args, **kwargs):
        out = original(*args, **kwargs)
        out["service"]["train_service"]["world_size"] = 2
        return out

    monkeypatch.setattr(sys.modules[__name__], "recipe", two_ranks)
    # one step: only the first step is compared (later ones may sample other tokens)
    ray_run = run(tmp_path, tiny_model_dir, "ray", 1, colocation={"trainer": None})
    log = next(tmp_path.glob("ray_*/run.log")).read_text()
    assert "train service: 2 ranks (fsdp); rank 0 here" in log and "rank 1: Ray actor nexrl-train-rank-1 on " in log
    local_rows, ray_rows = _comparable(local_run["rows"]), _comparable(ray_run["rows"])
    first_local = next(r for r in local_rows if "train/loss" in r)
    first_ray = next(r for r in ray_rows if "train/loss" in r)
    assert first_ray["train/reward_mean"] == first_local["train/reward_mean"]
    assert first_ray["train/grad_norm"] == pytest.approx(first_local["train/grad_norm"], rel=1e-4)
    assert first_ray["train/loss"] == pytest.approx(first_local["train/loss"], rel=1e-4, abs=1e-6)
    assert ray_run["weights"].keys() == local_run["weights"].keys()


def test_engine_replicas_in_actors_of_their_own(local_run, ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    """`replicas: 2, replica_actors: true` in launch_mode ray: replica 1 is an engine in a Ray actor
    of its own; both replicas take requests, every push reaches both (the oldest version served is
    the last push), and the run is the one-engine local run (each request's sampling is seeded, so
    which replica serves it does not matter)."""
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-grpo,nexrl-torch")
    original = recipe

    def two_replicas(*args, **kwargs):
        out = original(*args, **kwargs)
        out["service"]["inference_service"].update(replicas=2, replica_actors=True)
        return out

    monkeypatch.setattr(sys.modules[__name__], "recipe", two_replicas)
    ray_run = run(tmp_path, tiny_model_dir, "ray")
    assert ray_run["served_version"] == STEPS
    assert [r["version"] for r in ray_run["replicas"]] == [STEPS, STEPS]  # every push reached both
    assert all(r["requests"] > 0 for r in ray_run["replicas"]), ray_run["replicas"]
    log = next(tmp_path.glob("ray_*/run.log")).read_text()
    assert "replica 1: Ray actor nexrl-engine-replica-1 on " in log
    local_rows, ray_rows = _comparable(local_run["rows"]), _comparable(ray_run["rows"])
    assert ray_rows == local_rows
    for name, tensor in local_run["weights"].items():
        assert torch.equal(ray_run["weights"][name], tensor), name
