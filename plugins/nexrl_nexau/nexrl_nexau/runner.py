"""nexrl's own agent runner: reads NexAU's agent YAML, records NexAU's trace shape.

One run: system prompt + the task's query -> (model reply -> tool calls -> tool results)* -> the
final answer. Every model reply is one ``LLM`` span holding the request and the completion with
its token ids and log-probs as the inference client returned them; every tool call is a
``TOOL`` span. The run ends, and :attr:`AgentRunResult.stop_reason` says why:

- ``answered``: a reply without tool calls (its text is the final answer), or a successful call
  of one of the agent's ``stop_tools`` (its result is the final answer);
- ``max_iterations``: the agent was still calling tools after ``max_iterations`` model calls
  (final answer: empty);
- ``truncated``: a reply was cut at ``max_tokens`` (its calls are not run), or prompt + reply
  reached ``max_context_tokens``;
- ``error``: the inference call failed (``error`` says how).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import uuid
import zlib
from dataclasses import dataclass, field
from datetime import date
from typing import Any, Callable

from . import xml_calls
from .agent_config import AgentSpec
from .tools import BoundTool, ToolExecutor
from .tracer import Span, TraceRecorder

STOP_REASONS = ("answered", "max_iterations", "truncated", "error")

# (messages, tool schemas or None, sampling params) -> the client's CompletionResult
LLMCall = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None", Any], Any]


@dataclass
class AgentRunResult:
    final_answer: str
    stop_reason: str
    messages: list[dict[str, Any]]  # the whole conversation (NexAU's "observation")
    trace: list[dict[str, Any]]
    error: str | None = None
    num_llm_calls: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)  # by kind: bad_arguments, timeout, ...


class AgentRunner:
    """Runs one agent (an :class:`AgentSpec`) against an inference client; safe to share
    between threads (every :meth:`run` keeps its own state)."""

    def __init__(self, spec: AgentSpec, tool_timeout: float = 30.0, max_tool_output_chars: int = 8000,
                 few_shot: list[dict[str, Any]] | None = None):
        self.spec = spec
        self.few_shot = copy.deepcopy(list(few_shot or []))  # demonstration turns between system prompt and query
        self.tools = {t.name: BoundTool(t, spec.workspace) for t in spec.tools}
        self.executor = ToolExecutor(self.tools, tool_timeout, max_tool_output_chars)
        self._schemas = [t.openai_schema() for t in spec.tools]

    def system_prompt(self, variables: dict[str, Any] | None = None) -> str | None:
        prompt = self.spec.system_prompt
        if prompt is not None and self.spec.system_prompt_type == "jinja":
            import jinja2

            env = jinja2.Environment(undefined=jinja2.StrictUndefined)
            prompt = env.from_string(prompt).render({"date": date.today().isoformat(), **(variables or {})})
        if self.spec.tool_call_mode == "xml":
            prompt = (prompt or "") + xml_calls.tools_prompt(self.spec.tools)
        return prompt

    def run(self, query: str | list[dict[str, Any]], llm: LLMCall, params: Any,
            variables: dict[str, Any] | None = None) -> AgentRunResult:
        """Run the agent on ``query`` (a user message, or the opening messages), sampling every
        reply with ``params`` (a :class:`nexrl_core.SamplingParams`; each call gets its own seed)."""
        trace = TraceRecorder()
        system = self.system_prompt(variables)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        messages += copy.deepcopy(self.few_shot)
        messages += [{"role": "user", "content": query}] if isinstance(query, str) else copy.deepcopy(list(query))
        state = _RunState()
        root = trace.start(f"Agent: {self.spec.name}", "AGENT",
                           {"message": query if isinstance(query, str) else messages[-1].get("content"),
                            "agent_id": uuid.uuid4().hex},
                           attributes={"agent_name": self.spec.name})
        stop_reason, final, error = "max_iterations", "", None
        for iteration in range(self.spec.max_iterations):
            reply, assistant, calls, error = self._call_llm(trace, root, messages, llm, params, iteration, state)
            if error is not None:
                stop_reason = "error"
                break
            messages.append(assistant)
            if reply.finish_reason == "length":
                stop_reason, final = "truncated", assistant.get("content") or ""
                break
            if not calls:
                stop_reason, final = "answered", assistant.get("content") or ""
                break
            if self._context_full(reply):
                stop_reason = "truncated"
                break
            answer = self._run_tools(trace, root, messages, assistant, calls, state)
            if answer is not None:
                stop_reason, final = "answered", answer
                break
        trace.end(root, {"response": final}, error)
        root.set_attributes({"stop_reason": stop_reason, "iterations": state.llm_calls})
        return AgentRunResult(final, stop_reason, messages, trace.dump(), error, state.llm_calls, state.tool_calls,
                              sum(state.tool_errors.values()), dict(state.tool_errors))

    # -- one model call ---------------------------------------------------------------------
    def _call_llm(self, trace: TraceRecorder, root: Span, messages: list[dict[str, Any]], llm: LLMCall, params: Any,
                  iteration: int, state: "_RunState") -> tuple[Any, dict[str, Any], list, str | None]:
        call_params = dataclasses.replace(params, seed=_seed(params.seed, iteration))
        tools = self._schemas if self.spec.tool_call_mode == "structured" and self._schemas else None
        inputs = {"messages": copy.deepcopy(messages), **({"tools": tools} if tools else {}),
                  **_sampling_record(call_params)}
        span = trace.start("chat.completions", "LLM", inputs, root)
        state.llm_calls += 1
        try:
            reply = llm(messages, tools, call_params)
        except Exception as exc:  # noqa: BLE001 - the run ends with the reason; the worker decides
            trace.end(span, error=exc)
            return None, {}, [], f"inference failed: {type(exc).__name__}: {exc}"
        assistant, calls = self._assistant_message(reply)
        prompt_ids, response_ids = reply.prompt_token_ids, reply.response_token_ids
        trace.end(span, {
            "choices": [{"index": 0, "message": assistant,
                         "finish_reason": "length" if reply.finish_reason == "length" else
                         "tool_calls" if calls else "stop"}],
            "usage": {"prompt_tokens": len(prompt_ids or []), "completion_tokens": len(response_ids or []),
                      "total_tokens": len(prompt_ids or []) + len(response_ids or [])},
            "nexrl_train": {"prompt_tokens": prompt_ids, "response_tokens": response_ids,
                            "response_logprobs": reply.response_logprobs},
            "model_version": reply.model_version,
        })
        return reply, assistant, calls, None

    def _assistant_message(self, reply: Any) -> tuple[dict[str, Any], list[tuple[str, Any, str]]]:
        """The reply as a chat message, and its calls as ``(name, arguments or ValueError, id)``."""
        text = reply.text or ""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.spec.tool_call_mode == "xml":
            return message, [(n, a, "") for n, a in xml_calls.parse_calls(text, {t.name: t for t in self.spec.tools})]
        raw_calls = list(getattr(reply, "tool_calls", None) or [])
        if raw_calls:
            message["tool_calls"] = copy.deepcopy(raw_calls)
        return message, [_structured_call(c, i) for i, c in enumerate(raw_calls)]

    def _context_full(self, reply: Any) -> bool:
        limit = self.spec.max_context_tokens
        used = len(reply.prompt_token_ids or []) + len(reply.response_token_ids or [])
        return limit is not None and used >= limit

    # -- tools --------------------------------------------------------------------------------
    def _run_tools(self, trace: TraceRecorder, root: Span, messages: list[dict[str, Any]],
                   assistant: dict[str, Any], calls: list[tuple[str, Any, str]], state: "_RunState") -> str | None:
        spans = [trace.start(f"Tool: {name}", "TOOL",
                             {"parameters": args if isinstance(args, dict) else None, "tool_call_id": call_id},
                             root) for name, args, call_id in calls]
        outcomes = self.executor.run_all([(name, args) for name, args, _ in calls])
        answer = None
        for (name, _, _), span, outcome in zip(calls, spans, outcomes):
            trace.end(span, {"result": outcome.content}, None if outcome.ok else outcome.content)
            span.set_attributes({"duration_s": outcome.duration_s, "error_kind": outcome.error_kind})
            state.tool_calls += 1
            if outcome.error_kind is not None:  # set exactly when the call failed
                state.tool_errors[outcome.error_kind] = state.tool_errors.get(outcome.error_kind, 0) + 1
            elif name in self.spec.stop_tools and answer is None:
                answer = outcome.content
        if self.spec.tool_call_mode == "xml":
            messages.append(xml_calls.results_message([c[0] for c in calls], [o.content for o in outcomes]))
        else:
            for (name, _, call_id), outcome in zip(calls, outcomes):
                messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": outcome.content})
        return answer


@dataclass
class _RunState:
    llm_calls: int = 0
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)


def _structured_call(call: Any, index: int) -> tuple[str, Any, str]:
    """An OpenAI ``tool_calls`` entry as ``(name, parsed arguments or ValueError, id)``."""
    if not isinstance(call, dict):
        return "", ValueError(f"tool call {index} is not an object"), f"call_{index}"
    function = call.get("function")
    fn = function if isinstance(function, dict) else {}
    name = str(fn.get("name") or "")
    call_id = str(call.get("id") or f"call_{index}")
    if call.get("error"):  # the backend could not read the call out of the model's text
        return name, ValueError(str(call["error"])), call_id
    args = fn.get("arguments")
    if isinstance(args, dict):
        return name, args, call_id
    if args is None or (isinstance(args, str) and not args.strip()):
        return name, {}, call_id
    try:
        parsed = json.loads(args)
    except (TypeError, ValueError) as exc:
        return name, ValueError(f"arguments are not valid JSON ({exc}): {str(args)[:120]!r}"), call_id
    return name, parsed, call_id


def _seed(seed: int | None, iteration: int) -> int | None:
    """A distinct, reproducible seed per model call of one run."""
    if seed is None or iteration == 0:
        return seed
    return zlib.crc32(f"{seed}|{iteration}".encode())


def _sampling_record(params: Any) -> dict[str, Any]:
    return {k: v for k, v in params.as_record().items() if v is not None}
