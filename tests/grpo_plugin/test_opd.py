"""On-policy distillation (``trainer.type: self_hosted_opd``, issue #46 item 2): the student samples, a
teacher on ``service.reference_service`` scores the student's tokens, and the loss is the per-token
reverse KL as a policy-gradient cost, with PPO clipping of the student's ratio to itself and a
choice of the tokens trained (by position, by KL quantile).

- The loss against a float64 computation on a hand-made batch (value and gradient), its clipping,
  and its expected gradient over the vocabulary against the exact gradient of KL(student || teacher).
- The token selections on hand-made masks, as documented.
- On real tiny models: each option changes the first step's loss as documented, against log-probs
  scored independently; a student trained through the controller moves towards a different
  teacher (the exact reverse KL, summed over the vocabulary at the student's own samples, falls,
  and falls more than the KL to an unrelated model).
- ``nexrl validate`` accepts the recipe and refuses a missing teacher, one that cannot score, and
  options that do nothing, with one line naming the key.
"""

from __future__ import annotations

import copy
import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from nexrl_core import SamplingParams
from nexrl_core.controller import NexRLController
from nexrl_core.launch.parts import build_module
from nexrl_core.launch.recipe import load_recipe
from nexrl_grpo.losses import LossContext
from nexrl_grpo.opd import SelfHostedOpdTrainer, kl_quantile_mask, reverse_kl_loss, token_range_mask
from nexrl_torch.models import load_causal_lm
from nexrl_torch.rollout.engine import HFInferenceEngine
from tests.support.letters import PROMPTS, grpo_plugin_manager, letters_recipe
from tests.support.tiny_lm import build_model, build_tokenizer
from tests.support.torch_fixtures import TINY_RUN_MONITOR

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny model of the student's architecture and tokenizer, other weights (seed 1)."""
    folder = tmp_path_factory.mktemp("tiny_teacher")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


# -- the loss on hand-made tensors --------------------------------------------------------------------

def _batch64():
    """3 rows x 4 tokens: a student that moved since the step's start (ratios off 1), a teacher,
    a mask with a padded tail and an untrained token in the middle."""
    new = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.5, -2.5, -1.0], [-4.0, -0.1, -0.7, -2.2]],
                       dtype=torch.float64)
    old = torch.tensor([[-1.1, -1.6, -0.5, -2.0], [-0.9, -1.5, -2.0, -1.0], [-3.0, -0.3, -0.7, -2.2]],
                       dtype=torch.float64)
    teacher = torch.tensor([[-2.0, -0.5, -3.0, -1.0], [-0.1, -4.0, -1.0, -9.0], [-1.0, -0.2, -2.7, -0.1]],
                           dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.float64)
    return new, old, teacher, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_loss_and_its_gradient_match_a_float64_computation(mode):
    new, old, teacher, mask = _batch64()
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = reverse_kl_loss(log_prob, old, teacher, mask, LossContext(), kl_coef=0.7, loss_agg_mode=mode)
    loss.backward()
    # Direct: L_t = c * (old - teacher) * exp(new - old), reduced by hand.
    k = (old - teacher).numpy()
    ratio = np.exp(new.numpy() - old.numpy())
    per_token = 0.7 * k * ratio
    m = mask.numpy()
    if mode == "token-mean":
        expected, grad = (per_token * m).sum() / m.sum(), per_token * m / m.sum()
    elif mode == "seq-mean-token-mean":
        n = m.sum(-1, keepdims=True)
        expected, grad = ((per_token * m).sum(-1) / n[:, 0]).mean(), per_token * m / n / 3
    else:
        expected, grad = (per_token * m).sum(-1).mean(), per_token * m / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(log_prob.grad.numpy(), grad, rtol=1e-12, atol=1e-15)  # d r / d new = r
    assert metrics["ppo_kl"] == pytest.approx(((old - new).numpy() * m).sum() / m.sum(), rel=1e-12)
    assert metrics["opd_clipfrac"] == 0.0


def test_on_policy_the_loss_is_the_sampled_reverse_kl_and_its_gradient_the_score_function():
    new, _, teacher, mask = _batch64()
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = reverse_kl_loss(log_prob, log_prob.detach(), teacher, mask, LossContext())
    loss.backward()
    k, m = (new - teacher).numpy(), mask.numpy()
    assert loss.item() == pytest.approx((k * m).sum() / m.sum(), rel=1e-12)
    np.testing.assert_allclose(log_prob.grad.numpy(), k * m / m.sum(), rtol=1e-12)
    assert metrics["ppo_kl"] == 0.0


def test_clipping_takes_the_pessimistic_branch_and_stops_its_gradient():
    """With ``clip`` (low 0.1, high 0.2), a token whose ratio left [0.9, 1.2] in the direction that
    would lower its loss keeps the clipped (constant) loss; the others are unclipped."""
    new, old, teacher, mask = _batch64()
    low, high = 0.1, 0.2
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = reverse_kl_loss(log_prob, old, teacher, mask, LossContext(), clip=(low, high))
    loss.backward()
    k = (old - teacher).numpy()
    ratio = np.exp(new.numpy() - old.numpy())
    unclipped, clipped = k * ratio, k * np.clip(ratio, 1 - low, 1 + high)
    per_token = np.maximum(unclipped, clipped)
    m = mask.numpy()
    assert loss.item() == pytest.approx((per_token * m).sum() / m.sum(), rel=1e-12)
    active = clipped > unclipped
    assert (active * m).sum() >= 2  # the batch exercises both branches
    grad = np.where(active, 0.0, unclipped) * m / m.sum()
    np.testing.assert_allclose(log_prob.grad.numpy(), grad, rtol=1e-12, atol=1e-15)
    assert metrics["opd_clipfrac"] == pytest.approx((active * m).sum() / m.sum())
    plain, _ = reverse_kl_loss(new, old, teacher, mask, LossContext())
    assert loss.item() > plain.item()  # never below the unclipped loss


def test_its_expected_gradient_is_the_gradient_of_the_reverse_kl():
    """At one position with student logits ``z``: the loss of each token ``v`` weighted by the
    student's probability of sampling it, summed over the vocabulary, has the gradient of
    ``KL(softmax(z) || teacher)`` (float64, exact). Differentiating ``s - t`` itself would give
    ``sum_v s_v grad log s_v = 0``."""
    torch.manual_seed(0)
    vocab = 11
    z = torch.randn(vocab, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(vocab, dtype=torch.float64) * 2, -1)
    student = torch.log_softmax(z, -1)
    probs = student.exp().detach()
    one = torch.ones(1, 1, dtype=torch.float64)
    expected_loss = sum(probs[v] * reverse_kl_loss(student[v].view(1, 1), student[v].detach().view(1, 1),
                                                   teacher[v].view(1, 1), one, LossContext())[0]
                        for v in range(vocab))
    (estimated,) = torch.autograd.grad(expected_loss, z, retain_graph=True)
    kl = (student.exp() * (student - teacher)).sum()
    (exact,) = torch.autograd.grad(kl, z, retain_graph=True)
    assert kl.item() > 0.1
    torch.testing.assert_close(estimated, exact, rtol=1e-12, atol=1e-14)
    direct = sum(probs[v] * (student[v] - teacher[v]) for v in range(vocab))
    (direct_grad,) = torch.autograd.grad(direct, z)
    torch.testing.assert_close(direct_grad, torch.zeros_like(z), rtol=0, atol=1e-14)


# -- token selection ----------------------------------------------------------------------------------

def test_token_range_keeps_a_fraction_of_each_rows_trained_tokens_by_position():
    mask = np.zeros((4, 12), dtype=np.float32)
    mask[0, :10] = 1  # 10 tokens
    mask[1, [0, 2, 3, 5, 6, 8, 9, 11]] = 1  # 8 trained tokens with untrained ones between
    mask[2, :1] = 1  # a single token
    # row 3: none
    first_half = token_range_mask(mask, 0.0, 0.5)
    assert np.nonzero(first_half[0])[0].tolist() == [0, 1, 2, 3, 4]
    assert np.nonzero(first_half[1])[0].tolist() == [0, 2, 3, 5]
    assert np.nonzero(first_half[2])[0].tolist() == [0]  # floor(0.5) = 0 tokens: the first is kept
    assert not first_half[3].any()
    second_half = token_range_mask(mask, 0.5, 1.0)
    assert np.nonzero(second_half[0])[0].tolist() == [5, 6, 7, 8, 9]
    assert np.nonzero(second_half[1])[0].tolist() == [6, 8, 9, 11]
    assert np.nonzero(second_half[2])[0].tolist() == [0]
    middle = token_range_mask(mask, 0.25, 0.75)
    assert np.nonzero(middle[0])[0].tolist() == [2, 3, 4, 5, 6]  # floor(2.5) .. floor(7.5) - 1
    assert np.nonzero(middle[1])[0].tolist() == [3, 5, 6, 8]
    np.testing.assert_array_equal(token_range_mask(mask, 0.0, 1.0), mask)
    assert np.nonzero(token_range_mask(mask, 0.29, 1.0)[0])[0].tolist() == [2, 3, 4, 5, 6, 7, 8, 9]


def test_kl_quantile_range_keeps_the_tokens_between_two_quantiles_of_the_batch():
    kl = np.array([[0.5, 3.0, -1.0, 9.9], [2.0, 1.0, 4.0, 7.0]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=np.float32)  # 9.9 is padding: not counted
    # The trained values sorted: -1, 0.5, 1, 2, 3, 4, 7; median 2.
    np.testing.assert_array_equal(kl_quantile_mask(kl, mask, 0.0, 0.5), [[1, 0, 1, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(kl_quantile_mask(kl, mask, 0.5, 1.0), [[0, 1, 0, 0], [1, 0, 1, 1]])
    np.testing.assert_array_equal(kl_quantile_mask(kl, mask, 0.0, 1.0), mask)
    assert not kl_quantile_mask(kl, np.zeros_like(mask), 0.0, 0.5).any()


# -- the trainer on real tiny models --------------------------------------------------------------------

@pytest.fixture(scope="module")
def rollouts(tiny_model_dir):
    """The student's samples: 4 prompts twice, at temperatures 1.0 and 0.7 (the teacher scores each
    row at its own)."""
    model, tokenizer = load_causal_lm(tiny_model_dir)
    engine = HFInferenceEngine({"batch_wait_ms": 20}, model=model, tokenizer=tokenizer)
    params = [SamplingParams(max_tokens=8, temperature=t, seed=i) for i, t in enumerate([1.0] * 4 + [0.7] * 4)]
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda ip: engine.complete([{"role": "user", "content": PROMPTS[ip[0] % 4]}],
                                                               ip[1]), enumerate(params)))
    finally:
        engine.close()
    return [{"uid": f"g{i % 4}", "sample_index": i // 4, "prompt_token_ids": r.prompt_token_ids,
             "response_token_ids": r.response_token_ids, "response_logprobs": r.response_logprobs,
             "sampling": p.as_record(), "reward": 0.0, "model_version": 0}
            for i, (r, p) in enumerate(zip(results, params))]


@pytest.fixture(scope="module")
def scored(tiny_model_dir, teacher_dir, rollouts):
    """Per sample, float64: the student's and the teacher's log-probs of its tokens, scored here by
    engines of their own (not the trainer's path)."""
    out = {}
    for name, folder in (("student", tiny_model_dir), ("teacher", teacher_dir)):
        engine = HFInferenceEngine({"model_path": folder, "num_threads": 1})
        try:
            out[name] = [np.asarray(lp, dtype=np.float64) for lp in engine.score(
                [(t["prompt_token_ids"], t["response_token_ids"],
                  SamplingParams(**t["sampling"]).logprob_temperature) for t in rollouts])]
        finally:
            engine.close()
    return out


def opd_trainer(student: str, teacher: str, algorithm: dict) -> SelfHostedOpdTrainer:
    config = OmegaConf.create({
        "seed": 0, "trainer": {"total_train_steps": 3}, "trajectory_pool": {"batch_size": 8}, "rollout_worker": {},
        "algorithm": algorithm,
        "service": {"train_service": {"model_path": student, "lr": 1e-2, "grad_clip": 0, "num_threads": 1},
                    "inference_service": {},
                    "reference_service": {"backend": "hf", "model_path": teacher, "num_threads": 1}}})
    built = build_module(SelfHostedOpdTrainer, config, pm=grpo_plugin_manager())
    built.initialize_workers()
    return built


def first_step(student: str, teacher: str, rollouts: list[Any], algorithm: dict) -> dict[str, float]:
    trainer = opd_trainer(student, teacher, algorithm)
    try:
        return trainer.train(copy.deepcopy(rollouts)).metrics
    finally:
        trainer.close()


def _mean(values: list[np.ndarray]) -> float:
    joined = np.concatenate(values)
    return float(joined.mean())


def test_each_option_changes_the_first_loss_as_documented(tiny_model_dir, teacher_dir, rollouts, scored):
    """The first update of a batch is on-policy: its loss is ``kl_coef`` times the token mean of
    ``student - teacher`` over the tokens the options keep, each checked against log-probs scored
    independently (float64, to the float32 forward's tolerance)."""
    k = [s - t for s, t in zip(scored["student"], scored["teacher"])]
    n_tokens = sum(len(x) for x in k)

    def close(value: float) -> Any:  # the float32 forward against float64
        return pytest.approx(value, rel=1e-4, abs=1e-4)

    plain = first_step(tiny_model_dir, teacher_dir, rollouts, {})
    assert plain["train/opd_reverse_kl"] == close(_mean(k))
    assert plain["train/loss"] == close(_mean(k))
    assert plain["train/opd_teacher_logprob_mean"] == close(_mean(scored["teacher"]))
    assert plain["train/opd_student_logprob_mean"] == close(_mean(scored["student"]))
    assert plain["train/opd_trained_token_share"] == 1.0 and plain["train/ppo_kl"] == 0.0
    assert plain["train/grad_norm"] > 0 and _mean(k) > 0.5  # a teacher far from the student

    doubled = first_step(tiny_model_dir, teacher_dir, rollouts, {"kl_coef": 2.0})
    assert doubled["train/loss"] == pytest.approx(2 * plain["train/loss"], rel=1e-5)
    assert doubled["train/grad_norm"] == pytest.approx(2 * plain["train/grad_norm"], rel=1e-4)

    late = first_step(tiny_model_dir, teacher_dir, rollouts, {"token_range": {"start": 0.5}})
    kept = [x[math.floor(0.5 * len(x)):] for x in k]
    assert late["train/loss"] == close(_mean(kept))
    assert late["train/opd_trained_token_share"] == pytest.approx(sum(len(x) for x in kept) / n_tokens)
    assert late["train/opd_reverse_kl"] == pytest.approx(plain["train/opd_reverse_kl"], rel=1e-6)  # all tokens

    early = first_step(tiny_model_dir, teacher_dir, rollouts, {"token_range": {"end": 0.25}})
    kept = [x[:max(math.floor(0.25 * len(x)), 1)] for x in k]
    assert early["train/loss"] == close(_mean(kept))

    low_kl = first_step(tiny_model_dir, teacher_dir, rollouts, {"kl_quantile_range": {"end": 0.5}})
    flat = np.concatenate(k)
    kept_low = flat[flat <= np.quantile(flat, 0.5)]
    assert low_kl["train/loss"] == close(float(kept_low.mean()))
    assert low_kl["train/opd_trained_token_share"] == pytest.approx(len(kept_low) / n_tokens)
    assert low_kl["train/loss"] < plain["train/loss"]


def test_clipping_bounds_the_second_update(tiny_model_dir, teacher_dir, rollouts):
    """With two updates per batch the second sees the student moved (ratio off 1): clipping it to
    [0.999, 1.001] is active on tokens and its loss is the pessimistic (larger) one; the first
    updates are identical, so the two runs differ only there."""
    tight = {"ppo_epochs": 2, "clip": {"enabled": True, "ratio_low": 1e-3, "ratio_high": 1e-3}}
    clipped = first_step(tiny_model_dir, teacher_dir, rollouts, tight)
    free = first_step(tiny_model_dir, teacher_dir, rollouts, {"ppo_epochs": 2})
    assert free["train/ppo_kl"] != 0.0 and free["train/opd_clipfrac"] == 0.0
    assert clipped["train/ppo_kl"] == pytest.approx(free["train/ppo_kl"], rel=1e-5)  # the same first update
    assert clipped["train/opd_clipfrac"] > 0.2
    assert clipped["train/loss"] > free["train/loss"] + 1e-4
    # Both report the KL of the student as the step found it.
    assert clipped["train/opd_reverse_kl"] == pytest.approx(free["train/opd_reverse_kl"], rel=1e-6)


def test_a_teacher_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from tests.support.tiny_lm import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    build_model(tokenizer, seed=1).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(Exception, match="the teacher's tokenizer is not the student's"):
        opd_trainer(tiny_model_dir, str(tmp_path), {})


# -- a student moves towards its teacher ----------------------------------------------------------------

def exact_reverse_kl(student: torch.nn.Module, teacher: torch.nn.Module, tokenizer, samples: int = 16,
                     max_tokens: int = 6) -> float:
    """Mean over positions of ``KL(student || teacher)`` summed over the whole vocabulary (float64),
    at the contexts of the student's own samples (temperature 1, a fixed generator) of the
    training prompts, encoded as the engine encodes them."""
    generator = torch.Generator().manual_seed(0)
    total, count = 0.0, 0
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        prompt_ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
        for _ in range(samples):
            seq = prompt_ids
            for _ in range(max_tokens):
                with torch.no_grad():
                    s = torch.log_softmax(student(seq).logits[0, -1].double(), -1)
                    t = torch.log_softmax(teacher(seq).logits[0, -1].double(), -1)
                total += float((s.exp() * (s - t)).sum())
                count += 1
                token = torch.multinomial(s.exp(), 1, generator=generator)
                seq = torch.cat([seq, token.view(1, 1)], 1)
                if int(token) == tokenizer.eos_token_id:
                    break
    return total / count


def test_a_student_trained_on_its_own_samples_moves_towards_the_teacher(tiny_model_dir, teacher_dir, tmp_path):
    steps = 40
    data = letters_recipe(
        tmp_path / "run", group=8, workers=8,
        trainer={"type": "self_hosted_opd", "total_train_steps": steps},
        weight={"sync_mode": "sync", "backend": "in_process"},
        service={"train_service": {"model_path": tiny_model_dir, "lr": 2e-2, "grad_clip": 1.0, "num_threads": 1},
                 "inference_service": {"backend": "hf", "model_path": tiny_model_dir, "num_threads": 1},
                 "reference_service": {"backend": "hf", "model_path": teacher_dir, "num_threads": 1}},
        runtime_monitor=TINY_RUN_MONITOR)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    student, tokenizer = load_causal_lm(tiny_model_dir)
    teacher, _ = load_causal_lm(teacher_dir)
    unrelated = build_model(tokenizer, seed=77)  # a control: a model the student never sees
    before = exact_reverse_kl(student, teacher, tokenizer)
    before_unrelated = exact_reverse_kl(student, unrelated, tokenizer)

    controller = NexRLController(load_recipe(str(path)), plugin_manager=grpo_plugin_manager())
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.errors == [], summary
    trained = controller.trainer.train_service.model
    after = exact_reverse_kl(trained, teacher, tokenizer)
    after_unrelated = exact_reverse_kl(trained, unrelated, tokenizer)
    print(f"exact reverse KL to the teacher {before:.4f} -> {after:.4f}; to an unrelated model "
          f"{before_unrelated:.4f} -> {after_unrelated:.4f}")

    assert before > 1.0
    assert after < 0.7 * before, (before, after)
    # Towards this teacher, not only flatter: the KL to a model it never saw falls by a smaller share.
    assert after / before < after_unrelated / before_unrelated - 0.05, (before, after, before_unrelated,
                                                                        after_unrelated)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "train/opd_reverse_kl" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["train/grad_norm"] > 1e-3 for r in rows)  # every step had a gradient
    sampled = [r["train/opd_reverse_kl"] for r in rows]
    print(f"train/opd_reverse_kl, mean of steps 1-8 {np.mean(sampled[:8]):.4f}, of steps 33-40 {np.mean(sampled[-8:]):.4f}")
    assert np.mean(sampled[-8:]) < 0.8 * np.mean(sampled[:8]), sampled
    assert controller.trainer.teacher.model_version() == 0  # the teacher never received weights


# -- nexrl validate ----------------------------------------------------------------------------------

def validate_recipe(run_dir, student: str, teacher: dict | None, algorithm: dict | None = None) -> dict:
    service = {"train_service": {"model_path": student, "lr": 1e-2, "num_threads": 1},
               "inference_service": {"backend": "hf", "model_path": student, "num_threads": 1}}
    if teacher is not None:
        service["reference_service"] = teacher
    return letters_recipe(run_dir, group=2, trainer={"type": "self_hosted_opd", "total_train_steps": 2},
                          weight={"sync_mode": "sync", "backend": "in_process"}, service=service,
                          algorithm=algorithm or {})


REFUSALS: dict[str, tuple[Any, dict, str]] = {
    "no_teacher": (None, {}, "error: service.reference_service: trainer 'self_hosted_opd' distils from a teacher"),
    "a_teacher_that_cannot_score": (
        {"backend": "mock"}, {},
        "error: service.reference_service.backend: inference backend 'mock' cannot score given tokens"),
    "an_empty_token_range": (
        "hf", {"token_range": {"start": 0.5, "end": 0.5}},
        "error: algorithm.token_range: start (0.5) must be below end (0.5)"),
    "an_empty_kl_quantile_range": (
        "hf", {"kl_quantile_range": {"start": 0.9, "end": 0.2}},
        "error: algorithm.kl_quantile_range: start (0.9) must be below end (0.2)"),
    "clipping_one_update": (
        "hf", {"clip": {"enabled": True}},
        "error: algorithm.clip: does nothing without algorithm.ppo_epochs > 1"),
    "a_clip_range_without_clipping": (
        "hf", {"ppo_epochs": 2, "clip": {"ratio_high": 0.3}},
        "error: algorithm.clip.ratio_high: does nothing without algorithm.clip.enabled: true"),
    "a_grpo_key": (
        "hf", {"use_kl_loss": True}, "error: algorithm.use_kl_loss: unknown key"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_validate_refuses_with_one_line_naming_the_key(name, cli, tiny_model_dir, teacher_dir, tmp_path):
    teacher, algorithm, expected = REFUSALS[name]
    if teacher == "hf":
        teacher = {"backend": "hf", "model_path": teacher_dir}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(validate_recipe(tmp_path / "run", tiny_model_dir, teacher, algorithm)))
    code, _, errors, err = cli("validate", str(path))
    assert code == 2, err
    assert len(errors) == 1 and errors[0].startswith(expected), errors
    assert "Traceback" not in err


def test_the_recipe_with_a_teacher_and_every_option_validates(cli, tiny_model_dir, teacher_dir, tmp_path):
    algorithm = {"kl_coef": 0.5, "ppo_epochs": 2, "loss_agg_mode": "seq-mean-token-sum-norm",
                 "max_response_length": 8, "clip": {"enabled": True, "ratio_low": 0.1, "ratio_high": 0.3},
                 "token_range": {"start": 0.1, "end": 0.9}, "kl_quantile_range": {"start": 0.05, "end": 0.95}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(validate_recipe(tmp_path / "run", tiny_model_dir,
                                                   {"backend": "hf", "model_path": teacher_dir}, algorithm)))
    code, _, errors, err = cli("validate", str(path))
    assert code == 0 and not errors, err
