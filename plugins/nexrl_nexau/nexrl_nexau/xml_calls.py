"""``tool_call_mode: xml``: tools described in the system prompt, calls written as XML in the reply.

The format is NexAU's::

    <tool_use>
      <tool_name>calculator</tool_name>
      <parameter>
        <expression>12 * 7</expression>
      </parameter>
    </tool_use>

Several calls go in one ``<use_parallel_tool_calls>`` block of ``<parallel_tool>`` entries.
Parameter values are text, converted by the tool's ``input_schema`` type (integer, number,
boolean; array and object as JSON).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .agent_config import ToolSpec

_BLOCK = re.compile(r"<(tool_use|parallel_tool)>(.*?)(?:</\1>|$)", re.DOTALL)
_NAME = re.compile(r"<tool_name>\s*(.*?)\s*</tool_name>", re.DOTALL)
_PARAMS = re.compile(r"<parameter>(.*?)</parameter>", re.DOTALL)
_PARAM = re.compile(r"<([A-Za-z_][\w.-]*)>(.*?)</\1>", re.DOTALL)


def tools_prompt(tools: list[ToolSpec]) -> str:
    """The system-prompt section that tells the model its tools and the call format."""
    if not tools:
        return ""
    lines = ["", "## Available tools", "Call a tool by writing an XML block in your reply, then stop and wait "
             "for its result:"]
    for tool in tools:
        lines += ["", f"### {tool.name}", tool.description.strip(), "<tool_use>",
                  f"  <tool_name>{tool.name}</tool_name>", "  <parameter>"]
        required = set(tool.input_schema.get("required") or [])
        for name, prop in (tool.input_schema.get("properties") or {}).items():
            prop = prop if isinstance(prop, dict) else {}
            kind = prop.get("type", "string")
            need = "required" if name in required else "optional"
            lines.append(f"    <{name}>{prop.get('description', '')} ({need}, {kind})</{name}>")
        lines += ["  </parameter>", "</tool_use>"]
    lines += ["", "To call several tools at once, put one <parallel_tool> block per call (same inside as "
              "<tool_use>) in a <use_parallel_tool_calls> block.",
              "When you need no more tools, answer without any tool block."]
    return "\n".join(lines)


def parse_calls(text: str, tools: dict[str, ToolSpec]) -> list[tuple[str, Any]]:
    """``(tool name, arguments)`` for each call block in ``text``; arguments that cannot be read
    (an unclosed block, a value of the wrong type) come as a ValueError the agent is shown."""
    calls: list[tuple[str, Any]] = []
    for match in _BLOCK.finditer(text):
        tag, body = match.group(1), match.group(2)
        name_match = _NAME.search(body)
        name = name_match.group(1).strip() if name_match else ""
        if not match.group(0).endswith(f"</{tag}>"):
            calls.append((name, ValueError(f"the <{tag}> block is not closed")))
            continue
        if not name:
            calls.append(("", ValueError(f"the <{tag}> block has no <tool_name>")))
            continue
        params = _PARAMS.search(body)
        raw = {k: v for k, v in _PARAM.findall(params.group(1))} if params else {}
        spec = tools.get(name)
        calls.append((name, _convert(raw, spec.input_schema if spec else {})))
    return calls


def results_message(names: list[str], contents: list[str]) -> dict[str, Any]:
    """The user message that hands a reply's tool results back in xml mode."""
    blocks = [f"<tool_result>\n<tool_name>{n}</tool_name>\n<result>\n{c}\n</result>\n</tool_result>"
              for n, c in zip(names, contents)]
    return {"role": "user", "content": "\n".join(blocks)}


def _convert(raw: dict[str, str], schema: dict[str, Any]) -> dict[str, Any] | ValueError:
    props = schema.get("properties") or {}
    out: dict[str, Any] = {}
    for key, text in raw.items():
        kind = (props.get(key) or {}).get("type", "string") if isinstance(props.get(key), dict) else "string"
        value = text.strip()
        try:
            if kind == "integer":
                out[key] = int(value)
            elif kind == "number":
                out[key] = float(value)
            elif kind == "boolean":
                if value.lower() not in ("true", "false"):
                    raise ValueError(value)
                out[key] = value.lower() == "true"
            elif kind in ("array", "object"):
                out[key] = json.loads(value)
            else:
                out[key] = value
        except ValueError:
            return ValueError(f"parameter '{key}' should be {kind}, got {value[:80]!r}")
    return out
