"""Inference clients: what a rollout worker talks to.

Every backend returns the response token ids and their logprobs (when the
server can give them) so training never re-tokenizes text.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    # Per-request seed: makes sampling reproducible whatever else is batched with it.
    seed: int | None = None


@dataclass
class CompletionResult:
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    response_logprobs: list[float] | None = None
    # Weight version that produced this completion (-1 when the backend cannot tell).
    model_version: int = -1
    # Tool calls of a chat reply (InferenceClient.chat with tools), OpenAI's shape: {"id", "type":
    # "function", "function": {"name", "arguments": JSON text}}; a call the backend could not read
    # out of the model's text also has an "error" key. None: no call.
    tool_calls: list[dict[str, Any]] | None = None


class InferenceError(RuntimeError):
    """An inference call failed for good (after retries) or got a bad answer."""


class InferenceClient(ABC):
    """One inference service as seen by rollout workers (shared by all of them).

    Constructed with the `service.inference_service` mapping of the recipe.
    Implementations must be safe to call from several threads at once.
    """

    def __init__(self, config: Any):
        self.config = config
        self.model_tag: str = str(_get(config, "model_tag", "default"))
        self._version = 0
        self._version_lock = threading.Lock()

    @abstractmethod
    def complete(self, prompt: str | list[dict[str, Any]], params: SamplingParams) -> CompletionResult:
        """Generate one completion for `prompt` (text, or chat messages)."""

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams,
             tools: list[dict[str, Any]] | None = None) -> CompletionResult:
        """One assistant reply to chat ``messages``, offered ``tools`` (OpenAI ``tools`` entries).

        The result's ``text`` is the reply as the model wrote it (an agent puts it back in the
        history as the assistant message's content) and ``tool_calls`` its calls. Without tools
        (and no tool calls in the history) this is :meth:`complete`. This default serves backends
        that only take text: the tools are described in the system message, calls already in the
        history are written out as ``<tool_call>`` blocks, and the reply's calls are read from its
        text (:func:`nexrl_core.tool_calls.parse_tool_calls`). Backends with native tool support
        override it.
        """
        if not tools and not any(m.get("tool_calls") for m in messages):
            return self.complete(messages, params)
        from .tool_calls import as_text_messages, parse_tool_calls

        result = self.complete(as_text_messages(messages, tools), params)
        if tools:
            result.tool_calls = parse_tool_calls(result.text)[1] or None
        return result

    def completion(self, prompt: str | list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        """The seed's dict-shaped call: sampling keys as keyword arguments."""
        known = {k: kwargs.pop(k) for k in list(kwargs) if k in SamplingParams.__dataclass_fields__}
        result = self.complete(prompt, SamplingParams(**known))
        return {"prompt": prompt, "response": result.text, "finish_reason": result.finish_reason,
                "prompt_token_ids": result.prompt_token_ids, "response_token_ids": result.response_token_ids,
                "response_logprobs": result.response_logprobs, "model_version": result.model_version, **kwargs}

    def get_model_tag(self) -> str:
        return self.model_tag

    def model_version(self) -> int:
        with self._version_lock:
            return self._version

    def set_model_version(self, version: int) -> None:
        with self._version_lock:
            self._version = version

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Serve `state_dict` from now on (in-process engines only)."""
        raise NotImplementedError(f"{type(self).__name__} cannot load weights in process")

    def health_check(self) -> bool:
        return True

    def close(self) -> None:
        pass


def _get(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default) if not hasattr(config, "get") else config.get(key, default)
