"""Tool calls written in a model's text: parsing them, and writing tools and calls for a prompt.

Backends that generate raw text (the in-process engine, any text-only server) read calls out of
the reply with :func:`parse_tool_calls`. The format is the one the chat templates of the
Qwen / Hermes / SmolLM families teach::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

Read robustly: several blocks (parallel calls); a last block the model never closed;
``"parameters"`` for ``"arguments"``; arguments given as a JSON string; Python-literal
dicts (single quotes, True/None); a reply that is nothing but one such JSON object. A block
that still cannot be read becomes a call with an ``"error"`` key (its ``arguments`` hold the raw
text), so the agent is told what was wrong instead of the call vanishing.

Calls come out in OpenAI's shape: ``{"id", "type": "function", "function": {"name",
"arguments": "<JSON text>"}}``.
"""

from __future__ import annotations

import ast
import json
import re
import zlib
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_NAME_HINT = re.compile(r"""["']name["']\s*:\s*["']([^"']+)["']""")


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``(text without the call blocks, calls)``; no calls: ``(text, [])``."""
    calls: list[dict[str, Any]] = []
    if "<tool_call>" in text:
        for match in _BLOCK.finditer(text):
            body, closed = match.group(1), bool(match.group(2))
            calls.append(_call_from(body, None if closed else "the <tool_call> block is not closed"))
        content = _BLOCK.sub("", text).strip()
    else:
        whole = _object(text.strip())
        if not (isinstance(whole, dict) and "name" in whole and ("arguments" in whole or "parameters" in whole)):
            return text, []
        content, calls = "", [_call_from(text.strip(), None)]
    # ids from the reply itself: the same text gets the same ids (reproducible runs)
    stem = f"{zlib.crc32(text.encode()):08x}"
    for i, call in enumerate(calls):
        call["id"] = f"call_{stem}_{i}"
    return content, calls


def _call_from(body: str, problem: str | None) -> dict[str, Any]:
    raw = body.strip()
    obj = _object(raw)
    if not isinstance(obj, dict):
        hint = _NAME_HINT.search(raw)
        return _call(hint.group(1) if hint else "", raw,
                     problem or f"the tool call is not a JSON object with name and arguments: {raw[:200]!r}")
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        parsed = _object(args)
        args = parsed if isinstance(parsed, dict) else args
    if not isinstance(name, str) or not name:
        return _call("", raw, "the tool call has no \"name\"")
    if not isinstance(args, dict):
        return _call(name, raw, f"the arguments of '{name}' are not a JSON object")
    return _call(name, json.dumps(args, ensure_ascii=False), None)  # complete JSON, closed or not


def _object(text: str) -> Any:
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:  # Python-literal spellings (single quotes, True/None) small models often write
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        return None


def _call(name: str, arguments: str, error: str | None) -> dict[str, Any]:
    call = {"id": "", "type": "function",
            "function": {"name": name, "arguments": arguments}}
    if error:
        call["error"] = error
    return call


def render_tool_calls(calls: list[dict[str, Any]]) -> str:
    """``calls`` (OpenAI shape) written as the ``<tool_call>`` blocks :func:`parse_tool_calls` reads."""
    blocks = []
    for call in calls:
        fn = call.get("function") or {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            parsed = _object(args)
            args = parsed if isinstance(parsed, dict) else args
        blocks.append("<tool_call>\n" + json.dumps({"name": fn.get("name", ""), "arguments": args},
                                                    ensure_ascii=False) + "\n</tool_call>")
    return "\n".join(blocks)


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """A system-prompt section offering ``tools`` (OpenAI ``tools`` entries), for chat templates
    that have no place for them."""
    lines = ["# Tools", "", "You can call these functions (JSON schemas, one per line):"]
    lines += [json.dumps(t.get("function", t), ensure_ascii=False) for t in tools]
    lines += ["", "To call one, reply with a <tool_call> block holding a JSON object with its name and "
              "arguments, for example:", "<tool_call>",
              '{"name": "function_name", "arguments": {"argument": "value"}}', "</tool_call>",
              "Use one block per call. The results come back in the next message. When you need no "
              "function, answer directly."]
    return "\n".join(lines)


def as_text_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     template_renders_calls: bool = False) -> list[dict[str, Any]]:
    """``messages`` for a chat template that has no place for tools: ``tools`` described in the
    system message (one is added when there is none), each assistant message's calls written
    into its content as ``<tool_call>`` blocks unless it holds them already (a reply kept as the
    model wrote it), contents never None. ``template_renders_calls``: the template writes
    ``tool_calls`` itself, so they are kept (arguments as objects, as templates want them) and
    blocks are taken out of the content instead."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if k != "tool_calls"}
        m["content"] = m.get("content") or ""
        calls = message.get("tool_calls") or []
        if message.get("role") == "assistant" and calls:
            if template_renders_calls:
                m["content"] = parse_tool_calls(m["content"])[0] if "<tool_call>" in m["content"] else m["content"]
                m["tool_calls"] = [_for_template(c) for c in calls]
            elif "<tool_call>" not in m["content"]:
                m["content"] = (m["content"] + "\n" + render_tool_calls(calls)).strip()
        out.append(m)
    if tools:
        section = tools_system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + section).strip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _for_template(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        parsed = _object(args)
        fn["arguments"] = parsed if isinstance(parsed, dict) else args
    return {"id": call.get("id", ""), "type": "function", "function": fn}
