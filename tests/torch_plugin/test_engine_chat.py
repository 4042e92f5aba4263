"""The in-process engine's chat(): tool schemas through the chat template or the system message,
tool calls read from the reply, and the single-turn path untouched."""

from __future__ import annotations

import json

import pytest

from nexrl_core import SamplingParams, as_text_messages
from nexrl_torch.rollout.engine import HFInferenceEngine
from tests.support.tiny_lm import build_byte_tokenizer, build_model

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two numbers.",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}},
                                               "required": ["a", "b"]}}}]
# A template that knows tools and tool calls (the Qwen/Hermes way, much shortened).
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def pair():
    tokenizer = build_byte_tokenizer()
    return build_model(tokenizer, max_positions=1024), tokenizer


@pytest.fixture()
def engine(pair):
    model, tokenizer = pair
    tokenizer.chat_template = build_byte_tokenizer().chat_template
    engine = HFInferenceEngine({}, model=model, tokenizer=tokenizer)
    yield engine
    engine.close()


def text_of(engine, ids):
    return engine.tokenizer.decode(ids, skip_special_tokens=False)


def test_without_tools_chat_is_complete(engine):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    a, b = engine.chat(messages, params), engine.complete(messages, params)
    assert (a.prompt_token_ids, a.response_token_ids, a.response_logprobs) == \
        (b.prompt_token_ids, b.response_token_ids, b.response_logprobs)
    assert a.tool_calls is None


def test_a_template_without_tool_support_gets_the_tools_in_the_system_message(engine):
    assert engine.template_tool_support() == (False, False)
    messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": "What is 2 + 3?"}]
    result = engine.chat(messages, SamplingParams(max_tokens=4, temperature=0), TOOLS)
    prompt = text_of(engine, result.prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nYou add.\n\n# Tools")
    assert json.dumps(TOOLS[0]["function"]) in prompt
    expected = engine.tokenizer.apply_chat_template(as_text_messages(messages, TOOLS), add_generation_prompt=True,
                                                    tokenize=False)
    assert result.prompt_token_ids == engine.tokenizer(expected, add_special_tokens=False).input_ids


def test_a_reply_with_calls_renders_back_to_the_tokens_it_was_sampled_as(engine):
    """The history's assistant message keeps the model's own text: the next prompt starts with
    the previous prompt + the reply's tokens (what prefix merging relies on)."""
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    first = [{"role": "user", "content": "What is 2 + 3?"}]
    p0 = engine.encode_chat(first, TOOLS)
    reply = engine.tokenizer(call_text, add_special_tokens=False).input_ids + [engine.tokenizer.eos_token_id]
    calls = [{"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]
    history = first + [{"role": "assistant", "content": call_text, "tool_calls": calls},
                       {"role": "tool", "tool_call_id": "c", "content": "5"}]
    p1 = engine.encode_chat(history, TOOLS)
    assert p1[: len(p0) + len(reply)] == p0 + reply
    assert text_of(engine, p1[len(p0) + len(reply):]) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    # a history message whose content lacks the calls (from another backend) gets them written out
    bare = first + [{"role": "assistant", "content": None, "tool_calls": calls}]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in \
        text_of(engine, engine.encode_chat(bare, TOOLS))


def test_a_template_with_tool_support_renders_tools_and_calls_itself(pair):
    model, tokenizer = pair
    tokenizer.chat_template = NATIVE_TEMPLATE
    engine = HFInferenceEngine({}, model=model, tokenizer=tokenizer)
    try:
        assert engine.template_tool_support() == (True, True)
        call_text = 'Adding.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        calls = [{"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]
        history = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": call_text, "tool_calls": calls},
                   {"role": "tool", "content": "5"}]
        text = text_of(engine, engine.encode_chat(history, TOOLS))
        assert text.startswith("<|im_start|>system\nTOOLS: add<|im_end|>")
        assert "# Tools" not in text
        # the template writes the call once, from tool_calls (the block is taken out of the content)
        assert text.count("<tool_call>") == 1 and "Adding.<tool_call>" in text
    finally:
        engine.close()
        tokenizer.chat_template = build_byte_tokenizer().chat_template
