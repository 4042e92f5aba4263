"""Run the agent on NexAU itself (``rollout_worker.agent_runner: nexau``; needs the nexau package).

NexAU talks to its model over HTTP, so the adapter points the agent's ``llm_config`` at a
loopback :class:`~nexrl_nexau.gateway.ChatGateway` session that answers with the worker's
inference client (and its sampling parameters), and records the run with NexAU's own
``InMemoryTracer``. The gateway's answers carry ``nexrl_train`` token data, which NexAU's tracer
keeps in the LLM spans' outputs, so :func:`nexrl_nexau.trajectory.llm_calls` reads the trace as
it reads the built-in runner's. Why the run ended is read from the trace
(:func:`stop_reason_from_trace`).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import yaml

from .agent_config import AgentSpec
from .gateway import ChatGateway
from .runner import AgentRunResult, LLMCall
from .trajectory import iter_spans


def stop_reason_from_trace(trace: list[dict[str, Any]], max_iterations: int, error: str | None) -> str:
    """answered / max_iterations / truncated / error, from a finished run's spans."""
    if error:
        return "error"
    spans = [s for s in iter_spans(trace) if s.get("type") == "LLM"]
    done = [s for s in spans if s.get("outputs") and not s.get("error")]
    if not done:
        return "error"
    choice = ((done[-1]["outputs"].get("choices") or [{}])[0]) or {}
    if choice.get("finish_reason") == "length":
        return "truncated"
    if (choice.get("message") or {}).get("tool_calls") and len(spans) >= max_iterations:
        return "max_iterations"
    return "answered"


def observation_from_trace(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation: the last model call's request messages and its reply."""
    done = [s for s in iter_spans(trace) if s.get("type") == "LLM" and s.get("outputs") and not s.get("error")]
    if not done:
        return []
    last = done[-1]
    reply = ((last["outputs"].get("choices") or [{}])[0] or {}).get("message")
    return list((last.get("inputs") or {}).get("messages") or []) + ([reply] if reply else [])


def _tool_failed(span: dict[str, Any]) -> bool:
    result = (span.get("outputs") or {}).get("result")
    return bool(span.get("error")) or (isinstance(result, dict) and "error" in result)


class NexAUAgentRunner:
    """Same interface as :class:`~nexrl_nexau.runner.AgentRunner`; the agent runs on NexAU."""

    def __init__(self, spec: AgentSpec, tool_timeout: float = 30.0, few_shot: list[dict[str, Any]] | None = None):
        import nexau  # noqa: F401 - fail here, with the import error, when it is missing

        self.spec = spec
        self.few_shot = list(few_shot or [])  # handed to NexAU as the conversation's history
        self.tool_timeout = tool_timeout  # NexAU applies its own per-tool limits
        self._gateway: ChatGateway | None = None
        self._lock = threading.Lock()

    def _gateway_started(self) -> ChatGateway:
        with self._lock:
            if self._gateway is None:
                self._gateway = ChatGateway()
            return self._gateway

    def run(self, query: str | list[dict[str, Any]], llm: LLMCall, params: Any,
            variables: dict[str, Any] | None = None) -> AgentRunResult:
        from nexau import Agent, AgentConfig
        from nexau.archs.tracer.adapters.in_memory import InMemoryTracer

        gateway = self._gateway_started()
        with gateway.session(lambda m, t, p: llm(m, t, p), params) as base_url:
            # The agent's own llm_config names a server (or reads it from the environment): the
            # gateway replaces it before NexAU builds its LLM client.
            raw = yaml.safe_load(Path(self.spec.path).read_text(encoding="utf-8"))
            raw["llm_config"] = {"model": gateway.model_name, "base_url": base_url, "api_key": "nexrl",
                                 "temperature": params.temperature, "max_tokens": params.max_tokens,
                                 "top_p": params.top_p, "api_type": "openai_chat_completion", "stream": False}
            config = AgentConfig.from_dict(raw, base_path=Path(self.spec.path).parent)
            tracer = InMemoryTracer()
            config.tracers = [tracer]
            config.resolved_tracer = tracer
            agent = Agent(config=config)
            error = None
            try:
                response = agent.run(message=query, history=[dict(m) for m in self.few_shot] or None)
                final = response[0] if isinstance(response, tuple) else response
            except Exception as exc:  # noqa: BLE001 - the worker turns an error run into a failed item
                final, error = "", f"{type(exc).__name__}: {exc}"
            trace = tracer.dump_traces()
        stop = stop_reason_from_trace(trace, self.spec.max_iterations, error)
        llm_spans = [s for s in iter_spans(trace) if s.get("type") == "LLM"]
        tools = [s for s in iter_spans(trace) if s.get("type") == "TOOL"]
        errors = [s for s in tools if _tool_failed(s)]
        return AgentRunResult(final_answer=str(final or "") if stop != "max_iterations" else "", stop_reason=stop,
                              messages=observation_from_trace(trace), trace=trace, error=error,
                              num_llm_calls=len(llm_spans), num_tool_calls=len(tools), num_tool_errors=len(errors),
                              tool_errors={"exception": len(errors)} if errors else {})
