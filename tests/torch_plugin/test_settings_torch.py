"""nexrl-torch's components read typed settings built once in their constructors: the train service
(:class:`TrainServiceSettings`), the ``hf`` backend (:class:`HFBackendSettings`, over the engine's
:class:`EngineSettings` and the model's :class:`ModelSettings`) and the in-process weight sync; the
recipe check and the docs read the same declarations; a bad value is refused by key."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from nexrl_core import ConfigError, component_options
from nexrl_torch.models import ModelSettings
from nexrl_torch.rollout.settings import EngineSettings, HFBackendSettings
from nexrl_torch.rollout.weights import HFInferenceBackend, InProcessSyncSettings, InProcessWeightSync
from nexrl_torch.train.lora import LoraSettings
from nexrl_torch.train.service import LocalTorchTrainService
from nexrl_torch.train.settings import TrainServiceSettings


def test_the_declared_keys_are_the_settings_fields():
    # The model's keys come first in both sections; the train service's dtype is its own (no float16).
    assert list(TrainServiceSettings.options())[:len(ModelSettings.options())] == list(ModelSettings.options())
    assert TrainServiceSettings.parse({"dtype": "float16"}, own=True)[1] == [
        "dtype: 'float16' is not one of float32, bfloat16, auto; did you mean 'bfloat16'?"]
    assert ModelSettings.parse({"dtype": "float16"}, own=True) == (ModelSettings(dtype="float16"), [])
    assert set(component_options(LocalTorchTrainService)) == {*TrainServiceSettings.options(), "temperature"}
    assert component_options(LocalTorchTrainService)["temperature"].removed  # a removed key, not a setting
    assert set(component_options(HFInferenceBackend)) == set(HFBackendSettings.options())
    assert set(HFBackendSettings.options()) - set(EngineSettings.options()) == {"replicas", "replica_actors"}
    assert set(component_options(InProcessWeightSync)) == {"background_push", "partial_rollout_prefix"}


def test_the_train_service_reads_its_typed_settings(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    service = LocalTorchTrainService(OmegaConf.create({"lr": 3e-3, "betas": [0.8, 0.95], "micro_batch_size": 2,
                                                       "grad_clip": 0.0, "lora": lora}),
                                     model=_copy(model), tokenizer=tokenizer)
    settings = service.settings
    assert isinstance(settings, TrainServiceSettings) and isinstance(settings.lora, LoraSettings)
    assert (settings.lora.rank, settings.lora.alpha, settings.lora.target_modules) == (4, 8.0, ["q_proj", "v_proj"])
    group = service.optimizer.param_groups[0]
    assert group["lr"] == 3e-3 and group["betas"] == (0.8, 0.95)
    assert service.micro_batch_size == 2 and service.grad_clip is None  # 0: no clipping
    assert service.adapters is not None  # the adapters the settings asked for


@pytest.mark.parametrize("section, message", [
    ({"lr": 0}, r"^lr: expected a positive number, got 0$"),
    ({"betas": [0.9, 1.5]}, r"^betas: expected \[beta1, beta2\], each in \[0, 1\), got \[0.9, 1.5\]$"),
    ({"lora": {"rank": 0}}, r"^lora.rank: "),
    ({"parallel": "tp"}, r"^parallel: 'tp' is not one of auto, fsdp, ddp$"),
])
def test_a_bad_value_is_refused_by_key_before_the_model_loads(section, message, tiny_model_dir):
    # Built directly: a ValueError naming the key (no model_path: the check comes first).
    with pytest.raises(ValueError, match=message):
        LocalTorchTrainService(section)
    # From the recipe: a ConfigError under the section's path.
    with pytest.raises(ConfigError, match=message.replace("^", "^service.train_service.", 1)):
        LocalTorchTrainService.from_config({"model_path": tiny_model_dir, **section}, seed=0, total_steps=1)


def test_the_backend_and_the_weight_sync_read_theirs(tiny_model_dir):
    backend = HFInferenceBackend(OmegaConf.create({"backend": "hf", "model_path": tiny_model_dir, "replicas": 2,
                                                   "max_batch_size": 3, "decode_threads": 1, "device": "cpu"}))
    try:
        assert isinstance(backend.settings, HFBackendSettings) and backend.settings.replicas == 2
        assert len(backend.replicas) == 2 and all(engine.max_batch_size == 3 for engine in backend.replicas)
        assert backend._decode_threads == 1
    finally:
        backend.close()
    with pytest.raises(ConfigError, match=r"^service.inference_service.max_batch_size: expected a positive integer"):
        HFInferenceBackend({"backend": "hf", "model_path": tiny_model_dir, "max_batch_size": 0})
    sync = InProcessWeightSync({"backend": "in_process", "partial_rollout": True,
                                "partial_rollout_prefix": "recompute"})
    assert sync.settings == InProcessSyncSettings(partial_rollout_prefix="recompute") and sync.in_flight is True


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


def test_a_null_grad_clip_trains_without_clipping(tiny_model_dir, tmp_path, capsys):
    """``grad_clip: null`` is accepted (its help promised it) and means what ``0`` means."""
    from tests.grpo_plugin.test_train_service import random_batch, train_step
    from tests.support.weights import same_weights

    def one_step(grad_clip):
        # eps 1: Adam's step then scales with the gradient, so a clip shows in the weights
        service = LocalTorchTrainService({"model_path": tiny_model_dir, "lr": 1e-2, "eps": 1.0, "seed": 3,
                                          "grad_clip": grad_clip})
        metrics = train_step(service, random_batch(0))
        return service, metrics["grad_norm"], service.export_weights(copy=True)

    unclipped_service, norm, unclipped = one_step(None)
    assert unclipped_service.settings.grad_clip is None and unclipped_service.grad_clip is None
    _, zero_norm, zero = one_step(0.0)
    _, clipped_norm, clipped = one_step(norm / 10)
    assert norm == zero_norm == clipped_norm > 0  # the same gradients: only the clip differs
    assert same_weights(unclipped, zero) and not same_weights(unclipped, clipped)

    import yaml

    from nexrl_core.cli import main
    from tests.support.letters import tiny_grpo_recipe

    recipe = tiny_grpo_recipe(tmp_path / "run", tiny_model_dir, group=2, steps=1,
                              service={"train_service": {"grad_clip": None}})
    assert recipe["service"]["train_service"]["grad_clip"] is None
    recipe["rollout_worker"]["evaluator"] = {"type": "exact_match"}  # an installed one: main() loads entry points
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
