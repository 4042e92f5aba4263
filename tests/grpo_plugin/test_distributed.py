"""Data-parallel training with real torch.distributed process groups (gloo on the CPU): 2 ranks
reach the weights 1 rank reaches on the same global batch, FSDP2 and DDP; sharded checkpoints
resume exactly on the same world size and with a warning on another; a rank that dies is named."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from nexrl_core import NexRLError
from nexrl_grpo.losses import agg_loss, masked_mean
from nexrl_torch.train.distributed import shard_rows
from nexrl_torch.train.service import LocalTorchTrainService


def make_batch(rows: int = 5, prompt: int = 4, response: int = 3, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 90, (rows, prompt + response), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    response_mask = torch.ones(rows, response)
    response_mask[1, 2:] = 0  # a shorter response
    mask[1, prompt + 2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, prompt:], "response_mask": response_mask,
            "advantages": torch.randn(rows, response, generator=gen),
            "prompt_groups": torch.tensor([0, 0, 1, 2, 2][:rows])}


def loss_fn(log_probs, mb):
    """A policy-gradient surrogate reduced over the whole batch's tokens (each micro-batch's share),
    and a token mean as a metric (combined across micro-batches and ranks by token share)."""
    loss = agg_loss(-log_probs * mb["advantages"], mb["response_mask"], "token-mean",
                    batch_num_tokens=mb["batch_num_tokens"])
    return loss, {"nll": float(masked_mean(-log_probs.detach(), mb["response_mask"]))}


def service(model_dir, **extra):
    return LocalTorchTrainService({"model_path": model_dir, "lr": 1e-2, "seed": 3, "device": "cpu",
                                   "packing": False, **extra})


def with_rows(log_probs, mb):
    """:func:`loss_fn` with per-row values (ROW_OUTPUTS) beside its metrics: the same gradients."""
    from nexrl_torch.train.service import ROW_OUTPUTS

    loss, metrics = loss_fn(log_probs, mb)
    metrics[ROW_OUTPUTS] = {"first_token": log_probs[:, 0].detach(), "row_sum": mb["input_ids"].sum(-1)}
    return loss, metrics


def step(svc, batch, loss=loss_fn):
    metrics = svc.forward_backward(batch, loss)
    metrics.update(svc.optim_step())
    return metrics


def weights(svc) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in svc.export_weights().items()}


def test_rows_go_to_ranks_by_whole_groups_balanced_by_tokens():
    assert shard_rows([0, 0, 1, 2, 2], [10, 10, 30, 5, 5], 2) == [[2], [0, 1, 3, 4]]
    assert shard_rows([0, 1], [3, 3], 3) == [[0], [1], []]  # a rank may get nothing
    shards = shard_rows(list(range(10)), list(range(1, 11)), 3)
    assert sorted(r for s in shards for r in s) == list(range(10))
    loads = [sum(r + 1 for r in s) for s in shards]
    assert max(loads) - min(loads) <= 2


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_two_ranks_reach_the_weights_of_one(tiny_model_dir, parallel):
    """Two optimizer steps on the same global batches, with micro-batches (rank 1 has fewer rows and
    runs an empty pass for the collectives): weights, loss and gradient norm agree to float tolerance.
    A loss's per-row values (ROW_OUTPUTS) come back in the batch's row order (each rank has whole
    groups, out of row order: rank 0 puts every value back at its row). FSDP2's export gathers each
    weight as the engine copies it (never a second whole model), in one pass that the other ranks
    follow; pickled, it gathers everything first. (One process group for all of it: each costs seconds.)"""
    import pickle

    from nexrl_torch.rollout.engine import HFInferenceEngine
    from nexrl_torch.train.distributed import GatheredWeights
    from nexrl_torch.train.service import ROW_OUTPUTS

    batches = [make_batch(seed=s) for s in (0, 1)]
    shards = shard_rows(batches[0]["prompt_groups"].tolist(), batches[0]["attention_mask"].sum(-1).tolist(), 2)
    assert [r for rows in shards for r in rows] != list(range(5))  # rank order is not row order
    one = service(tiny_model_dir, micro_batch_size=2)
    want = [step(one, b, with_rows) for b in batches]
    engine = HFInferenceEngine({"model_path": tiny_model_dir}) if parallel == "fsdp" else None
    two = service(tiny_model_dir, micro_batch_size=2, world_size=2, parallel=parallel)
    try:
        got = [step(two, b, with_rows) for b in batches]
        logprobs = two.forward(batches[0])
        if engine is not None:
            gathered = two.export_weights()
            assert isinstance(gathered, GatheredWeights)
            assert gathered.shapes == {k: tuple(v.shape) for k, v in one.export_weights().items()}
            engine.load_weights(gathered, 1)
            with pytest.raises(RuntimeError, match="already iterated"):
                gathered.drain()
            sent = pickle.loads(pickle.dumps(two.export_weights()))  # what Ray's object store would carry
        exported = weights(two)
    finally:
        two.close()
        if engine is not None:
            engine.close()
    reference = weights(one)
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(exported[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        # Equal weights after AdamW do not show equal gradients: Adam divides each gradient by its
        # running scale, so halved gradients (a wrong world-size average) give nearly the same update.
        # The gradient norm is what catches that.
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
        assert g["nll"] == pytest.approx(w["nll"], rel=1e-5)
    torch.testing.assert_close(logprobs, one.forward(batches[0]), atol=1e-5, rtol=1e-4)
    rows_two, rows_one = got[0][ROW_OUTPUTS], want[0][ROW_OUTPUTS]  # the first step's: the same weights
    assert rows_two["row_sum"] == rows_one["row_sum"] == batches[0]["input_ids"].sum(-1).tolist()
    assert rows_two["first_token"] == pytest.approx(rows_one["first_token"], abs=1e-5)
    assert len(set(rows_one["first_token"])) == 5
    if engine is not None:
        served = engine.model.state_dict()
        for name, tensor in reference.items():
            torch.testing.assert_close(served[name], tensor, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(sent[name], tensor, atol=1e-5, rtol=1e-4)
        assert engine.model_version() == 1


def make_packable_batch(seed: int = 0) -> dict:
    """:func:`make_batch` with each group's rows sharing their prompt, as packing assumes."""
    batch = make_batch(seed=seed)
    for first, other in ((0, 1), (3, 4)):
        batch["input_ids"][other, :4] = batch["input_ids"][first, :4]
        batch["attention_mask"][other, :4] = batch["attention_mask"][first, :4]
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return batch


@pytest.mark.parametrize("parallel,micro_batch_size", [("fsdp", None), ("ddp", None), ("fsdp", 2)])
def test_two_ranks_with_packing_reach_the_weights_of_one(tiny_model_dir, parallel, micro_batch_size):
    """Packed forwards on 2 ranks whose shards pack into different numbers of sequences (rank 0's
    rows into 1, rank 1's into 2: rank 0 adds an empty call): the weights, loss and log-probs of one
    packed process on the same global batches."""
    from nexrl_torch.logprobs import pack_count

    batches = [make_packable_batch(seed=s) for s in (0, 1)]
    # eps well above rounding noise: AdamW's first step is about lr * sign(grad), which turns a
    # gradient of ~1e-8 that summation order flips into a 1e-3 weight difference.
    options = {"packing": True, "max_tokens_per_pack": 10, "micro_batch_size": micro_batch_size, "eps": 1e-4}
    shards = shard_rows(batches[0]["prompt_groups"].tolist(), batches[0]["attention_mask"].sum(-1).tolist(), 2)
    counts = [pack_count(batches[0]["attention_mask"][rows], 3, batches[0]["prompt_groups"][rows], 10) for rows in shards]
    assert counts == [1, 2]  # the case this test is about
    one = service(tiny_model_dir, **options)
    want = [step(one, b) for b in batches]
    two = service(tiny_model_dir, world_size=2, parallel=parallel, **options)
    try:
        assert two.packing == "true"
        got = [step(two, b) for b in batches]
        logprobs = two.forward(batches[0])
        exported = weights(two)
    finally:
        two.close()
    for name, tensor in weights(one).items():
        torch.testing.assert_close(exported[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)  # AdamW hides gradient scale: see above
    torch.testing.assert_close(logprobs, one.forward(batches[0]), atol=1e-5, rtol=1e-4)


def test_sharded_checkpoint_resumes_exactly_and_on_another_world_size(tiny_model_dir, tmp_path, reset_loguru):
    """2 ranks -> 2 ranks bit for bit, 2 -> 1 and 1 -> 2 (a one-process checkpoint spreads over the
    shards) to float tolerance, with the warning in the log."""
    from nexrl_core.runtime.run_log import LOG_FILE, setup_logging

    setup_logging(str(tmp_path), level="INFO")
    first, second = make_batch(seed=0), make_batch(seed=1)
    one = service(tiny_model_dir)  # the one-process run of the same batches
    step(one, first)
    one.save_checkpoint(tmp_path / "one_process")
    step(one, second)
    folder = tmp_path / "global_step_1"
    straight = service(tiny_model_dir, world_size=2)
    try:
        step(straight, first)
        straight.save_checkpoint(folder, {"algorithm": {"kl_coef": 0.5}})
        step(straight, second)
        want = weights(straight)
    finally:
        straight.close()
    assert (folder / "model.safetensors").is_file() and (folder / "optimizer").is_dir()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(folder)  # the checkpoint is an HF folder

    resumed = service(tiny_model_dir, world_size=2)
    try:
        assert resumed.load_checkpoint(folder) == {"algorithm": {"kl_coef": 0.5}}
        step(resumed, second)
        got = weights(resumed)
        # 1 -> 2, in the same group (a process group costs seconds): the load replaces every state it trained
        resumed.load_checkpoint(tmp_path / "one_process")
        step(resumed, second)
        spread = weights(resumed)
    finally:
        resumed.close()
    assert all(torch.equal(got[k], want[k]) for k in want)  # same world size: the same bits
    for name, tensor in weights(one).items():
        torch.testing.assert_close(spread[name], tensor, atol=1e-5, rtol=1e-4)

    alone = service(tiny_model_dir)
    alone.load_checkpoint(folder)
    step(alone, second)
    for name, tensor in weights(alone).items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=1e-4)
    log = (tmp_path / LOG_FILE).read_text()
    assert "written by 2 rank(s), resumed on 1" in log and "written by 1 rank(s), resumed on 2" in log


def test_a_rank_that_dies_is_named(tiny_model_dir):
    two = service(tiny_model_dir, world_size=2)
    try:
        step(two, make_batch())
        follower = two.ranks.followers[0]
        os.kill(follower.pid, signal.SIGKILL)
        with pytest.raises(NexRLError) as caught:
            step(two, make_batch(seed=1))
        message = str(caught.value)
        assert message.startswith("service.train_service: rank 1 (")
        assert f"pid {follower.pid}) stopped: exit code -9 (signal 9)" in message
    finally:
        two.close()  # the other ranks are stopped even with one gone
    assert not follower.is_alive()


def test_a_grpo_run_on_two_ranks(tmp_path, tiny_model_dir, monkeypatch, capfd, reset_loguru):
    """`nexrl run` with service.train_service.world_size=2 and two engine replicas behind the rollout
    workers: the same first step as one rank and one engine (same rollouts, same loss), weights
    pushed from the shards into both replicas, a checkpoint that loads in transformers, no rank
    left behind."""
    import json

    import yaml

    import nexrl_core.plugins as plugins
    from nexrl_core.cli import main
    from tests.support.letters import grpo_plugin_manager

    monkeypatch.setattr(plugins, "_DEFAULT", grpo_plugin_manager())
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "seed": 5,
        "data": {"type": "inline", "rows": [{"prompt": "the quick"}, {"prompt": "hello world"}]},
        "rollout_worker": {"num_workers": 4, "sampling": {"max_tokens": 4},
                           "evaluator": {"type": "letter_share", "letter": "e"}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": 2, "save_freq": 2},
        "weight": {"backend": "in_process"},
        "service": {"train_service": {"model_path": tiny_model_dir, "lr": 1.0e-3, "device": "cpu"},
                    "inference_service": {"backend": "hf", "model_path": tiny_model_dir}},
        "logger": {"backend": [], "level": "WARNING", "progress": "off"},
    }))
    rows = {}
    for world in (1, 2):
        run_dir = tmp_path / f"run{world}"
        code = main(["run", str(recipe), f"run_dir={run_dir}", f"+service.train_service.world_size={world}",
                     f"+service.inference_service.replicas={world}"])
        assert code == 0, capfd.readouterr().err[-3000:]
        with open(run_dir / "metrics.jsonl") as f:
            rows[world] = [r for r in map(json.loads, f) if "train/loss" in r]
    first = [rows[w][0] for w in (1, 2)]
    assert first[0]["train/reward_mean"] == first[1]["train/reward_mean"]
    assert first[1]["train/loss"] == pytest.approx(first[0]["train/loss"], rel=1e-4, abs=1e-6)
    # The loss and reward alone would pass gradients summed instead of averaged over the ranks: the norm shows them.
    assert first[1]["train/grad_norm"] == pytest.approx(first[0]["train/grad_norm"], rel=1e-4)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "run2" / "checkpoints" / "global_step_2")
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith("nexrl-train-rank")]


def test_one_rank_through_the_fsdp_code_matches_the_plain_service(tiny_model_dir):
    """`parallel: fsdp` with world_size 1: the same code as N ranks (a one-process group, the model
    sharded over one rank, packing kept), the plain service's weights (what gpu_check times on a GPU)."""
    batch = make_batch()
    plain = service(tiny_model_dir, packing=None)
    want = step(plain, batch)
    one = service(tiny_model_dir, packing=None, parallel="fsdp")
    try:
        assert one.ranks is not None and one.ranks.world_size == 1 and one.packing == "auto"
        got_metrics = step(one, batch)
        got = weights(one)
    finally:
        one.close()
    for name, tensor in weights(plain).items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=1e-5)
    assert want["grad_norm"] > 0  # a real gradient: equal weights after no update would prove nothing
    assert got_metrics["loss"] == pytest.approx(want["loss"], rel=1e-5)
    # Equal weights after AdamW do not show equal gradients: Adam divides each gradient by its running
    # scale, so a gradient scaled by any constant (halved by a wrong world-size average, say) gives
    # nearly the same update and passes the weight comparison above. Only the norm catches that.
    assert got_metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_two_ranks_record_each_samples_logprob_gap_as_one(tiny_model_dir):
    """The GRPO trainer on two ranks: every sample gets the same own log-prob gap (and token) as
    with one rank, in the same order, and both equal the max over its tokens computed here."""
    from nexrl_torch.models import load_causal_lm
    from tests.grpo_plugin.test_on_policy import expected_gaps, make_trainer, own_logprobs, skewed

    model, _ = load_causal_lm(tiny_model_dir)
    gen = torch.Generator().manual_seed(7)
    batch = []
    for i in range(8):  # prompts of different lengths: ranks get interleaved rows
        prompt = torch.randint(3, 90, (2 + i % 3 + (i // 2) % 2,), generator=gen).tolist()
        response = torch.randint(3, 90, (3 + i % 4,), generator=gen).tolist()
        t = {"uid": f"g{i // 2}", "sample_index": i % 2, "prompt_token_ids": prompt, "response_token_ids": response,
             "sampling": {"temperature": 1.0, "max_tokens": 8}, "reward": float(i % 3), "model_version": 0}
        batch.append({**t, "response_logprobs": own_logprobs(model, t)})
    batch = skewed(batch)
    want = expected_gaps(model, batch)
    recorded = {}
    for world in (1, 2):
        trajectories = [dict(t) for t in batch]
        trainer = make_trainer(tiny_model_dir, service={"world_size": world, "micro_batch_size": 3})
        try:
            samples = trainer.train(trajectories).samples
        finally:
            trainer.close()
        recorded[world] = [samples[i].logprob_gap for i in range(len(trajectories))]
    assert [g["position"] for g in recorded[2]] == [g["position"] for g in recorded[1]] == [p for _, p in want]
    assert [g["token"] for g in recorded[2]] == [g["token"] for g in recorded[1]]
    assert [g["max"] for g in recorded[2]] == pytest.approx([g["max"] for g in recorded[1]], abs=1e-5)
    assert [g["max"] for g in recorded[1]] == pytest.approx([m for m, _ in want], abs=1e-5)
