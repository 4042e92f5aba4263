"""The KL reference on an inference service of its own (``service.reference_service``, issue #30
item 5): it scores the rollouts' tokens (no generation), never receives weights, and gives the
same KL as the frozen copy the trainer holds otherwise; bad combinations get one line from
``nexrl validate`` and ``nexrl run`` alike."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from nexrl_core import SamplingParams
from nexrl_core.controller import NexRLController
from nexrl_core.launch.parts import build_module
from nexrl_core.launch.recipe import load_recipe
from nexrl_grpo.trainers import SelfHostedGrpoTrainer
from nexrl_torch.models import load_causal_lm
from nexrl_torch.rollout.engine import HFInferenceEngine
from tests.support.letters import grpo_plugin_manager

KL = {"use_kl_loss": True, "kl_loss_coef": 0.5, "kl_loss_type": "low_var_kl", "use_kl_in_reward": True,
      "kl_ctrl": {"kl_coef": 0.1}}
KL_METRICS = ("train/kl_loss", "train/kl_penalty", "train/loss")


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    """Rollouts of prompts of different lengths at different temperatures (the reference must
    score each row at its own, with the trainer's padding dropped)."""
    model, tokenizer = load_causal_lm(tiny_model_dir)
    engine = HFInferenceEngine({"batch_wait_ms": 20}, model=model, tokenizer=tokenizer)
    prompts = ["count: one, two", "hello", "the quick brown fox jumps", "what is"]
    params = [SamplingParams(max_tokens=6, temperature=t, seed=i) for i, t in enumerate([0.7, 1.0, 0.0, 1.3] * 2)]
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda ip: engine.complete(prompts[ip[0] % 4], ip[1]), enumerate(params)))
    finally:
        engine.close()
    return [{"uid": f"g{i % 4}", "sample_index": i // 4, "prompt_token_ids": r.prompt_token_ids,
             "response_token_ids": r.response_token_ids, "response_logprobs": r.response_logprobs,
             "sampling": p.as_record(), "reward": float((i * 7) % 3), "model_version": 0}
            for i, (r, p) in enumerate(zip(results, params))]


def trainer(model_dir: str, reference: dict | None) -> SelfHostedGrpoTrainer:
    service = {"train_service": {"model_path": model_dir, "lr": 5e-2, "grad_clip": 0, "num_threads": 1},
               "inference_service": {}}
    if reference is not None:
        service["reference_service"] = reference
    config = OmegaConf.create({"seed": 0, "trainer": {"total_train_steps": 2}, "trajectory_pool": {"batch_size": 8},
                               "rollout_worker": {}, "algorithm": KL, "service": service})
    built = build_module(SelfHostedGrpoTrainer, config, pm=grpo_plugin_manager())
    built.initialize_workers()
    return built


def test_the_served_reference_equals_the_one_in_process_over_two_steps(tiny_model_dir, batch):
    held = trainer(tiny_model_dir, None)
    served = trainer(tiny_model_dir, {"backend": "hf", "model_path": tiny_model_dir, "max_batch_size": 3})
    try:
        assert held.reference_service is None and held._ref_model is not None
        assert isinstance(served.reference_service, HFInferenceEngine) and served._ref_model is None
        before = {k: v.clone() for k, v in served.reference_service.model.state_dict().items()}
        policy_before = {k: v.clone() for k, v in served.train_service.model.state_dict().items()}
        for step in range(2):
            a, b = held.train(batch).metrics, served.train(batch).metrics
            for name in KL_METRICS:
                assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), (step, name)
        # Step 2 compares a policy that moved against its reference: the KL is no longer zero.
        assert a["train/kl_loss"] > 1e-4 and abs(a["train/kl_penalty"]) > 1e-5, a
        after = served.reference_service.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        moved = served.train_service.model.state_dict()
        assert any(not torch.equal(policy_before[k], moved[k]) for k in policy_before)
    finally:
        held.close()
        served.close()
    assert not served.reference_service.health_check()  # closed with the trainer


def test_score_gives_the_rollouts_own_log_probs(tiny_model_dir, batch):
    """The reference is the initial model: it scores the initial model's rollouts with the log-probs
    they were sampled with (at each row's temperature, 1 for greedy rows)."""
    engine = HFInferenceEngine({"model_path": tiny_model_dir, "max_batch_size": 5})
    try:
        scored = engine.score([(t["prompt_token_ids"], t["response_token_ids"],
                                SamplingParams(**t["sampling"]).logprob_temperature) for t in batch])
    finally:
        engine.close()
    for t, lp in zip(batch, scored):
        assert lp == pytest.approx(t["response_logprobs"], abs=1e-4)


def recipe_data(run_dir, model_dir: str, reference: bool) -> dict:
    data = {
        "run_dir": str(run_dir), "seed": 3,
        "data": {"type": "inline", "rows": [{"prompt": "the quick"}, {"prompt": "hello world"}]},
        "rollout_worker": {"num_workers": 2, "sampling": {"max_tokens": 4},
                           "evaluator": {"type": "letter_share", "letter": "e"}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": 2},
        "algorithm": {"use_kl_loss": True, "kl_loss_coef": 0.5},
        "weight": {"backend": "in_process"},
        "service": {"train_service": {"model_path": model_dir, "lr": 5e-2, "num_threads": 1},
                    "inference_service": {"backend": "hf", "model_path": model_dir, "num_threads": 1}},
        "logger": {"backend": [], "level": "WARNING"},
    }
    if reference:
        data["service"]["reference_service"] = {"backend": "hf", "model_path": model_dir, "num_threads": 1}
    return data


def run(root, model_dir: str, reference: bool, launch_mode: str = "local") -> tuple[list[dict], object]:
    run_dir = root / f"{launch_mode}_{'served' if reference else 'held'}"
    data = {**recipe_data(run_dir, model_dir, reference), "launch_mode": launch_mode}
    path = run_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(data))
    controller = NexRLController(load_recipe(str(path)), plugin_manager=grpo_plugin_manager())
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.errors == [], summary
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "train/kl_loss" in r], controller


def test_runs_with_the_served_reference_match_the_held_one_local_and_ray(tiny_model_dir, tmp_path, ray_cluster,
                                                                          monkeypatch):
    """The same recipe three ways: the trainer holds the reference (local), the reference is a
    service (local: the client object is inspected), and a service in the trainer's Ray actor."""
    held, _ = run(tmp_path, tiny_model_dir, False)
    served, controller = run(tmp_path, tiny_model_dir, True)
    module = controller.trainer
    assert isinstance(module.reference_service, HFInferenceEngine) and module._ref_model is None
    assert module.reference_service.model_version() == 0  # never given weights
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-grpo,nexrl-torch")  # the actors load nexrl-grpo (+ the in-process evaluator)
    in_ray, _ = run(tmp_path, tiny_model_dir, True, "ray")
    assert [r["step"] for r in held] == [r["step"] for r in served] == [r["step"] for r in in_ray] == [1, 2]
    assert held[-1]["train/kl_loss"] > 0  # the policy moved away from its reference
    for other in (served, in_ray):
        for a, b in zip(held, other):
            for name in ("train/kl_loss", "train/loss", "train/reward_mean"):
                assert b[name] == pytest.approx(a[name], rel=1e-3, abs=1e-6), (a["step"], name)


CASES = {
    "without_a_kl_term": (
        {"algorithm": {}},
        "error: service.reference_service: does nothing without algorithm.use_kl_in_reward: true or "
        "algorithm.use_kl_loss: true (set that, or delete service.reference_service)"),
    "a_backend_that_cannot_score": (
        {"reference": {"backend": "mock"}},
        "error: service.reference_service.backend: inference backend 'mock' cannot score given tokens "
        "(InferenceClient.score), which a KL reference needs; choose one that can (hf)"),
    "ref_device_with_a_service": (
        {"algorithm": {"use_kl_loss": True, "ref_device": "cpu"}},
        "error: algorithm.ref_device: does nothing without service.reference_service: null (set that, or delete "
        "algorithm.ref_device)"),
    "a_typo_in_its_keys": (
        {"reference": {"backend": "hf", "max_batch": 4}},
        "error: service.reference_service.max_batch: unknown key; did you mean "
        "'service.reference_service.max_batch_size'?"),
    "a_missing_model": (
        {"reference": {"backend": "hf", "model_path": "/no/such/model"}},
        "error: service.reference_service.model_path: '/no/such/model' is not a model folder"),
    "a_trainer_without_kl": (
        {"algorithm": {}, "trainer": "self_hosted_cross_entropy"},
        "error: service.reference_service: trainer 'self_hosted_cross_entropy' computes no KL reference, so the "
        "service would do nothing (delete service.reference_service)"),
    "an_unknown_backend": (
        {"reference": {"backend": "nope"}},
        "error: service.reference_service.backend: unknown inference backend 'nope'"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_validate_and_run_refuse_with_the_same_line(name, cli, tiny_model_dir, tmp_path):
    change, expected = CASES[name]
    data = recipe_data(tmp_path / "run", tiny_model_dir, True)
    if "algorithm" in change:
        data["algorithm"] = change["algorithm"]
    if "trainer" in change:
        data["trainer"]["type"] = change["trainer"]
    if "reference" in change:
        reference = dict(change["reference"])
        if reference["backend"] == "hf":
            reference.setdefault("model_path", tiny_model_dir)
        data["service"]["reference_service"] = reference
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    results = {command: cli(command, str(path)) for command in ("validate", "run")}
    for command, (code, _, errors, err) in results.items():
        assert code == 2, f"{command}: {err}"
        assert any(line.startswith(expected) for line in errors), f"{command}: {expected!r} not in {errors}"
        assert "Traceback" not in err
    assert results["run"][2] == results["validate"][2]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("algorithm", [{"use_kl_loss": True}, {"use_kl_in_reward": True},
                                       {"type": "reinforce_plus_plus"}])  # KL in its reward by default
def test_the_recipe_with_a_reference_service_validates(cli, tiny_model_dir, tmp_path, algorithm):
    data = recipe_data(tmp_path / "run", tiny_model_dir, True)
    data["algorithm"] = algorithm
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    code, _, errors, err = cli("validate", str(path))
    assert code == 0 and not errors, err
