"""The self-hosted trainers honour a trajectory's per-token ``loss_mask`` and its ``segments``.

An agent rollout is one token sequence holding the model's replies and, between them, tool
outputs and chat-template glue that the model saw but did not write: those tokens carry
``loss_mask`` 0 and must get no gradient. Checked against independent computations on the tiny
Llama: the trainer's gradient equals that of the policy-gradient loss written out by hand over
the trained tokens only; a trajectory of several sequences is one sample of its GRPO group; the
metrics count trained tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from nexrl_core import DataError
from nexrl_core.launch.parts import build_module
from nexrl_grpo.trainers import SelfHostedCrossEntropyTrainer, SelfHostedGrpoTrainer, TrajectoryView

PROMPT = [5, 17, 40, 9]
TEMPERATURE = 0.8


def make_trainer(model_dir: str, cls=SelfHostedGrpoTrainer, packing=False, **algorithm):
    config = OmegaConf.create({
        "seed": 0, "trainer": {"total_train_steps": 1}, "trajectory_pool": {"batch_size": 4},
        "rollout_worker": {}, "algorithm": algorithm,
        "service": {"train_service": {"model_path": model_dir, "lr": 1e-3, "grad_clip": 0, "num_threads": 1,
                                      "packing": packing},
                    "inference_service": {}},
    })
    trainer = build_module(cls, config)
    trainer.initialize_workers()
    return trainer


def trajectory(uid, response, reward, loss_mask=None, **extra):
    traj = {"uid": uid, "sample_index": 0, "prompt_token_ids": PROMPT, "response_token_ids": response,
            "reward": reward, "sampling": {"temperature": TEMPERATURE, "max_tokens": 16}, **extra}
    if loss_mask is not None:
        traj["loss_mask"] = loss_mask
    return traj


def grads_of(trainer, trajectories):
    """The gradient one training step applies (taken before the optimizer step)."""
    batch = trainer._process_trajectories(trajectories)
    batch, _ = trainer._prepare_batch(batch)
    tensors = {k: v for k, v in batch.values.items() if isinstance(v, torch.Tensor)}
    trainer.train_service.optimizer.zero_grad(set_to_none=True)
    trainer.train_service.forward_backward(tensors, trainer._loss_fn(batch))
    out = {n: p.grad.detach().clone() for n, p in trainer.train_service.model.named_parameters() if p.grad is not None}
    trainer.train_service.optimizer.zero_grad(set_to_none=True)
    return batch, out


def reference_grads(model, rows, temperature=TEMPERATURE):
    """d/dθ of sum_rows weight_row * sum_{t trained} log p(token_t) at ``temperature``, written out
    with a plain forward of each unpadded sequence (the on-policy PPO surrogate's gradient)."""
    model = copy.deepcopy(model).train()
    total = 0.0
    for prompt, response, mask, weight in rows:
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / temperature
        logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        total = total + weight * (logp * torch.tensor(mask, dtype=logp.dtype)).sum()
    total.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(a, b):
    assert a.keys() == b.keys()
    for name in a:
        # float32 sums in another order (packed vs one sequence at a time): an entry where large
        # terms cancel keeps an error of the terms' size, so atol follows the tensor's scale.
        atol = max(1e-6, 1e-5 * float(b[name].abs().max()))
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol, msg=name)


@pytest.fixture(scope="module")
def grpo(tiny_model_dir):
    return make_trainer(tiny_model_dir)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_masked_tokens_get_no_gradient(tiny_model_dir, packing):
    """seq-mean-token-mean on two rows with advantages +a / -a: the loss's gradient is
    -(1/2) sum_rows A_row / |trained_row| * sum_{t trained} grad log p_t; tool tokens (mask 0)
    appear in the input only."""
    agent_mask = [1, 1, 0, 0, 0, 1, 1]
    agent = trajectory("g", [60, 61, 62, 63, 64, 65, 66], 1.0, agent_mask)
    plain = trajectory("g", [70, 71, 72, 73, 74], 0.0)
    grpo = make_trainer(tiny_model_dir, packing=packing)
    batch, got = grads_of(grpo, [agent, plain])
    adv = batch.values["advantages"]
    a = float(adv[0, 0])
    assert a > 0 and torch.allclose(adv[0, :7], torch.tensor(agent_mask, dtype=adv.dtype) * a)
    assert torch.allclose(adv[1, :5], torch.full((5,), -a))
    want = reference_grads(grpo.train_service.model, [
        (PROMPT, agent["response_token_ids"], agent_mask, -a / 2 / sum(agent_mask)),
        (PROMPT, plain["response_token_ids"], [1] * 5, a / 2 / 5)])
    assert_close(got, want)
    # the same rollout without its mask trains on the tool tokens too: a different gradient
    _, unmasked = grads_of(grpo, [{**agent, "loss_mask": [1] * 7}, plain])
    assert not torch.allclose(unmasked["model.embed_tokens.weight"], got["model.embed_tokens.weight"])


def test_a_trajectory_of_several_sequences_is_one_sample_of_its_group(grpo):
    """Segments are rows of the batch, but rewards and advantages are the trajectory's: GRPO's
    group here has three samples (rewards 1, 0, 0), not four rows."""
    first = {"prompt_token_ids": PROMPT, "response_token_ids": [60, 61, 62], "response_logprobs": None,
             "loss_mask": [1, 1, 1]}
    second = {"prompt_token_ids": [30, 31], "response_token_ids": [63, 64, 65, 66], "response_logprobs": None,
              "loss_mask": [1, 0, 0, 1]}
    split = trajectory("g", first["response_token_ids"], 1.0, first["loss_mask"], segments=[first, second])
    others = [trajectory("g", [70, 71], 0.0), trajectory("g", [72, 73, 74], 0.0)]
    batch, got = grads_of(grpo, [split] + others)
    v, meta = batch.values, batch.metadata
    assert meta["row_trajectory"] == [0, 0, 1, 2] and meta["num_trajectories"] == 3
    # independent GRPO on the three trajectory scores: mean 1/3, unbiased std sqrt(1/3)
    std = (1 / 3) ** 0.5
    a_split, a_other = (1 - 1 / 3) / (std + 1e-6), (0 - 1 / 3) / (std + 1e-6)
    torch.testing.assert_close(v["advantages"][0, :3], torch.full((3,), a_split))
    torch.testing.assert_close(v["advantages"][1, :4], torch.tensor([a_split, 0, 0, a_split]))
    torch.testing.assert_close(v["advantages"][2, :2], torch.full((2,), a_other))
    # the outcome reward sits once, on the trajectory's last trained token
    assert float(v["token_level_scores"][:2].sum()) == 1.0 and float(v["token_level_scores"][1, 3]) == 1.0
    want = reference_grads(grpo.train_service.model, [
        (PROMPT, first["response_token_ids"], first["loss_mask"], -a_split / 4 / 3),
        ([30, 31], second["response_token_ids"], second["loss_mask"], -a_split / 4 / 2),
        (PROMPT, [70, 71], [1, 1], -a_other / 4 / 2),
        (PROMPT, [72, 73, 74], [1, 1, 1], -a_other / 4 / 3)])
    assert_close(got, want)


def test_metrics_count_trained_tokens(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir)
    metrics = trainer.train([trajectory("g", [60, 61, 62, 63, 64, 65], 1.0, [1, 1, 0, 0, 0, 1]),
                             trajectory("g", [70, 71], 0.0)]).metrics
    assert metrics["train/trained_tokens"] == 5.0
    assert metrics["train/response_length_mean"] == 2.5  # (3 + 2) trained tokens / 2 trajectories
    assert metrics["train/untrained_response_tokens_mean"] == 1.5  # 3 tool tokens / 2 trajectories
    assert metrics["train/sequences_per_trajectory"] == 1.0


def test_a_mask_that_does_not_fit_its_response_is_a_data_error(grpo):
    with pytest.raises(DataError, match=r"trajectory g#0: loss_mask has 2 entries for 3 response tokens"):
        grpo._process_trajectories([trajectory("g", [60, 61, 62], 1.0, [1, 0])])


def test_sft_trains_only_on_masked_in_tokens(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, SelfHostedCrossEntropyTrainer)
    traj = trajectory("s", [60, 61, 62, 63, 64], 0.0, [1, 0, 0, 1, 1])
    batch, got = grads_of(trainer, [traj])
    assert float(batch.values["temperature"][0]) == 1.0  # the data's own likelihood
    # token-mean NLL over the 3 trained tokens
    want = reference_grads(trainer.train_service.model, [(PROMPT, traj["response_token_ids"], traj["loss_mask"],
                                                          -1 / 3)], temperature=1.0)
    assert_close(got, want)


def test_trajectory_view_round_trips_rows():
    import numpy as np

    view = TrajectoryView([0, 0, 1, 2, 2, 2], width=2)
    rows = np.arange(12, dtype=np.float32).reshape(6, 2)
    laid = view.gather(rows)
    assert laid.shape == (3, 6)
    assert laid[0].tolist() == [0, 1, 2, 3, 0, 0] and laid[2].tolist() == [6, 7, 8, 9, 10, 11]
    assert np.array_equal(view.scatter(laid), rows)
    assert view.first(["a", "a", "b", "c", "c", "c"]) == ["a", "b", "c"]
    single = TrajectoryView([0, 1, 2], width=2)  # single-turn batches: nothing is copied
    part = rows[:3]
    assert single.identity and single.gather(part) is part and single.scatter(part) is part


def test_gae_runs_over_a_trajectorys_trained_tokens_only(tiny_model_dir):
    """GAE with a critic on an agent trajectory of two sequences with masked tool tokens: the
    recursion runs over the trajectory's trained tokens end to end (the value after a segment's
    last trained token is the next segment's first), untrained tokens get no advantage, return or
    value loss. Checked against the recursion written out here, with values from a plain forward
    of each unpadded sequence."""
    trainer = make_trainer(tiny_model_dir, type="gae", gamma=0.9, lam=0.8, whiten_advantages=False)
    torch.manual_seed(3)
    head = trainer.critic.model.value_head
    torch.nn.init.normal_(head.weight, std=0.5)  # non-zero values (the head starts at zero)
    first = {"prompt_token_ids": PROMPT, "response_token_ids": [60, 61, 62], "response_logprobs": None,
             "loss_mask": [1, 0, 1]}
    second = {"prompt_token_ids": [30, 31], "response_token_ids": [63, 64, 65, 66], "response_logprobs": None,
              "loss_mask": [1, 0, 0, 1]}
    split = trajectory("g", first["response_token_ids"], 1.0, first["loss_mask"], segments=[first, second])
    other = trajectory("g", [70, 71, 72], 0.5, [1, 0, 1])
    batch = trainer._prepare_batch(trainer._process_trajectories([split, other]))[0]
    v = batch.values

    def values_of(prompt, response):
        with torch.no_grad():
            hidden = trainer.critic.model.backbone(input_ids=torch.tensor([prompt + response])).last_hidden_state
            return head(hidden[0, len(prompt) - 1:-1]).squeeze(-1).float()

    def gae(values, score, gamma=0.9, lam=0.8):
        adv, running, next_value = [0.0] * len(values), 0.0, 0.0
        for k in reversed(range(len(values))):
            reward = score if k == len(values) - 1 else 0.0
            running = reward + gamma * next_value - values[k] + gamma * lam * running
            adv[k], next_value = running, values[k]
        return adv

    rows = [(0, first), (1, second), (2, {**other, "prompt_token_ids": PROMPT})]
    trained = {row: [t for t, m in enumerate(seg["loss_mask"]) if m] for row, seg in rows}
    values = {row: values_of(seg["prompt_token_ids"], seg["response_token_ids"]) for row, seg in rows}
    for row, _ in rows:
        torch.testing.assert_close(v["old_values"][row, :len(values[row])], values[row], rtol=1e-4, atol=1e-5)
    # trajectory 0: rows 0 and 1 end to end; trajectory 1: row 2
    for traj_rows, score in (([0, 1], 1.0), ([2], 0.5)):
        positions = [(row, t) for row in traj_rows for t in trained[row]]
        vals = [float(values[row][t]) for row, t in positions]
        for (row, t), a, value in zip(positions, gae(vals, score), vals):
            assert float(v["advantages"][row, t]) == pytest.approx(a, abs=1e-5)
            assert float(v["returns"][row, t]) == pytest.approx(a + value, abs=1e-5)
    untrained = v["response_mask"] == 0
    assert int(untrained.sum()) == 2 + 2 + 2  # per row: tool tokens and padding (width 4)
    assert float(v["advantages"][untrained].abs().sum()) == 0.0 and float(v["returns"][untrained].abs().sum()) == 0.0
    # the value loss is the mean over trained tokens only (step 1: V = V_old, so nothing is clipped)
    metrics = trainer._update(batch, {k: x for k, x in v.items() if isinstance(x, torch.Tensor)})
    mask = v["response_mask"].bool()
    want = 0.5 * ((v["old_values"] - v["returns"])[mask] ** 2).mean()
    assert metrics["critic/vf_loss"] == pytest.approx(float(want), rel=1e-4)


def test_a_trajectory_of_several_sequences_records_its_largest_gap_and_the_segment(tiny_model_dir):
    """The sample's own log-prob gap is over all its segments' trained tokens: a larger skew on an
    untrained (tool) token is not it; the record says which segment and token."""
    from tests.grpo_plugin.test_on_policy import own_logprobs

    trainer = make_trainer(tiny_model_dir)
    sampling = {"temperature": TEMPERATURE}
    first = {"prompt_token_ids": PROMPT, "response_token_ids": [60, 61, 62], "loss_mask": [1, 1, 1]}
    second = {"prompt_token_ids": [30, 31], "response_token_ids": [63, 64, 65, 66], "loss_mask": [1, 0, 0, 1]}
    for seg, skew in ((first, {1: 0.2}), (second, {1: 0.9, 3: 0.3})):  # token 1 of the second is a tool's
        lps = own_logprobs(trainer.train_service.model, {**seg, "sampling": sampling})
        seg["response_logprobs"] = [lp - skew.get(k, 0.0) for k, lp in enumerate(lps)]
    split = trajectory("g", first["response_token_ids"], 1.0, first["loss_mask"], segments=[first, second])
    plain = trajectory("g", [70, 71], 0.0)
    plain["response_logprobs"] = [lp - 0.1 for lp in own_logprobs(trainer.train_service.model, plain)]
    samples = trainer.train([split, plain]).samples
    split_gap, plain_gap = samples[0].logprob_gap, samples[1].logprob_gap
    assert split_gap["segment"] == 1 and split_gap["position"] == 3
    assert split_gap["max"] == pytest.approx(0.3, abs=1e-5)
    assert split_gap["token"] == trainer.train_service.tokenizer.decode([66])
    assert "segment" not in plain_gap and plain_gap["max"] == pytest.approx(0.1, abs=1e-5)
