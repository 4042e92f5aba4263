"""Trace -> LLM calls -> token sequences: prefix merge and loss masks, token by token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nexrl_nexau import TraceError, call_masks, llm_calls, token_sequences, truncate

EOS = 99


def llm(prompt, response, logprobs=None, *, message=None, finish="stop", version=0, vllm=False, error=None):
    """An LLM span as NexAU's tracer dumps it (token data as nexrl_train, or vLLM's fields)."""
    logprobs = [-0.1 * (i + 1) for i in range(len(response))] if logprobs is None else logprobs
    choice = {"index": 0, "message": message or {"role": "assistant", "content": "..."}, "finish_reason": finish}
    outputs = {"choices": [choice], "model_version": version}
    if vllm:
        choice["token_ids"] = response
        choice["logprobs"] = {"content": [{"token": f"t{t}", "logprob": lp} for t, lp in zip(response, logprobs)]}
        outputs["prompt_token_ids"] = prompt
    else:
        outputs["nexrl_train"] = {"prompt_tokens": prompt, "response_tokens": response, "response_logprobs": logprobs}
    return {"id": f"llm-{len(prompt)}-{len(response)}", "name": "chat", "type": "LLM",
            "inputs": {"messages": [{"role": "user", "content": "q"}], "tools": []},
            "outputs": {} if error else outputs, "error": error, "children": []}


def tool(name):
    return {"id": f"tool-{name}", "name": f"Tool: {name}", "type": "TOOL", "inputs": {"parameters": {}},
            "outputs": {"result": "r"}, "error": None, "children": []}


def agent(*children, kind="AGENT"):
    return {"id": "root", "name": "Agent: a", "type": kind, "inputs": {}, "outputs": {}, "error": None,
            "children": list(children)}


def sequences(trace, train=None, merge=True):
    infos = llm_calls(trace)
    masks = call_masks(infos, train if train is not None else [True] * len(infos))
    return infos, token_sequences(infos, masks, merge)


def test_multi_turn_merges_into_one_sequence_with_model_tokens_only_trained():
    # turn 0: prompt [1 2 3] -> reply [10 11 EOS]; tool result + template tokens [50 51 4]; turn 1 -> [12 EOS]
    trace = [agent(llm([1, 2, 3], [10, 11, EOS], [-.1, -.2, -.3]), tool("calc"),
                   llm([1, 2, 3, 10, 11, EOS, 50, 51, 4], [12, EOS], [-.4, -.5]))]
    infos, (seq,) = sequences(trace)
    assert [i["response_token_ids"] for i in infos] == [[10, 11, EOS], [12, EOS]]
    fields = seq.as_trajectory_fields()
    assert fields["prompt_token_ids"] == [1, 2, 3]
    assert fields["response_token_ids"] == [10, 11, EOS, 50, 51, 4, 12, EOS]
    assert fields["loss_mask"] == [1, 1, 1, 0, 0, 0, 1, 1]
    assert fields["response_logprobs"] == [-.1, -.2, -.3, 0.0, 0.0, 0.0, -.4, -.5]
    assert seq.calls == [0, 1] and not seq.truncated


def test_parallel_tool_calls_add_tool_tokens_that_are_never_trained():
    trace = [agent(llm([1, 2], [20, 21, EOS]), tool("a"), tool("b"),
                   llm([1, 2, 20, 21, EOS, 60, 61, 62, 70, 71, 5], [30, EOS]))]
    _, (seq,) = sequences(trace)
    f = seq.as_trajectory_fields()
    assert f["response_token_ids"] == [20, 21, EOS, 60, 61, 62, 70, 71, 5, 30, EOS]
    assert f["loss_mask"] == [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]


def test_a_broken_prefix_starts_a_new_sequence_and_a_later_turn_extends_the_right_one():
    # call 1 re-renders history differently (or is a sub-agent): new sequence; call 2 continues call 0's
    trace = [agent(llm([1, 2], [10, EOS]),
                   agent(llm([1, 7, 10], [11, EOS]), kind="SUB_AGENT"),
                   llm([1, 2, 10, EOS, 3], [12, EOS]))]
    _, seqs = sequences(trace)
    assert [s.calls for s in seqs] == [[0, 2], [1]]
    assert seqs[0].as_trajectory_fields()["loss_mask"] == [1, 1, 0, 1, 1]
    assert seqs[1].as_trajectory_fields() == {"prompt_token_ids": [1, 7, 10], "response_token_ids": [11, EOS],
                                              "response_logprobs": [-.1, -.2], "loss_mask": [1, 1]}
    # with merging off every call is its own sequence
    _, unmerged = sequences(trace, merge=False)
    assert [s.calls for s in unmerged] == [[0], [1], [2]]


def test_an_agent_that_never_answers_still_yields_every_turn():
    calls = []
    prompt = [1, 2]
    for turn in range(3):  # max_iterations reached: every reply was a tool call
        reply = [40 + turn, EOS]
        calls += [llm(list(prompt), reply, finish="tool_calls"), tool("loop")]
        prompt = prompt + reply + [80, 81]
    infos, (seq,) = sequences([agent(*calls)])
    f = seq.as_trajectory_fields()
    assert len(infos) == 3
    assert f["loss_mask"] == [1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert f["response_token_ids"] == [40, EOS, 80, 81, 41, EOS, 80, 81, 42, EOS]


def test_truncation_cuts_tokens_mask_and_logprobs_together():
    trace = [agent(llm([1, 2, 3], [10, 11, EOS]), llm([1, 2, 3, 10, 11, EOS, 50], [12, 13, 14], finish="length"))]
    _, (seq,) = sequences(trace)
    cut = truncate(seq, 8)
    assert cut.truncated and not seq.truncated
    f = cut.as_trajectory_fields()
    assert f["response_token_ids"] == [10, 11, EOS, 50, 12]
    assert f["loss_mask"] == [1, 1, 1, 0, 1] and len(f["response_logprobs"]) == 5
    assert truncate(seq, 100) is seq


def test_get_train_loss_mask_chooses_replies_or_single_tokens():
    trace = [agent(llm([1], [10, EOS]), llm([1, 10, EOS, 2], [11, 12, EOS]))]
    _, (seq,) = sequences(trace, train=[False, [1, 0, 1]])
    assert seq.as_trajectory_fields()["loss_mask"] == [0, 0, 0, 1, 0, 1]
    infos = llm_calls(trace)
    with pytest.raises(ValueError, match="one entry per LLM call"):
        call_masks(infos, [True])
    with pytest.raises(ValueError, match="call 1 has 3 response tokens but a mask of 2"):
        call_masks(infos, [True, [1, 1]])


def test_vllm_style_outputs_failed_calls_and_nested_spans():
    trace = [agent(llm([1, 2], [10, EOS], vllm=True),
                   llm([1, 2, 10, EOS, 3], [], error="RateLimitError: slow down"),  # failed: no completion
                   agent(llm([5], [6, EOS], vllm=True), kind="SUB_AGENT"))]
    infos = llm_calls(trace)
    assert [(i["prompt_token_ids"], i["response_token_ids"]) for i in infos] == [([1, 2], [10, EOS]), ([5], [6, EOS])]
    assert infos[0]["response_logprobs"] == [-0.1, -0.2]


def test_token_ids_written_as_token_id_strings_are_read():
    span = llm([1, 2], [10, 11], vllm=True)
    del span["outputs"]["choices"][0]["token_ids"]
    for item, tid in zip(span["outputs"]["choices"][0]["logprobs"]["content"], [10, 11]):
        item["token"] = f"token_id:{tid}"
    (info,) = llm_calls([agent(span)])
    assert info["response_token_ids"] == [10, 11]


@pytest.mark.parametrize("mutate,message", [
    (lambda o: o["nexrl_train"].pop("response_tokens"), "has no response token ids"),
    (lambda o: o["nexrl_train"].pop("prompt_tokens"), "has no prompt token ids"),
    (lambda o: o["nexrl_train"].update(response_logprobs=[-1.0]), "2 response tokens but 1 log-probs"),
    (lambda o: o["nexrl_train"].update(response_tokens=[10, "x"]), "response token ids are not a list"),
])
def test_unusable_token_data_is_a_trace_error_naming_the_call(mutate, message):
    span = llm([1, 2], [10, EOS])
    mutate(span["outputs"])
    with pytest.raises(TraceError, match=message) as info:
        llm_calls([agent(span)])
    assert "LLM call 0 (span llm-2-2)" in str(info.value)


def test_recorded_nexau_trace():
    """A trace in NexAU's dump format from an agent with a vLLM server (tokens in vLLM's fields):
    two turns around a tool call, then a final answer."""
    trace = json.loads((Path(__file__).parent / "data" / "nexau_trace.json").read_text())
    infos, (seq,) = sequences(trace)
    assert [i["finish_reason"] for i in infos] == ["tool_calls", "stop"]
    assert infos[0]["response_message"]["tool_calls"][0]["function"]["name"] == "calculator"
    assert infos[0]["tools"][0]["function"]["name"] == "calculator"
    f = seq.as_trajectory_fields()
    n0, n1 = len(infos[0]["response_token_ids"]), len(infos[1]["response_token_ids"])
    between = len(infos[1]["prompt_token_ids"]) - len(infos[0]["prompt_token_ids"]) - n0
    assert f["loss_mask"] == [1] * n0 + [0] * between + [1] * n1
    assert f["response_token_ids"][-n1:] == infos[1]["response_token_ids"]
