"""A span tree in the shape NexAU's in-memory tracer dumps, so one extractor reads both.

:meth:`TraceRecorder.dump` returns a list of root spans, each a dict with ``id``, ``name``,
``type`` (``AGENT``, ``SUB_AGENT``, ``LLM``, ``TOOL``), ``parent_id``, ``start_time``,
``end_time``, ``duration_ms``, ``inputs``, ``outputs``, ``attributes``, ``error`` and
``children`` (spans in the order they started). An ``LLM`` span holds the request in ``inputs``
(``messages``, ``tools`` and the sampling keys, as an OpenAI chat request) and the completion in
``outputs`` (an OpenAI chat completion: ``choices[0].message`` / ``finish_reason`` / ``usage``,
plus ``nexrl_train``: ``prompt_tokens``, ``response_tokens``, ``response_logprobs``, the token
data NexRL's inference service adds). A ``TOOL`` span holds ``{"parameters", "tool_call_id"}``
in ``inputs`` and ``{"result": ...}`` in ``outputs``.
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class Span:
    id: str
    name: str
    type: str
    parent_id: str | None
    start_time: float
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    attributes: dict[str, Any] = field(default_factory=dict)
    end_time: float | None = None
    error: str | None = None

    def set_outputs(self, outputs: Any) -> None:
        self.outputs = outputs if isinstance(outputs, dict) else {"result": outputs}

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attributes.update(attributes)


class TraceRecorder:
    """Records spans of one agent run (safe to use from several threads)."""

    def __init__(self) -> None:
        self._spans: dict[str, Span] = {}
        self._children: dict[str, list[str]] = {}
        self._roots: list[str] = []
        self._lock = threading.Lock()

    def start(self, name: str, span_type: str, inputs: dict[str, Any] | None = None,
              parent: Span | None = None, attributes: dict[str, Any] | None = None) -> Span:
        span = Span(str(uuid.uuid4()), name, span_type, parent.id if parent else None, time.time(),
                    dict(inputs or {}), {}, dict(attributes or {}))
        with self._lock:
            self._spans[span.id] = span
            if parent is None:
                self._roots.append(span.id)
            else:
                self._children.setdefault(parent.id, []).append(span.id)
        return span

    def end(self, span: Span, outputs: Any = None, error: BaseException | str | None = None) -> None:
        span.end_time = time.time()
        if outputs is not None:
            span.set_outputs(outputs)
        if error is not None:
            span.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"

    @contextmanager
    def span(self, name: str, span_type: str, inputs: dict[str, Any] | None = None, parent: Span | None = None,
             attributes: dict[str, Any] | None = None) -> Iterator[Span]:
        span = self.start(name, span_type, inputs, parent, attributes)
        try:
            yield span
        except BaseException as exc:
            self.end(span, error=exc)
            raise
        if span.end_time is None:
            self.end(span)

    def dump(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._to_dict(self._spans[i]) for i in self._roots]

    def _to_dict(self, span: Span) -> dict[str, Any]:
        duration = None if span.end_time is None else (span.end_time - span.start_time) * 1000.0
        return {"id": span.id, "name": span.name, "type": span.type, "parent_id": span.parent_id,
                "start_time": span.start_time, "end_time": span.end_time, "duration_ms": duration,
                "inputs": span.inputs, "outputs": span.outputs, "attributes": span.attributes, "error": span.error,
                "children": [self._to_dict(self._spans[c]) for c in self._children.get(span.id, [])]}
