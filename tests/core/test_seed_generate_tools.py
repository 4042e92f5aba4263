"""The seed guide's ``self._llm_client.generate(messages, **kwargs)`` with ``tools=`` (issue #46 item
3): the tools reach the model (here: described in the system message, the default for a backend
without native tools) and the answer carries ``messages`` and the ``tool_calls`` read from the reply."""

from __future__ import annotations

import json

from nexrl_core import BaseRolloutWorker, hookimpl
from nexrl_core.builtins.mock import MockInferenceClient

TOOL = {"type": "function", "function": {"name": "add", "description": "add two numbers",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                                                         "b": {"type": "number"}}}}}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


class EchoRecorder(MockInferenceClient):
    """The mock model in echo mode (it answers the last user message), remembering what it was sent."""

    sent: list = []

    def complete(self, prompt, params):
        type(self).sent.append(prompt)
        return super().complete(prompt, params)


class SeedToolWorker(BaseRolloutWorker):
    """Written as the seed guide writes a worker: dicts in, dicts out."""

    answers: list = []

    def step(self, task):
        answer = self._llm_client.generate([{"role": "user", "content": CALL}], tools=[TOOL], max_tokens=256)
        type(self).answers.append(answer)
        return self._put_trajectory({"response": answer["response"], "reward": float(bool(answer["tool_calls"]))})


class Plugin:
    @hookimpl
    def nexrl_rollout_workers(self):
        return {"seed_tools": SeedToolWorker}

    @hookimpl
    def nexrl_inference_backends(self):
        return {"echo_recorder": EchoRecorder}


def test_generate_passes_tools_and_returns_tool_calls(nexrl_run):
    EchoRecorder.sent, SeedToolWorker.answers = [], []
    result = nexrl_run({"rollout_worker": {"type": "seed_tools", "num_workers": 1},
                        "service": {"inference_service": {"backend": "echo_recorder", "mode": "echo"}},
                        "trainer": {"total_train_steps": 1}}, Plugin())
    assert result.summary.global_step == 1 and result.errors == []
    answer = SeedToolWorker.answers[0]
    assert answer["messages"] == [{"role": "user", "content": CALL}]
    [call] = answer["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}
    assert answer["sampling"]["max_tokens"] == 256 and answer["response_token_ids"]
    system = EchoRecorder.sent[0][0]
    assert system["role"] == "system" and "add two numbers" in system["content"]  # the tools reached the model
    assert all(t["reward"] == 1.0 for t in result.trajectories)  # every reply's call was read
    # the base class filled in the tokens from the answer, as for completion()
    assert all(t["response_token_ids"] == list(t["response"].encode()) for t in result.trajectories)
