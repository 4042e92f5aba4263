"""InferenceClient.chat with tools: the OpenAI-compatible client against a real loopback server
(vLLM's tools / tool_calls fields), and the default for text-only backends (torch-free)."""

from __future__ import annotations

import json
import re

import pytest

from nexrl_core import CompletionResult, InferenceClient, InferenceError, SamplingParams
from nexrl_core.builtins.openai_client import OpenAICompatibleClient
from tests.support.openai_server import CHAT_PATH, FakeOpenAIServer, decode, encode, render_chat

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds.",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}}}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def agent_responder(question: str) -> str:
    """Calls add for "What is A + B?", answers with the tool's result."""
    if question.startswith("tool: "):
        return f"It is {question[6:]}."
    a, b = map(int, re.findall(r"\d+", question))
    return f'Adding.<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


@pytest.fixture
def server():
    with FakeOpenAIServer(model="m", responder=agent_responder) as srv:
        yield srv


@pytest.fixture
def client(server):
    c = OpenAICompatibleClient({"url": server.url, "model": "m", "retry_backoff": 0.01, "timeout": 5})
    yield c
    c.close()


def test_tools_are_sent_and_tool_calls_come_back_with_token_data(server, client):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    params = SamplingParams(max_tokens=200, temperature=0.7, seed=1)
    result = client.chat(messages, params, TOOLS)
    body = server.requests[-1].body
    assert body["tools"] == TOOLS
    assert result.text == "Adding."
    (call,) = result.tool_calls
    assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'} and call["id"] == "chatcmpl-tool-0"
    # the token ids are the generated tokens, markup included (what the model produced)
    assert decode(result.response_token_ids) == agent_responder("What is 2 + 3?")
    assert result.prompt_token_ids == encode(render_chat(messages))
    # second turn: the assistant message goes back with its calls, then the tool's result
    history = messages + [{"role": "assistant", "content": result.text, "tool_calls": result.tool_calls},
                          {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
    second = client.chat(history, params, TOOLS)
    assert second.text == "It is 5." and second.tool_calls is None
    sent = server.requests[-1].body["messages"]
    assert sent[1]["tool_calls"] == [{"id": "chatcmpl-tool-0", "type": "function",
                                      "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]


def test_a_server_without_a_tool_parser_gets_the_calls_read_from_the_text(server, client):
    server.tool_parser = False
    result = client.chat([{"role": "user", "content": "What is 4 + 5?"}], SamplingParams(max_tokens=200), TOOLS)
    assert result.text.startswith("Adding.<tool_call>")
    assert [json.loads(c["function"]["arguments"]) for c in result.tool_calls] == [{"a": 4, "b": 5}]
    # put back as the model wrote it: the server's template must not write the call a second time
    history = [{"role": "user", "content": "What is 4 + 5?"},
               {"role": "assistant", "content": result.text, "tool_calls": result.tool_calls},
               {"role": "tool", "tool_call_id": result.tool_calls[0]["id"], "content": "9"}]
    client.chat(history, SamplingParams(max_tokens=200), TOOLS)
    sent = server.requests[-1].body["messages"]
    assert sent[1] == {"role": "assistant", "content": result.text}
    assert render_chat(sent).count("<tool_call>") == 1


def test_without_tools_chat_sends_exactly_what_complete_sends(server, client):
    messages = [{"role": "user", "content": "What is 1 + 1?"}]
    a = client.chat(messages, SamplingParams(max_tokens=200, seed=3))
    b = client.complete(messages, SamplingParams(max_tokens=200, seed=3))
    first, second = [r.body for r in server.requests if r.path == CHAT_PATH]
    assert first == second and "tools" not in first
    assert (a.text, a.response_token_ids, a.tool_calls) == (b.text, b.response_token_ids, None)


def test_a_malformed_tool_calls_field_is_a_clear_error(server, client, monkeypatch):
    import tests.support.openai_server as fake

    monkeypatch.setattr(fake, "split_tool_calls", lambda text: ("x", [{"type": "function", "function": {}}]))
    with pytest.raises(InferenceError, match="a tool call has no function name"):
        client.chat([{"role": "user", "content": "What is 1 + 1?"}], SamplingParams(max_tokens=200), TOOLS)


class TextOnly(InferenceClient):
    """A backend that only takes text: renders the chat itself, answers from a script."""

    def __init__(self, replies):
        super().__init__({})
        self.replies, self.prompts = list(replies), []

    def complete(self, prompt, params):
        self.prompts.append(prompt)
        text = self.replies.pop(0)
        return CompletionResult(text=text, finish_reason="stop", prompt_token_ids=encode(render_chat(prompt)),
                                response_token_ids=encode(text), response_logprobs=[-0.5] * len(encode(text)))


def test_a_text_only_backend_gets_tools_in_the_system_message_and_calls_read_from_its_text():
    backend = TextOnly([CALL, "It is 5."])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    result = backend.chat(messages, SamplingParams(), TOOLS)
    system = backend.prompts[0][0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and '"name": "add"' in system
    assert result.text == CALL and result.tool_calls[0]["function"]["name"] == "add"
    history = messages + [{"role": "assistant", "content": result.text, "tool_calls": result.tool_calls},
                          {"role": "tool", "content": "5"}]
    second = backend.chat(history, SamplingParams(), TOOLS)
    assert second.tool_calls is None
    # the reply goes back as the model wrote it (its block is not written twice)
    assert backend.prompts[1][2]["content"].count("<tool_call>") == 1
    # no tools, no calls in the history: the messages go through untouched
    backend.replies.append("hi")
    backend.chat([{"role": "user", "content": "hello"}], SamplingParams())
    assert backend.prompts[-1] == [{"role": "user", "content": "hello"}]
