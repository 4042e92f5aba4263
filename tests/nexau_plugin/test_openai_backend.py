"""The `nexau` worker over HTTP: the core's OpenAI-compatible client against a real loopback
server that speaks vLLM's fields (token ids, log-probs, ``tools`` / ``message.tool_calls`` as
with the hermes tool parser). The trajectory must hold the server's own tokens and log-probs,
with the tool turn masked, whether the server parses the calls or leaves them in the text."""

from __future__ import annotations

import json
import re

import pytest
from omegaconf import OmegaConf

from nexrl_core.builtins.openai_client import OpenAICompatibleClient
from nexrl_core.launch.parts import build_module
from nexrl_nexau import DefaultNexAURolloutWorker
from tests.support.openai_server import FakeOpenAIServer, decode, encode, render_chat, token_logprob

from .scripted import Collect


def add_responder(question: str) -> str:
    """Calls add for "What is A + B?" (twice, in parallel, for "... twice"), answers with the
    tool results."""
    if question.startswith("tool: "):
        return f"It is {question[6:]}."
    a, b = map(int, re.findall(r"\d+", question)[:2])
    call = f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    return "Adding." + call * (2 if "twice" in question else 1)


@pytest.fixture
def server():
    with FakeOpenAIServer(model="m", responder=add_responder) as srv:
        yield srv


@pytest.fixture
def rollout(server, agent_factory, nexau_pm):
    """``rollout(prompt) -> trajectory`` from a worker whose inference client is the HTTP client."""
    client = OpenAICompatibleClient({"url": server.url, "model": "m", "retry_backoff": 0.01, "timeout": 5})
    config = OmegaConf.create({"type": "nexau", "nexau_agent_config_path": agent_factory(["add"]),
                               "agent_runner": "builtin", "evaluator": {"type": "numeric_answer"}, "seed": 3,
                               "sampling": {"max_tokens": 200, "temperature": 0.7}})
    worker = build_module(DefaultNexAURolloutWorker, config, pm=nexau_pm)
    pool = Collect()
    worker.set_module_references(pool, None, None, None, Collect(), client)

    def run(prompt: str, answer: int = 5):
        assert worker._run_task({"uid": "u", "sample_index": 0, "prompt": prompt, "answer": answer},
                                validating=False)
        return pool.items[-1]
    yield run
    client.close()


def chat_requests(server):
    return [r.body for r in server.requests if r.path.endswith("/chat/completions")]


@pytest.mark.parametrize("tool_parser", [True, False], ids=["server-parses-calls", "calls-in-text"])
def test_a_tool_call_over_http_becomes_one_masked_sequence_of_the_servers_tokens(server, rollout, tool_parser):
    server.tool_parser = tool_parser
    traj = rollout("What is 2 + 3?")
    assert traj["reward"] == 1.0 and traj["stop_reason"] == "answered" and traj["num_tool_calls"] == 1
    first, second = chat_requests(server)
    assert first["tools"][0]["function"]["name"] == "add" and first["seed"] != second["seed"]
    # the reply goes back once: as calls in OpenAI's shape when the server parsed them, as the
    # model's own text when the calls were read from it; then the tool's result
    reply, result = second["messages"][-2:]
    if tool_parser:
        assert reply["content"] == "Adding." and reply["tool_calls"][0]["function"] == \
            {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    else:
        assert reply["content"] == add_responder("What is 2 + 3?") and "tool_calls" not in reply
    assert result["role"] == "tool" and result["content"] == "5" and result["tool_call_id"]
    p0, p1 = encode(render_chat(first["messages"])), encode(render_chat(second["messages"]))
    r0, r1 = encode(add_responder("What is 2 + 3?")), encode("It is 5.")
    assert traj["num_segments"] == 1 and traj["prompt_token_ids"] == p0
    assert traj["response_token_ids"] == r0 + p1[len(p0) + len(r0):] + r1
    between = len(p1) - len(p0) - len(r0)
    assert traj["loss_mask"] == [1] * len(r0) + [0] * between + [1] * len(r1)
    assert decode(traj["response_token_ids"][len(r0):len(r0) + between]) == "\n<|tool|>\n5\n<|assistant|>\n"
    # log-probs as the server reported them; 0.0 where the server did not sample
    assert traj["response_logprobs"] == [token_logprob(j, t) for j, t in enumerate(r0)] + [0.0] * between + \
        [token_logprob(j, t) for j, t in enumerate(r1)]


def test_parallel_calls_over_http_run_and_answer_in_call_order(server, rollout):
    traj = rollout("What is 4 + 5 twice?", answer=9)
    assert traj["num_tool_calls"] == 2 and traj["reward"] == 1.0
    second = chat_requests(server)[1]["messages"]
    calls = second[-3]["tool_calls"]
    assert [c["id"] for c in calls] == ["chatcmpl-tool-0", "chatcmpl-tool-1"]  # the server's ids
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 4, "b": 5}] * 2
    assert [(m["role"], m["content"], m.get("tool_call_id")) for m in second[-2:]] == \
        [("tool", "9", "chatcmpl-tool-0"), ("tool", "9", "chatcmpl-tool-1")]
    assert traj["num_segments"] == 1 and traj["loss_mask"].count(0) > 0
