"""Tool calls in a model's text (nexrl_core.tool_calls): the formats small models actually write."""

from __future__ import annotations

import json

import pytest

from nexrl_core.tool_calls import parse_tool_calls, render_tool_calls, tools_system_prompt


def args(call):
    return json.loads(call["function"]["arguments"])


def test_one_call_after_some_text():
    content, (call,) = parse_tool_calls('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": '
                                        '{"expression": "12 * 7"}}\n</tool_call>')
    assert content == "Let me compute."
    assert call["type"] == "function" and call["function"]["name"] == "calc" and args(call) == {"expression": "12 * 7"}
    assert "error" not in call and call["id"].startswith("call_")


def test_parallel_calls_keep_their_order_and_get_distinct_reproducible_ids():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"y": [1, 2]}}</tool_call>')
    _, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["a", "b"] and args(calls[1]) == {"y": [1, 2]}
    assert len({c["id"] for c in calls}) == 2
    assert [c["id"] for c in parse_tool_calls(text)[1]] == [c["id"] for c in calls]


@pytest.mark.parametrize("text,name,arguments", [
    ('<tool_call>{"name": "calc", "arguments": {"e": "1+1"}}', "calc", {"e": "1+1"}),  # never closed
    ('<tool_call>{"name": "calc", "parameters": {"e": "2"}}</tool_call>', "calc", {"e": "2"}),
    ('<tool_call>{"name": "calc", "arguments": "{\\"e\\": 3}"}</tool_call>', "calc", {"e": 3}),  # JSON string
    ("<tool_call>{'name': 'calc', 'arguments': {'ok': True, 'n': None}}</tool_call>", "calc", {"ok": True, "n": None}),
    ('<tool_call>\n```json\n{"name": "calc", "arguments": {"e": 4}}\n```\n</tool_call>', "calc", {"e": 4}),
    ('{"name": "calc", "arguments": {"e": 5}}', "calc", {"e": 5}),  # the whole reply is the call
])
def test_json_ish_variants_are_read(text, name, arguments):
    _, (call,) = parse_tool_calls(text)
    assert "error" not in call
    assert call["function"]["name"] == name and args(call) == arguments


@pytest.mark.parametrize("text,name,error", [
    ('<tool_call>{"name": "calc", "arguments": {"e": "1+1"</tool_call>', "calc",
     "not a JSON object with name and arguments"),
    ('<tool_call>{"name": "calc", "arguments": {"e": 1</tool_call>x', "calc", "not a JSON object"),
    ("<tool_call>calc(1+1)", "", "the <tool_call> block is not closed"),
    ('<tool_call>{"arguments": {"e": 1}}</tool_call>', "", 'the tool call has no "name"'),
    ('<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>', "calc", "the arguments of 'calc' are not a JSON"),
])
def test_malformed_calls_are_kept_with_an_error(text, name, error):
    _, (call,) = parse_tool_calls(text)
    assert call["function"]["name"] == name and error in call["error"]


def test_text_without_calls_is_left_alone():
    assert parse_tool_calls("The answer is 84.") == ("The answer is 84.", [])
    assert parse_tool_calls('{"answer": 84}') == ('{"answer": 84}', [])


def test_rendered_calls_parse_back():
    calls = [{"id": "x", "type": "function", "function": {"name": "calc", "arguments": '{"e": "2*3"}'}},
             {"id": "y", "type": "function", "function": {"name": "note", "arguments": {"t": "é"}}}]
    text = render_tool_calls(calls)
    assert text.startswith('<tool_call>\n{"name": "calc", "arguments": {"e": "2*3"}}\n</tool_call>')
    _, parsed = parse_tool_calls(text)
    assert [(c["function"]["name"], args(c)) for c in parsed] == [("calc", {"e": "2*3"}), ("note", {"t": "é"})]


def test_tools_system_prompt_lists_every_schema():
    tools = [{"type": "function", "function": {"name": "calc", "description": "Arithmetic.",
                                               "parameters": {"type": "object"}}}]
    prompt = tools_system_prompt(tools)
    assert json.dumps(tools[0]["function"]) in prompt and "<tool_call>" in prompt
