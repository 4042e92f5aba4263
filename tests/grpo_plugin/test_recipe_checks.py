"""nexrl-grpo's declared options and capabilities, through `nexrl validate` and `nexrl run`:
each bad recipe gets the same one-line message from both, exit 2, before any model is loaded.

The trainer, inference backend and weight-sync backend declare what they provide and need
(nexrl_core.Capabilities); a combination that cannot move the trained weights to the service
that samples is refused (a self-hosted trainer with `version_only` trained against a server
that never received its weights, while staleness read 0).
"""

from __future__ import annotations

import pytest
import torch
import yaml


@pytest.fixture
def recipe(tmp_path, tiny_model_dir):
    data = {
        "data": {"type": "inline", "rows": [{"prompt": "the quick"}, {"prompt": "hello world"}]},
        "rollout_worker": {"num_workers": 2, "sampling": {"max_tokens": 4},
                           "evaluator": {"type": "letter_share", "letter": "e"}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": 1},
        "weight": {"backend": "in_process"},
        "service": {"train_service": {"model_path": tiny_model_dir, "lr": 1.0e-3},
                    "inference_service": {"backend": "hf", "model_path": tiny_model_dir}},
        "logger": {"backend": [], "level": "WARNING"},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


OPENAI = "service.inference_service={backend: openai, url: 'http://127.0.0.1:9/v1'}"
CASES = {
    "self_hosted_with_version_only": (
        ["weight.backend=version_only"],
        "error: trainer.type: trainer 'self_hosted_grpo' needs 'weight_sync:state_dict' (it trains new weights in "
        "this process, and without a backend that moves them, rollouts keep sampling the initial model), which "
        "neither inference backend 'hf', weight-sync backend 'version_only' provides; it is provided by "
        "weight.backend: in_process (nexrl-torch)"),
    "self_hosted_openai_version_only": (
        [OPENAI, "weight.backend=version_only"],
        "error: trainer.type: trainer 'self_hosted_grpo' needs 'weight_sync:state_dict'"),
    "in_process_into_an_external_server": (
        [OPENAI],
        "error: weight.backend: weight-sync backend 'in_process' needs 'inference:load_weights' (it loads them into "
        "an inference engine in this process), which neither trainer 'self_hosted_grpo', inference backend "
        "'openai' provides; it is provided by service.inference_service.backend: hf (nexrl-torch)"),
    "nan_learning_rate": (["service.train_service.lr=nan"],
                          "error: service.train_service.lr: expected a finite number, got nan"),
    "inf_learning_rate": (["service.train_service.lr=inf"],
                          "error: service.train_service.lr: expected a finite number, got inf"),
    "zero_learning_rate": (["service.train_service.lr=0"],
                           "error: service.train_service.lr: expected a positive number, got 0"),
    "text_learning_rate": (["service.train_service.lr='1e-5'"],
                           "error: service.train_service.lr: expected a number, got a string ('1e-5'); YAML reads "
                           "a number like 1e-5 as text: write 1.0e-5"),
    "missing_model_path": (["service.train_service.model_path=/no/such/model"],
                           "error: service.train_service.model_path: '/no/such/model' is not a model folder "
                           "(no config.json)"),
    "no_model_path": (["~service.train_service.model_path"],
                      "error: service.train_service.model_path: required (an HF model folder"),
    "inference_model_path": (["service.inference_service.model_path=/no/such/model"],
                             "error: service.inference_service.model_path: '/no/such/model' is not a model folder"),
    "unknown_train_service": (["+service.train_service.backend=tinker"],  # nexrl-tinker not loaded here
                              "error: service.train_service.backend: unknown train service 'tinker'. Available: "
                              "'local_torch' (nexrl-torch)"),
    "bad_packing": (["+service.train_service.packing=maybe"],
                    "error: service.train_service.packing: 'maybe' is not one of auto, true, false"),
    "bad_betas": (["+service.train_service.betas=[0.9,1.5]"],
                  "error: service.train_service.betas: expected [beta1, beta2], each in [0, 1), got [0.9, 1.5]"),
    "engine_typo": (["+service.inference_service.max_batch=8"],
                    "error: service.inference_service.max_batch: unknown key; did you mean "
                    "'service.inference_service.max_batch_size'?"),
    "device_name": (["+service.train_service.device=gpu"],
                    "error: service.train_service.device: 'gpu' is not one of auto, cpu, cuda, cuda:N"),
    "kv_share": (["+service.inference_service.gpu_memory_utilization=1.5"],
                 "error: service.inference_service.gpu_memory_utilization:"),
}
# keys that act only with another (issue #29 item 4): one line naming the key each needs
CASES.update({
    "kl_loss_coef_without_the_kl_loss": (
        ["+algorithm.kl_loss_coef=0.1"],
        "error: algorithm.kl_loss_coef: does nothing without algorithm.use_kl_loss: true (set that, or delete "
        "algorithm.kl_loss_coef)"),
    "kl_loss_type_without_the_kl_loss": (
        ["+algorithm.kl_loss_type=k3"], "error: algorithm.kl_loss_type: does nothing without algorithm.use_kl_loss: true"),
    "kl_controller_without_kl_in_the_reward": (
        ["+algorithm.kl_ctrl={kl_coef: 0.1}"],
        "error: algorithm.kl_ctrl: does nothing without algorithm.use_kl_in_reward: true"),
    "kl_penalty_without_kl_in_the_reward": (
        ["+algorithm.kl_penalty=abs"], "error: algorithm.kl_penalty: does nothing without algorithm.use_kl_in_reward: true"),
    "adaptive_keys_of_a_fixed_controller": (
        ["+algorithm.use_kl_in_reward=true", "+algorithm.kl_ctrl={target_kl: 0.2}"],
        "error: algorithm.kl_ctrl.target_kl: does nothing without algorithm.kl_ctrl.type: adaptive"),
    "reference_device_without_any_kl": (
        ["+algorithm.ref_device=cpu"],
        "error: algorithm.ref_device: does nothing without algorithm.use_kl_in_reward: true or algorithm.use_kl_loss: "
        "true"),
    "correction_cap_without_the_correction": (
        ["+algorithm.rollout_correction={cap: 3.0}"],
        "error: algorithm.rollout_correction.cap: does nothing without algorithm.rollout_correction.enabled: true"),
    "normalisation_keys_without_normalising": (
        ["+algorithm.reward_processing={norm_std: false}"],
        "error: algorithm.reward_processing.norm_std: does nothing without algorithm.reward_processing.norm other "
        "than none or algorithm.reward_processing.domains: true"),
    "behaviour_cap_without_the_decoupled_objective": (
        ["+algorithm.behav_imp_weight_cap=3.0"],
        "error: algorithm.behav_imp_weight_cap: does nothing without algorithm.objective: decoupled"),
    "unknown_objective": (["+algorithm.objective=async"],
                          "error: algorithm.objective: 'async' is not one of standard, decoupled"),
    # the decoupled objective's behaviour weight is the correction's ratio: both would apply it twice
    "decoupled_with_the_rollout_correction": (
        ["+algorithm.objective=decoupled", "+algorithm.rollout_correction={enabled: true}"],
        "error: algorithm.rollout_correction.enabled: algorithm.objective: decoupled already weights each token "
        "by min(pi_prox / pi_behav, behav_imp_weight_cap), the same ratio; turn the correction off"),
    "decoupled_without_the_samplers_logprobs": (
        [OPENAI, "weight.backend=version_only", "+service.inference_service.request_logprobs=false",
         "+algorithm.objective=decoupled"],
        "error: service.inference_service.request_logprobs: false, but algorithm.objective: decoupled weights each "
        "token by the sampler's log-prob of it"),
    "overlong_reward_without_overlong_score": (
        ["+algorithm.reward_processing={overlong_reward: -1.0}"],
        "error: algorithm.reward_processing.overlong_reward: does nothing without "
        "algorithm.reward_processing.overlong: score"),
})


@pytest.mark.parametrize("overrides", [
    ["+algorithm.use_kl_loss=true", "+algorithm.kl_loss_coef=0.1", "+algorithm.kl_loss_type=k3",
     "+algorithm.ref_device=cpu"],
    ["+algorithm.use_kl_in_reward=true", "+algorithm.kl_ctrl={type: adaptive, target_kl: 0.2}"],
    ["+algorithm.rollout_correction={enabled: true, cap: 3.0}"],
    ["+algorithm.objective=decoupled", "+algorithm.behav_imp_weight_cap=3.0"],
    ["+algorithm.reward_processing={norm: group, norm_std: false, overlong: score, overlong_reward: -1.0}"],
])
def test_those_keys_with_the_key_they_need_validate(cli, recipe, tmp_path, overrides):
    code, _, errors, err = cli("validate", recipe, f"run_dir={tmp_path / 'run'}", *overrides)
    assert code == 0 and not errors, err


if not torch.cuda.is_available():  # what a recipe written for a GPU box gets on a machine without one
    CASES.update({
        "cuda_without_cuda": (["+service.train_service.device=cuda"],
                              "error: service.train_service.device: 'cuda' asked for, but no CUDA device is visible"),
        "engine_cuda_without_cuda": (["+service.inference_service.device=cuda:1"],
                                     "error: service.inference_service.device: 'cuda:1' asked for, but no CUDA "
                                     "device is visible"),
        "kl_reference_on_cuda": (["+algorithm.use_kl_loss=true", "+algorithm.ref_device=cuda"],
                                 "error: algorithm.ref_device: 'cuda' asked for, but no CUDA device is visible"),
    })


def test_the_base_recipe_validates(cli, recipe, tmp_path):
    code, out, errors, err = cli("validate", recipe, f"run_dir={tmp_path / 'run'}")
    assert code == 0 and not errors, err


@pytest.mark.parametrize("name", sorted(CASES))
def test_validate_and_run_refuse_with_the_same_line(name, cli, recipe, tmp_path):
    overrides, expected = CASES[name]
    results = {command: cli(command, recipe, f"run_dir={tmp_path / 'run'}", *overrides)
               for command in ("validate", "run")}
    for command, (code, _out, errors, err) in results.items():
        assert code == 2, f"{command}: {err}"
        assert any(line.startswith(expected) for line in errors), f"{command}: {expected!r} not in {errors}"
        assert "Traceback" not in err
    assert results["run"][2] == results["validate"][2]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
