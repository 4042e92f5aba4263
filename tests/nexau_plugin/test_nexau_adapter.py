"""Running agents on NexAU itself: the loopback chat gateway (always), the real NexAU run (when
the nexau package is importable; it is not on PyPI)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from omegaconf import OmegaConf

from nexrl_core import SamplingParams
from nexrl_core.launch.parts import build_module
from nexrl_nexau import llm_calls
from nexrl_nexau.gateway import ChatGateway
from nexrl_nexau.nexau_adapter import observation_from_trace, stop_reason_from_trace
from nexrl_nexau.worker import _nexau_importable

from .scripted import ScriptedChat, decode, tool_call

NEXAU = _nexau_importable()


@pytest.fixture
def gateway():
    gw = ChatGateway()
    yield gw
    gw.close()


def test_the_gateway_answers_an_openai_client_with_token_data(gateway):
    def policy(messages, tools):
        return ("", [tool_call("add", {"a": 1, "b": 2}, "c1")]) if len(messages) == 1 else "3"

    client_backend = ScriptedChat(policy, version=7)
    params = SamplingParams(max_tokens=500, temperature=0.5, seed=11)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with gateway.session(lambda m, t, p: client_backend.chat(m, p, t), params) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["nexrl-policy"]
        raw = client.chat.completions.with_raw_response.create(
            model="anything", messages=[{"role": "user", "content": "1+2?"}], tools=tools, temperature=1.3)
        body = json.loads(raw.text)
        first = raw.parse()
        second = client.chat.completions.create(model="m", messages=[
            {"role": "user", "content": "1+2?"}, first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": "c1", "content": "3"}])
    assert first.choices[0].finish_reason == "tool_calls"
    assert first.choices[0].message.tool_calls[0].function.name == "add"
    assert second.choices[0].message.content == "3"
    # the worker's sampling holds (not the request's temperature); every call has its own seed
    requests = client_backend.requests
    assert [r["params"].temperature for r in requests] == [0.5, 0.5]
    assert requests[0]["params"].seed == 11 and requests[1]["params"].seed != 11
    assert requests[0]["tools"] == tools
    # token data for training, in NexRL's and vLLM's fields; the extractor reads the completion
    assert body["model_version"] == 7
    assert body["nexrl_train"]["response_tokens"] == body["choices"][0]["token_ids"]
    assert decode(body["nexrl_train"]["response_tokens"]).endswith("<|im_end|>")
    span = {"type": "LLM", "id": "s", "inputs": {"messages": []}, "outputs": body, "children": []}
    (info,) = llm_calls([span])
    assert info["response_logprobs"] == body["nexrl_train"]["response_logprobs"]


def test_a_closed_session_is_not_served(gateway):
    with gateway.session(lambda m, t, p: None, SamplingParams()) as base_url:
        pass
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_an_inference_failure_is_a_server_error_for_the_agent(gateway):
    def broken(m, t, p):
        raise ConnectionError("backend down")

    with gateway.session(broken, SamplingParams()) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="backend down"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_stop_reason_and_observation_from_a_recorded_nexau_trace():
    trace = json.loads((Path(__file__).parent / "data" / "nexau_trace.json").read_text())
    assert stop_reason_from_trace(trace, max_iterations=10, error=None) == "answered"
    assert stop_reason_from_trace(trace, max_iterations=10, error="boom") == "error"
    observation = observation_from_trace(trace)
    assert [m["role"] for m in observation] == ["system", "user", "assistant", "tool", "assistant"]
    # the same trace cut after its first (tool-calling) call, at max_iterations=1
    first_only = [dict(trace[0], children=trace[0]["children"][:2])]
    assert stop_reason_from_trace(first_only, max_iterations=1, error=None) == "max_iterations"


@pytest.mark.skipif(not NEXAU, reason="the nexau package is not importable here (NexAU is not on PyPI: install it "
                                      "from github.com/nex-agi/NexAU to run this test)")
def test_the_worker_runs_the_real_nexau_agent(agent_factory, nexau_pm):
    from nexrl_nexau import DefaultNexAURolloutWorker

    path = agent_factory(["add"])

    def policy(messages, tools):
        last = messages[-1]
        return ("", [tool_call("add", {"a": 2, "b": 3}, "c0")]) if last["role"] == "user" else f"It is {last['content']}."

    backend = ScriptedChat(policy)
    config = OmegaConf.create({"type": "nexau", "nexau_agent_config_path": path, "agent_runner": "nexau",
                               "evaluator": {"type": "numeric_answer"}, "sampling": {"max_tokens": 400}})
    worker = build_module(DefaultNexAURolloutWorker, config)
    assert worker.runner_kind == "nexau"

    class Pool:
        items = []

        def put_trajectory(self, t):
            self.items.append(t)
            return "success"

    pool = Pool()
    worker.set_module_references(pool, None, None, None, pool, backend)
    worker._run_task({"uid": "u", "sample_index": 0, "prompt": "What is 2 + 3?", "answer": 5}, validating=False)
    (traj,) = pool.items
    assert not traj.get("failed"), traj.get("error")
    assert traj["reward"] == 1.0 and traj["stop_reason"] == "answered" and traj["num_llm_calls"] == 2
    assert sum(traj["loss_mask"]) < len(traj["loss_mask"])  # the tool's tokens are masked
    # NexAU sent the call and its result back; the two turns merged into one sequence
    assert [m["role"] for m in backend.requests[1]["messages"]] == ["system", "user", "assistant", "tool"]
    assert traj["num_tool_calls"] == 1 and traj["num_segments"] == 1 and "segments" not in traj
