"""Trajectory -> Tinker datum, checked token by token."""

from __future__ import annotations

import numpy as np
import pytest

from nexrl_core import DataError
from nexrl_tinker.datums import build_datum, response_values, trajectory_to_datum, trajectory_to_datums

PROMPT = [11, 12, 13]
RESPONSE = [21, 22, 23, 24]


def _inputs(datum):
    return {k: v.to_numpy().tolist() for k, v in datum.loss_fn_inputs.items()}


def test_cross_entropy_datum_shifts_targets_and_weights_only_the_response():
    datum = build_datum(PROMPT, RESPONSE, "cross_entropy", loss_mask=[1, 1, 0, 1])
    assert datum.model_input.to_ints() == [11, 12, 13, 21, 22, 23]       # the full sequence minus its last token
    inputs = _inputs(datum)
    assert inputs["target_tokens"] == [12, 13, 21, 22, 23, 24]           # the full sequence minus its first token
    assert inputs["weights"] == [0, 0, 1, 1, 0, 1]                       # prompt targets 0, masked token 0
    assert set(inputs) == {"target_tokens", "weights"}
    # Position i of model_input predicts target i: every response token is predicted from the token before it.
    full = PROMPT + RESPONSE
    for i, target in enumerate(inputs["target_tokens"]):
        assert datum.model_input.to_ints()[i] == full[i] and target == full[i + 1]


def test_cross_entropy_weights_scale_the_response_tokens():
    datum = build_datum(PROMPT, RESPONSE, "cross_entropy", weights=[0.5, 1, 2, 0])
    assert _inputs(datum)["weights"] == [0, 0, 0.5, 1, 2, 0]


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_policy_gradient_datum_places_logprobs_and_advantages_on_the_response(loss_fn):
    lps = [-0.5, -1.0, -1.5, -2.0]
    datum = build_datum(PROMPT, RESPONSE, loss_fn, sampling_logprobs=lps, advantages=0.25, loss_mask=[1, 0, 1, 1])
    inputs = _inputs(datum)
    assert inputs["target_tokens"] == [12, 13, 21, 22, 23, 24]
    assert inputs["logprobs"] == [0, 0, -0.5, -1.0, -1.5, -2.0]          # the sampler's logprob of each target
    assert inputs["advantages"] == [0, 0, 0.25, 0, 0.25, 0.25]           # one advantage per response token
    assert set(inputs) == {"target_tokens", "logprobs", "advantages"}
    per_token = build_datum(PROMPT, RESPONSE, loss_fn, sampling_logprobs=lps, advantages=[1, 2, 3, 4])
    assert _inputs(per_token)["advantages"] == [0, 0, 1, 2, 3, 4]
    assert response_values(datum, datum.loss_fn_inputs["logprobs"], len(RESPONSE)).tolist() == lps


def test_one_token_prompt_and_one_token_response():
    datum = build_datum([5], [6], "importance_sampling", sampling_logprobs=[-0.1], advantages=1.0)
    assert datum.model_input.to_ints() == [5]
    assert _inputs(datum) == {"target_tokens": [6], "logprobs": [pytest.approx(-0.1)], "advantages": [1.0]}


def test_trajectory_keys_and_errors_name_the_trajectory():
    traj = {"uid": "u7", "sample_index": 2, "prompt_token_ids": PROMPT, "response_token_ids": RESPONSE,
            "response_logprobs": [-1.0] * 4, "advantages": -0.5, "loss_mask": [1, 1, 1, 0]}
    assert _inputs(trajectory_to_datum(traj, "ppo"))["advantages"] == [0, 0, -0.5, -0.5, -0.5, 0]
    cases = [
        ({"response_logprobs": [-1.0] * 3}, "response_logprobs has 3 values for 4 response tokens"),
        ({"response_logprobs": None}, "needs the rollout's response_logprobs"),
        ({"advantages": None}, "needs advantages"),
        ({"advantages": float("nan")}, "advantages is not finite"),
        ({"loss_mask": [1, 1]}, "loss_mask has 2 entries for 4 response tokens"),
        ({"response_token_ids": [], "loss_mask": None}, "empty response"),
        ({"prompt_token_ids": None}, "no prompt_token_ids"),
        ({"response_token_ids": [1, -2], "loss_mask": None, "response_logprobs": None}, "negative token id"),
    ]
    for change, message in cases:
        with pytest.raises(DataError, match=message) as info:
            trajectory_to_datum({**traj, **change}, "ppo")
        assert "trajectory u7#2" in str(info.value)
    with pytest.raises(DataError, match="not one of"):
        trajectory_to_datum(traj, "dpo")


def test_datum_trains_the_stand_in_on_exactly_the_response(make_standin, tokenizer):
    """Through the stand-in: the loss of a cross-entropy datum is the response tokens' negative logprobs."""
    import tinker

    from tests.tinker_plugin.helpers import API_KEY, MODEL

    standin = make_standin()
    client = tinker.ServiceClient(base_url=standin.url, api_key=API_KEY)
    try:
        training = client.create_lora_training_client(base_model=MODEL, rank=2, seed=0).result()
        prompt, response = tokenizer("what is two plus").input_ids, tokenizer(" three?").input_ids
        datum = build_datum(prompt, response, "cross_entropy")
        out = training.forward([datum], "cross_entropy").result()
    finally:
        client.close("success").result(timeout=30)
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    response_lps = response_values(datum, logprobs, len(response))
    assert out.metrics["loss:sum"] == pytest.approx(-float(np.sum(response_lps)), rel=1e-5)


def test_an_agent_rollout_of_two_sequences_gives_two_datums_with_their_masks():
    first = {"prompt_token_ids": PROMPT, "response_token_ids": RESPONSE, "response_logprobs": [-1.0] * 4,
             "loss_mask": [1, 0, 0, 1]}
    second = {"prompt_token_ids": [30, 31], "response_token_ids": [40, 41], "response_logprobs": [-2.0, -3.0],
              "loss_mask": [1, 1]}
    traj = {"uid": "a", "sample_index": 0, **first, "segments": [first, second], "advantages": 0.5}
    one, two = trajectory_to_datums(traj, "ppo")
    assert _inputs(one)["advantages"] == [0, 0, 0.5, 0, 0, 0.5]
    assert _inputs(two)["advantages"] == [0, 0.5, 0.5] and _inputs(two)["logprobs"] == [0, -2.0, -3.0]
    with pytest.raises(DataError, match="trajectory a#0 has 2 token sequences"):
        trajectory_to_datum(traj, "ppo")
    # per-token advantages run over both sequences' response tokens, end to end, each masked
    one, two = trajectory_to_datums({**traj, "advantages": [1, 2, 3, 4, 5, 6]}, "ppo")
    assert _inputs(one)["advantages"] == [0, 0, 1, 0, 0, 4] and _inputs(two)["advantages"] == [0, 5, 6]
    with pytest.raises(DataError, match=r"advantages has 4 values for the 6 response tokens of its 2 token sequences"):
        trajectory_to_datums({**traj, "advantages": [1, 2, 3, 4]}, "ppo")
    with pytest.raises(DataError, match="trajectory a#0 segment 1: loss_mask has 1 entries for 2 response tokens"):
        trajectory_to_datums({**traj, "segments": [first, {**second, "loss_mask": [1]}]}, "ppo")
