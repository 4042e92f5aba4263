"""The remote-API trainers of nexrl-tinker through the real controller, the real ``tinker`` SDK and the
stand-in on loopback (a tiny Llama behind it).

One GRPO run (module fixture) of a toy task the tiny model learns in a few steps (the share of the
letter "e" in the reply), instrumented at public seams: the reward rises, forward_backward and
optim_step are submitted back to back and then awaited, advantages are the core estimator's,
rollouts of step k sample the weights of step k - 1, and the service's log-probs match the
sampler's. Plus: datums of a GRPO step token by token, the refusals of the sampling record, the
cross-entropy trainer on pig-latin targets, and remote failures (429s and 5xx retried, a failed
training call stopping the run with the request named).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from nexrl_core import DataError, RunFailed, SamplingParams
from nexrl_core.builtins.workers import pig_latin
from nexrl_core.controller import NexRLController
from nexrl_core.launch.parts import build_module
from nexrl_core.launch.recipe import load_recipe
from nexrl_tinker.standin import BaseModel, Fault, StandinServer
from tests.support.tiny_lm import build_model
from tests.tinker_plugin.helpers import MODEL, PROMPTS, grpo_recipe, metrics_rows, tinker_plugin_manager

STEPS = 6
GROUP = 8
SAVE_FREQ = 3


def _controller(recipe: dict, folder: Path) -> NexRLController:
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return NexRLController(load_recipe(str(path)), plugin_manager=tinker_plugin_manager())


class GrpoRun:
    def __init__(self):
        self.events: list[str] = []  # submissions and waits of forward_backward / optim_step, in order
        self.prepared: list[list[dict]] = []  # per step: the trajectories turned into datums
        self.versions: list[tuple[int, set[int]]] = []  # (step being trained, model versions of its data)
        self.summary = None
        self.rows: list[dict] = []
        self.run_dir: Path | None = None
        self.server: StandinServer | None = None


def _record_waits(pending, name: str, events: list[str]):
    result = pending.result

    def waited():
        events.append(f"wait {name}")
        return result()
    pending.result = waited
    return pending


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, tokenizer, tiny_folder):
    root = tmp_path_factory.mktemp("remote_grpo")
    server = StandinServer({MODEL: BaseModel(MODEL, build_model(tokenizer), tokenizer)},
                           state_dir=str(root / "state")).start()
    rec = GrpoRun()
    rec.server, rec.run_dir = server, root / "run"
    try:
        recipe = grpo_recipe(rec.run_dir, server.url, tiny_folder, steps=STEPS, group=GROUP)
        recipe["trainer"]["save_freq"] = SAVE_FREQ
        controller = _controller(recipe, root)
        trainer = controller.trainer
        create = trainer.create_train_service

        def instrumented_service():
            service = create()
            fb, opt = service.forward_backward, service.optim_step

            def forward_backward(*args, **kwargs):
                rec.events.append("submit forward_backward")
                return _record_waits(fb(*args, **kwargs), "forward_backward", rec.events)

            def optim_step():
                rec.events.append("submit optim_step")
                return _record_waits(opt(), "optim_step", rec.events)
            service.forward_backward, service.optim_step = forward_backward, optim_step
            return service

        train, convert = trainer.train, trainer._convert_trajectories_to_datums

        def recording_train(trajectories):
            rec.versions.append((trainer.global_step + 1, {int(t["model_version"]) for t in trajectories}))
            return train(trajectories)

        def recording_convert(trajectories):
            rec.prepared.append([dict(t) for t in trajectories])
            return convert(trajectories)

        trainer.create_train_service = instrumented_service
        trainer.train, trainer._convert_trajectories_to_datums = recording_train, recording_convert
        rec.summary = controller.run()
        rec.rows = metrics_rows(rec.run_dir)
        yield rec
    finally:
        server.stop()


def _train_rows(rec: GrpoRun) -> list[dict]:
    rows = [r for r in rec.rows if "train/reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows


def test_a_few_grpo_steps_raise_the_reward(grpo_run):
    assert grpo_run.summary.stopped_by == "finished" and grpo_run.summary.global_step == STEPS
    assert grpo_run.summary.errors == []
    rewards = [r["train/reward_mean"] for r in _train_rows(grpo_run)]
    assert np.mean(rewards[-2:]) > np.mean(rewards[:2]) + 0.1, rewards


def test_every_step_logs_the_service_metrics_and_a_negligible_sampler_mismatch(grpo_run):
    for row in _train_rows(grpo_run):
        assert row["train/lr"] == pytest.approx(2e-2) and np.isfinite(row["train/loss_sum"])
        assert row["train/num_trajectories"] == len(PROMPTS) * GROUP
        # The service scores the sampled tokens with the weights that sampled them: float noise at most.
        assert row["train/rollout_logprob_diff_max"] < 1e-4 and row["train/rollout_kl_k3"] < 1e-8
        assert row["train/advantages_abs_mean"] > 0


def test_each_recorded_sample_carries_its_own_logprob_gap(grpo_run):
    """samples.jsonl: each sample's own largest gap over its tokens (no token text: this trainer has
    no tokenizer), at most its step's; `nexrl show` prints them without a crash."""
    from nexrl_core.cli.show import show

    by_step = {r["step"]: r["train/rollout_logprob_diff_max"] for r in _train_rows(grpo_run)}
    samples = [json.loads(line) for line in (grpo_run.run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, STEPS}
    for s in samples:
        assert set(s["logprob_gap"]) == {"max", "position"} and 0 <= s["logprob_gap"]["position"]
        assert 0 <= s["logprob_gap"]["max"] <= by_step[s["step"]]
    assert show(str(grpo_run.run_dir)).startswith(str(grpo_run.run_dir / "samples.jsonl"))


def test_each_recorded_sample_carries_the_advantage_it_was_trained_with(grpo_run):
    """samples.jsonl's ``advantage``: the mean of the per-token advantages the service was sent for
    that sample (GRPO's: one value over its tokens), as self_hosted_grpo records it."""
    samples = [json.loads(line) for line in (grpo_run.run_dir / "samples.jsonl").read_text().splitlines()]
    sent = {(step, t["uid"], t["response"]): t["advantages"]
            for step, prepared in enumerate(grpo_run.prepared, start=1) for t in prepared}
    assert samples and any(s["advantage"] != 0 for s in samples)
    for s in samples:
        trained = sent[(s["step"], s["uid"], s["response"])]
        assert trained and s["advantage"] == pytest.approx(float(np.mean(trained)), abs=1e-9), s


def test_forward_backward_and_optim_step_are_submitted_back_to_back_then_awaited(grpo_run):
    one_step = ["submit forward_backward", "submit optim_step", "wait forward_backward", "wait optim_step"]
    assert grpo_run.events == one_step * STEPS
    server = grpo_run.server
    assert server.count("POST /api/v1/forward_backward") == server.count("POST /api/v1/optim_step") == STEPS


def test_advantages_are_the_group_normalised_rewards(grpo_run):
    assert len(grpo_run.prepared) == STEPS
    for trajectories in grpo_run.prepared:
        by_group: dict[str, list[dict]] = {}
        for t in trajectories:
            by_group.setdefault(t["uid"], []).append(t)
        assert sorted(len(g) for g in by_group.values()) == [GROUP] * len(PROMPTS)
        for group in by_group.values():
            rewards = np.array([t["reward"] for t in group])
            expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
            for t, adv in zip(group, expected):
                assert t["advantages"] == pytest.approx([adv] * len(t["response_token_ids"]), abs=1e-6)
                assert t["sampling"]["temperature"] == 1.0


def test_each_step_trains_on_rollouts_of_the_previous_weights(grpo_run):
    assert grpo_run.versions == [(step, {step - 1}) for step in range(1, STEPS + 1)]


def test_checkpoints_record_the_remote_state(grpo_run):
    for step in (SAVE_FREQ, STEPS):
        folder = grpo_run.run_dir / "checkpoints" / f"global_step_{step}"
        state = json.loads((folder / "tinker_state.json").read_text())
        assert state["optimizer_steps"] == step and state["base_model"] == MODEL and state["lora_rank"] == 8
        remote = grpo_run.server.state_dir / state["tinker_path"].removeprefix("tinker://")
        assert (remote / "weights.safetensors").is_file() and (remote / "optimizer.safetensors").is_file()
        sampler = grpo_run.server.state_dir / state["sampler_path"].removeprefix("tinker://")
        assert (sampler / "weights.safetensors").is_file() and not (sampler / "optimizer.safetensors").exists()
        assert set(state["extra_state"]) == {"algorithm", "rng"}
        assert sorted(p.name for p in folder.iterdir()) == ["nexrl_state.json", "tinker_state.json"]


# -- datums of one GRPO step, without a service -------------------------------------------------------

def _trainer(tiny_folder: str, url: str = "http://127.0.0.1:9", **algorithm):
    from nexrl_tinker.trainers import RemoteApiGrpoTrainer

    recipe = grpo_recipe("/tmp/unused", url, tiny_folder, steps=1, group=2)
    recipe["algorithm"] = {"type": "grpo", **algorithm}
    cfg = OmegaConf.create(recipe)
    return build_module(RemoteApiGrpoTrainer, cfg)


def _trajectory(uid: str, index: int, reward: float, response: list[int], **extra) -> dict:
    return {"uid": uid, "sample_index": index, "reward": reward, "prompt_token_ids": [5, 6, 7],
            "response_token_ids": response, "response_logprobs": [-0.5 - 0.1 * i for i in range(len(response))],
            "sampling": SamplingParams(max_tokens=4, temperature=1.0).as_record(), **extra}


def test_a_grpo_steps_datums_token_by_token(tiny_folder):
    trainer = _trainer(tiny_folder)
    trajectories = [_trajectory("a", 0, 1.0, [11, 12, 13], loss_mask=[1, 0, 1]),
                    _trajectory("a", 1, 0.0, [14, 15]),
                    _trajectory("b", 0, 0.5, [16]), _trajectory("b", 1, 0.5, [17, 18])]
    metrics: dict = {}
    prepared = trainer._prepare_trajectories(trajectories, metrics)
    adv = 0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-6)  # group a: +-0.7071; group b is flat: 0
    assert [t["advantages"] for t in prepared] == [pytest.approx([adv, 0.0, adv]), pytest.approx([-adv, -adv]),
                                                    [0.0], [0.0, 0.0]]
    assert metrics["train/rows_in_flat_groups"] == 0.5
    assert "advantages" not in trajectories[0]  # the inputs are left as they were

    datums = trainer._convert_trajectories_to_datums(prepared)
    first = {k: v.to_numpy().tolist() for k, v in datums[0].loss_fn_inputs.items()}
    assert datums[0].model_input.to_ints() == [5, 6, 7, 11, 12]         # prompt + response, minus the last token
    assert first["target_tokens"] == [6, 7, 11, 12, 13]                 # shifted by one
    assert first["logprobs"] == pytest.approx([0, 0, -0.5, -0.6, -0.7])  # the sampler's, on the response
    assert first["advantages"] == pytest.approx([0, 0, adv, 0, adv])     # masked token: no advantage
    assert trainer.loss() == ("importance_sampling", None)


def test_reward_processing_per_domain_before_the_advantages_and_masked_samples_leave_the_step(tiny_folder):
    """The same core functions as self_hosted_grpo: a flat code group is masked (its datums are not
    sent), math rewards are scaled before the estimator, a truncated reply is scored; the running
    statistics go into the checkpoint's algorithm state."""
    trainer = _trainer(tiny_folder, type="dr_grpo", reward_processing={
        "overlong": "score", "overlong_reward": -1.0, "norm": "running",
        "domains": {"code": {"mask_flat_groups": True, "norm": "none"}, "math": {"scale": 2.0, "norm": "none"}}})
    trajectories = [_trajectory("m", 0, 1.0, [11], domain="math"), _trajectory("m", 1, 0.0, [12], domain="math"),
                    _trajectory("c", 0, 0.0, [13], domain="code"), _trajectory("c", 1, 0.0, [14], domain="code"),
                    _trajectory("x", 0, 1.0, [15, 16, 17, 18], finish_reason="length"),  # cut off: scored -1
                    _trajectory("x", 1, 1.0, [19])]
    metrics: dict = {}
    prepared = trainer._prepare_trajectories(trajectories, metrics)
    assert [(t["uid"], t["sample_index"]) for t in prepared] == [("m", 0), ("m", 1), ("x", 0), ("x", 1)]
    assert [t["advantages"] for t in prepared[:2]] == [pytest.approx([1.0]), pytest.approx([-1.0])]  # dr_grpo: 2r - mean
    x = np.array([-1.0, 1.0])
    z = (x - x.mean()) / (x.std(ddof=1) + 1e-6)  # running stats of the first batch = the batch's
    assert prepared[2]["advantages"] == pytest.approx([z[0] - z.mean()] * 4)
    assert metrics["train/code/masked_frac"] == 1.0 and metrics["train/truncated_frac"] == 0.5
    assert trainer.algorithm_state()["reward_running"][""]["count"] == 2
    masked_only = [t for t in trajectories if t["uid"] == "c"]
    assert trainer.train(masked_only).metrics["train/update_skipped"] == 1.0  # nothing to send: no service call


def test_ppo_clip_ratios_become_the_services_thresholds(tiny_folder):
    trainer = _trainer(tiny_folder, loss_fn="ppo", clip_ratio_low=0.1, clip_ratio_high=0.3)
    name, config = trainer.loss()
    assert name == "ppo" and config == pytest.approx({"clip_low_threshold": 0.9, "clip_high_threshold": 1.3})
    assert _trainer(tiny_folder, loss_fn="ppo").loss()[1] == pytest.approx({"clip_low_threshold": 0.8,
                                                                            "clip_high_threshold": 1.2})


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_on_policy_rows_give_the_service_a_ratio_of_one(loss_fn, standin, tiny_folder, tokenizer):
    """Rollout log-probs taken from the service itself (on-policy): if the datums placed them one
    token off, the service's ratio would not be 1 and the loss would not be -sum(advantages)."""
    trainer = _trainer(tiny_folder, standin.url, loss_fn=loss_fn)
    trainer.initialize_workers()
    try:
        prompt, responses = tokenizer("the quick").input_ids, [tokenizer(r).input_ids for r in (" brown", " fox jum")]
        rows = [_trajectory("a", i, float(i), r, prompt_token_ids=prompt) for i, r in enumerate(responses)]
        probe = trainer._convert_trajectories_to_datums(trainer._prepare_trajectories(rows, {}))
        logprobs = [out["logprobs"] for out in trainer.train_service.forward(probe).outputs]
        rows = [{**t, "response_logprobs": lp[-len(t["response_token_ids"]):].tolist()}
                for t, lp in zip(rows, logprobs)]
        prepared = trainer._prepare_trajectories(rows, {})
        before = copy.deepcopy(rows)
        output = trainer.train(rows)
        result = output.metrics
        expected = -sum(sum(t["advantages"]) for t in prepared)
        assert expected != 0  # the two responses differ in length
        assert result["train/loss_sum"] == pytest.approx(expected, abs=1e-4)
        assert result["train/rollout_logprob_diff_max"] < 1e-5
        assert rows == before  # the gaps and advantages are beside the trajectories, not written into them
        assert sorted(output.samples) == [0, 1]
        assert max(output.samples[i].logprob_gap["max"] for i in (0, 1)) == \
            pytest.approx(result["train/rollout_logprob_diff_max"], abs=1e-12)
    finally:
        trainer.close()


def test_an_agent_rollout_of_several_sequences_trains_one_datum_per_sequence(standin, tiny_folder, tokenizer):
    """docs/agents.md: a trajectory whose turns did not merge into one sequence (``segments``) is one
    sample of its group; each sequence is a datum with its own loss mask. Through the stand-in, with
    on-policy log-probs: the service's ratio is 1 on every datum, so the loss is -sum of the masked
    advantages, and a datum placed one token off (or given another sequence's log-probs) would show."""
    trainer = _trainer(tiny_folder, standin.url)
    trainer.initialize_workers()
    try:
        ids = lambda text: tokenizer(text).input_ids  # noqa: E731
        first = {"prompt_token_ids": ids("what is two"), "response_token_ids": ids(" plus three"),
                 "loss_mask": None}
        tool = ids(" tool says five then")
        second = {"prompt_token_ids": ids("sub agent:"), "response_token_ids": tool,
                  "loss_mask": [1, 1] + [0] * (len(tool) - 3) + [1]}  # the tool's words are not trained
        agent = _trajectory("a", 0, 1.0, first["response_token_ids"], prompt_token_ids=first["prompt_token_ids"],
                            segments=[first, second])
        plain = _trajectory("a", 1, 0.0, ids(" four"), prompt_token_ids=ids("what is two"))
        rows = [agent, plain]
        seqs = [first, second, plain]
        probe = [d for s in seqs for d in trainer._convert_trajectories_to_datums(
            [{**_trajectory("p", 0, 0.0, s["response_token_ids"], prompt_token_ids=s["prompt_token_ids"]),
              "advantages": 0.0}])]
        logprobs = [out["logprobs"] for out in trainer.train_service.forward(probe).outputs]
        for s, lp in zip(seqs, logprobs):  # each sequence's own sampling log-probs, from the service
            s["response_logprobs"] = lp[-len(s["response_token_ids"]):].tolist()
        agent["response_logprobs"] = first["response_logprobs"]

        prepared = trainer._prepare_trajectories(rows, {})
        datums = trainer._convert_trajectories_to_datums(prepared)
        assert len(datums) == 3  # the agent rollout's two sequences, then the plain sample
        adv = 0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-6)
        second_adv = datums[1].loss_fn_inputs["advantages"].to_numpy()[-len(tool):]
        assert second_adv.tolist() == pytest.approx([adv if m else 0.0 for m in second["loss_mask"]])
        result = trainer.train(rows).metrics
        trained = len(first["response_token_ids"]) + sum(second["loss_mask"])
        expected = -(adv * trained - adv * len(plain["response_token_ids"]))
        assert result["train/loss_sum"] == pytest.approx(expected, abs=1e-4)
        assert result["train/rollout_logprob_diff_max"] < 1e-5
        assert result["train/sequences_per_trajectory"] == 1.5
        assert result["train/response_length_mean"] == (trained + len(plain["response_token_ids"])) / 2
    finally:
        trainer.close()


def test_rows_must_say_they_were_sampled_at_the_temperature_the_service_scores(tiny_folder):
    trainer = _trainer(tiny_folder)
    unrecorded = _trajectory("a", 0, 1.0, [11])
    del unrecorded["sampling"]
    with pytest.raises(DataError, match=r"trajectory a#0 does not say how it was sampled"):
        trainer._prepare_trajectories([unrecorded], {})
    hot = _trajectory("a", 1, 1.0, [11], sampling=SamplingParams(temperature=0.7).as_record())
    with pytest.raises(DataError, match=r"trajectory a#1 was sampled at temperature 0.7, .*temperature 1 only"):
        trainer._prepare_trajectories([hot], {})
    greedy = _trajectory("a", 2, 1.0, [11], sampling=SamplingParams(temperature=0).as_record())
    assert trainer._prepare_trajectories([greedy], {})[0]["advantages"] == [0.0]  # greedy log-probs are at T=1


# -- supervised ----------------------------------------------------------------------------------------

def test_cross_entropy_trainer_learns_pig_latin_targets(make_standin, tiny_folder, tokenizer, tmp_path):
    from nexrl_tinker.tokens import encode_prompt

    server = make_standin(try_again_polls=0)
    sentences = ["the quick brown fox", "hello world", "what is two plus three"]
    steps = 5
    recipe = grpo_recipe(tmp_path / "run", server.url, tiny_folder, steps=steps, group=1)
    recipe.update({
        "data": {"type": "inline", "rows": [{"prompt": s} for s in sentences]},
        "rollout_worker": {"type": "pig_latin", "num_workers": 2},
        "trajectory_pool": {"batch_size": len(sentences), "group_size": 1, "key_list": ["uid"]},
        "trainer": {"type": "remote_api_cross_entropy", "total_train_steps": steps, "tokenizer_path": tiny_folder},
        "algorithm": {},
        "weight": {"sync_mode": "sync", "backend": "version_only"},  # the targets are computed, not sampled
    })
    recipe["service"]["inference_service"] = {"backend": "mock"}
    controller = _controller(recipe, tmp_path)
    seen: list[list[dict]] = []
    convert = controller.trainer._convert_trajectories_to_datums
    controller.trainer._convert_trajectories_to_datums = lambda ts: (seen.append(ts), convert(ts))[1]
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.errors == []
    rows = [r for r in metrics_rows(tmp_path / "run") if "train/nll" in r]
    nll = [r["train/nll"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert nll[-1] < 0.5 * nll[0], nll
    t = seen[0][0]
    source = t["prompt"][0]["content"].removeprefix("Translate to Pig Latin: ")
    assert t["prompt_token_ids"] == encode_prompt(tokenizer, t["prompt"])  # as the tinker sampler encodes it
    assert t["response_token_ids"] == tokenizer(pig_latin(source), add_special_tokens=False).input_ids + \
        [tokenizer.eos_token_id]


# -- remote failures ---------------------------------------------------------------------------------------

def test_429s_and_5xx_are_retried_and_a_failed_training_call_stops_the_run_naming_it(make_standin, tiny_folder,
                                                                                       tmp_path):
    server = make_standin(try_again_polls=0, faults=[Fault("asample", 3, 429, count=3),
                                                     Fault("optim_step", 1, 503, count=2),
                                                     Fault("forward_backward", 3, "request_failed")])
    recipe = grpo_recipe(tmp_path / "run", server.url, tiny_folder, steps=4, group=2)
    controller = _controller(recipe, tmp_path)
    with pytest.raises(RunFailed) as info:
        controller.run()
    message = str(info.value)
    assert "trainer stopped at step 3" in message
    assert "Tinker forward_backward (8 datums, " in message and "loss importance_sampling" in message
    assert "injected request failure" in message and "resume from the last checkpoint" in message
    assert server.count("fault:429") == 3 and server.count("fault:503") == 2  # answered, then retried
    assert [r["step"] for r in metrics_rows(tmp_path / "run") if "train/reward_mean" in r] == [1, 2]
    assert server.count("POST /api/v1/forward_backward") == 3  # the failed one was not sent twice
