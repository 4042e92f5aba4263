"""A short `nexrl run` with `vllm` inference against the fake vLLM server: a trainer whose weights
change every step, pushed with vllm_disk; every trajectory carries the version whose weights
produced it. And `nexrl validate` on the weight-sync options."""

from __future__ import annotations

import math
import time
import types

import pytest
import torch

from nexrl_core import hookimpl
from nexrl_core.builtins.mock import MockTrainer
from nexrl_core.launch.recipe import check_config, load_recipe
from nexrl_core.testing import make_recipe, write_recipe
from tests.support.vllm_server import LOGITS, served_logprob

pytestmark = pytest.mark.timeout(120)


def step_logits(step: int) -> torch.Tensor:
    """The test trainer's weights after ``step`` steps (step 0: the served initial weights)."""
    return torch.tensor([math.sin(0.1 * t * (step + 1)) for t in range(256)])


class LogitsTrainer(MockTrainer):
    """A mock trainer whose exported weights depend on its step (what vllm_disk pushes)."""

    def export_weights(self):
        return {LOGITS: step_logits(self.global_step)}


@pytest.fixture
def run_pm(vllm_pm):
    plugin = types.ModuleType("vllm_run_test_plugin")
    plugin.nexrl_trainers = hookimpl(lambda: {"logits_mock": LogitsTrainer})
    vllm_pm.register(plugin, "vllm-run-test", "tests")
    return vllm_pm


def recipe(tmp_path, url: str, **weight) -> dict:
    """4 steps of the logits trainer, vllm inference at ``url``, weights pushed by vllm_disk (``weight``'s
    keys added; a backend named there keeps sync_dir: the check must name it)."""
    return make_recipe(
        None, run_dir=str(tmp_path / "run"),
        data={"type": "inline", "rows": [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(8)]},
        rollout_worker={"num_workers": 3, "sampling": {"max_tokens": 8}},
        trajectory_pool={"batch_size": 4, "group_size": 2, "key_list": ["uid"]},
        trainer={"type": "logits_mock", "total_train_steps": 4},
        weight={"sync_mode": "sync", "backend": "vllm_disk", "sync_dir": str(tmp_path / "sync"), **weight},
        service={"inference_service": {"backend": "vllm", "url": url, "timeout": 5.0, "max_retries": 3,
                                       "retry_backoff": 0.05}})


def test_mock_trainer_run_with_vllm_inference_and_disk_sync(fake_vllm, run_pm, run_local, tmp_path):
    controller, summary = run_local(recipe(tmp_path, fake_vllm.url), pm=run_pm)
    assert summary.stopped_by == "finished" and summary.global_step == 4
    # The controller pushes the initial weights (version 0) before any rollout, then one version per step.
    assert fake_vllm.loaded_paths == [str(tmp_path / "sync" / f"v{v:06d}") for v in range(5)]
    assert fake_vllm.control_log.count("resume") == 5 and fake_vllm.paused is False
    batches = controller.trainer.batches
    assert len(batches) == 4
    for step, batch in enumerate(batches):
        for traj in batch:
            assert traj["model_version"] == step  # sync mode: each batch comes from the weights of its step
            logits = step_logits(traj["model_version"]).tolist()
            want = [served_logprob(logits, t) for t in traj["response_token_ids"]]
            assert traj["response_logprobs"] == pytest.approx(want, abs=1e-5)
            assert traj["prompt_token_ids"] == list(traj["prompt"].encode()) if isinstance(traj["prompt"], str) \
                else traj["prompt_token_ids"]


def test_validate_checks_the_weight_sync_options(run_pm, tmp_path):
    def problems(**weight):
        data = recipe(tmp_path, "http://127.0.0.1:9", **weight)
        if weight.get("backend") == "vllm_nccl":
            del data["weight"]["sync_dir"]
        return check_config(load_recipe(write_recipe(data, tmp_path / "recipe.yaml")), run_pm)

    assert problems() == []
    assert problems(pause_mode="wait", keep_versions=2, transfer_timeout=30) == []
    assert problems(pause_mode="later") == ["weight.pause_mode: 'later' is not one of abort, wait, keep"]
    assert problems(sync_dri="x")[0].startswith("weight.sync_dri: unknown key; did you mean 'weight.sync_dir'?")
    assert problems(backend="vllm_nccl", nccl_packed=False) == []
    assert problems(backend="vllm_nccl", keep_versions=2)[0].startswith("weight.keep_versions: unknown key")
    assert problems(backend="version_only")[0].startswith("weight.sync_dir: unknown key")


@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_failed_sync_ends_the_run_with_the_phase_named(fake_vllm, run_pm, run_local, tmp_path, fail_at):
    from nexrl_core import NexRLError

    real_load = fake_vllm._load_folder

    def load(path):
        if path.endswith(f"v{fail_at:06d}"):
            raise OSError("disk quota exceeded (simulated)")
        real_load(path)

    fake_vllm._load_folder = load
    start = time.monotonic()
    with pytest.raises(NexRLError) as info:
        run_local(recipe(tmp_path, fake_vllm.url), pm=run_pm)
    message = str(info.value)
    assert f"vLLM weight sync to version {fail_at} failed in phase 'reload_weights'" in message
    assert "HTTP 500" in message and "disk quota exceeded (simulated)" in message
    assert time.monotonic() - start < 60
