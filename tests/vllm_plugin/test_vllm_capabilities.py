"""`vllm` inference fits only a weight sync that drives vLLM's weight-update routes: with a
self-hosted trainer, `nexrl validate` refuses `version_only` (the server would never receive the
trained weights) and `in_process` (it loads into an in-process engine), naming the backends that
fit. Checked from the declared capabilities, no server needed."""

from __future__ import annotations

import pytest

from nexrl_core.launch.recipe import check_config, load_recipe
from nexrl_core.plugins import PluginManager
from nexrl_core.testing import make_recipe, write_recipe


@pytest.fixture
def pm(monkeypatch):
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-grpo,nexrl-torch,nexrl-vllm")
    manager = PluginManager()
    assert {"nexrl-grpo", "nexrl-vllm"} <= {r.distribution for r in manager.records.values()}, manager.failures
    return manager


def problems(tmp_path, pm, weight: dict) -> list[str]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")  # a model folder as far as the checks go (nothing is loaded)
    recipe = make_recipe(None, data={"type": "inline", "rows": [{"prompt": "a"}]},
                         trajectory_pool={"batch_size": 2, "group_size": 2}, trainer={"type": "self_hosted_grpo"},
                         weight=weight, service={"train_service": {"model_path": str(model)},
                                                 "inference_service": {"backend": "vllm", "url": "http://127.0.0.1:9"}})
    return check_config(load_recipe(write_recipe(recipe, tmp_path / "recipe.yaml")), pm)


def test_vllm_with_a_self_hosted_trainer_needs_a_vllm_weight_sync(tmp_path, pm):
    assert problems(tmp_path, pm, {"backend": "vllm_disk", "sync_dir": str(tmp_path / "sync")}) == []
    assert problems(tmp_path, pm, {"backend": "vllm_nccl"}) == []
    [line] = problems(tmp_path, pm, {"backend": "version_only"})
    assert line.startswith("trainer.type: trainer 'self_hosted_grpo' needs 'weight_sync:state_dict'")
    assert line.endswith("it is provided by weight.backend: in_process (nexrl-torch), weight.backend: vllm_disk "
                         "(nexrl-vllm), weight.backend: vllm_lora (nexrl-vllm), weight.backend: vllm_nccl (nexrl-vllm)")
    [line] = problems(tmp_path, pm, {"backend": "in_process"})
    assert line == ("weight.backend: weight-sync backend 'in_process' needs 'inference:load_weights' (it loads them "
                    "into an inference engine in this process), which neither trainer 'self_hosted_grpo', inference "
                    "backend 'vllm' provides; it is provided by service.inference_service.backend: hf (nexrl-torch)")


def test_partial_rollout_is_declared_by_the_vllm_backends(tmp_path, pm):
    """`weight.partial_rollout` needs in-flight updates from the inference backend and the weight sync:
    vLLM's client and its three weight syncs declare them (a cut request goes on from its tokens)."""
    partial = {"partial_rollout": True, "sync_mode": "fully-async", "staleness_threshold": 1}
    sync_dir = str(tmp_path / "sync")
    for weight in ({"backend": "vllm_disk", "sync_dir": sync_dir}, {"backend": "vllm_lora", "sync_dir": sync_dir},
                   {"backend": "vllm_nccl"}):
        assert problems(tmp_path, pm, {**weight, **partial}) == [], weight
    [line] = problems(tmp_path, pm, {"backend": "vllm_disk", "pause_mode": "keep", **partial})
    assert line.startswith("weight.pause_mode: 'keep' with weight.partial_rollout: true")
