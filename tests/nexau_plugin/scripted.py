"""A scripted chat backend for agent tests: real token plumbing, no model.

Prompts are rendered with a ChatML-style template and encoded character by character (the
template's markers are single tokens), so token ids are exact and reproducible: a multi-turn
history re-renders to the previous prompt + reply + the new messages, as a real chat template
does. A *policy* decides each reply: ``policy(messages, tools) -> text`` or ``(text, tool_calls)``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

SPECIALS = ["<|im_start|>", "<|im_end|>"]
EOS = 1  # id of <|im_end|>


def encode(text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
        for k, marker in enumerate(SPECIALS):
            if text.startswith(marker, i):
                ids.append(k)
                i += len(marker)
                break
        else:
            ids.append(10 + ord(text[i]))
            i += 1
    return ids


def decode(ids: list[int]) -> str:
    return "".join(SPECIALS[i] if i < len(SPECIALS) else chr(i - 10) for i in ids)


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    out = ""
    if tools:
        out += "<|im_start|>tools\n" + json.dumps(tools, sort_keys=True) + "<|im_end|>\n"
    for m in messages:
        out += f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


@dataclass
class Reply:
    """What an inference client's chat() returns (the fields the runner reads)."""

    text: str
    finish_reason: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    model_version: int = 0
    tool_calls: list[dict[str, Any]] | None = None


def tool_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id or f"call_{name}", "type": "function", "function": {"name": name, "arguments": args}}


@dataclass
class ScriptedChat:
    """``chat(messages, params, tools)`` of an inference client, driven by ``policy``.

    A reply longer than ``params.max_tokens`` tokens is cut there (``finish_reason: length``),
    as a real engine does. Records every request in ``requests``.
    """

    policy: Callable[..., Any]
    version: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def chat(self, messages: list[dict[str, Any]], params: Any, tools: list[dict[str, Any]] | None = None) -> Reply:
        with self._lock:
            self.requests.append({"messages": [dict(m) for m in messages], "tools": tools, "params": params})
        out = self.policy(messages, tools)
        text, calls = (out, None) if isinstance(out, str) else out
        prompt = encode(render(messages, tools))
        response = encode(text) + [EOS]
        finish = "stop"
        if len(response) > params.max_tokens:
            response, finish = response[: params.max_tokens], "length"
            text, calls = decode(response), None
        logprobs = [-0.01 * (1 + i % 7) for i in range(len(response))]
        return Reply(text, finish, prompt, response, logprobs, self.version, calls)

    # what a rollout worker asks its inference client besides chat()
    def get_model_tag(self) -> str:
        return "default"

    def model_version(self) -> int:
        return self.version
