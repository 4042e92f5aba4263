"""Tools bound by import string, called so that no tool can take a rollout down.

Whatever a tool does — raise, hang past its timeout, return something that is neither text nor
JSON, return megabytes — the agent gets a message saying so and the run goes on. A call whose
arguments do not fit the tool's ``input_schema`` never reaches the function.

A hung tool cannot be killed from Python: it is left running on its own daemon thread (counted in
:func:`abandoned_tool_threads`) and the agent is told it timed out.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from nexrl_core import ConfigError

from .agent_config import ToolSpec

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list, tuple), "object": (dict,), "null": (type(None),),
}
_path_lock = threading.Lock()


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


_abandoned = _Counter()


def abandoned_tool_threads() -> int:
    """Tool calls that timed out and are still running on their thread."""
    return _abandoned.value


def resolve_binding(binding: str, workspace: str, where: str) -> Callable[..., Any]:
    """The callable ``binding`` names: ``module.path:function`` (imported with ``workspace`` on
    ``sys.path``) or ``path/to/file.py:function`` (relative to ``workspace``)."""
    module_part, _, attr = binding.rpartition(":")
    if not module_part or not attr:
        raise ConfigError(f"{where}: binding: expected 'module:function', got {binding!r}")
    try:
        if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
            path = os.path.normpath(os.path.join(workspace, os.path.expanduser(module_part)))
            if not os.path.isfile(path):
                raise ConfigError(f"{where}: binding: {path} not found")
            name = "_nexrl_tool_" + hashlib.sha1(path.encode()).hexdigest()[:16]
            module = sys.modules.get(name)
            if module is None:
                spec = importlib.util.spec_from_file_location(name, path)
                if spec is None or spec.loader is None:
                    raise ConfigError(f"{where}: binding: {path} cannot be imported as a Python module")
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sys.modules[name] = module
        else:
            with _path_lock:
                if workspace and workspace not in sys.path:
                    sys.path.insert(0, workspace)  # later imports of the tool's own siblings need it too
            module = importlib.import_module(module_part)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any import failure is the recipe's problem, said in one line
        raise ConfigError(f"{where}: binding {binding!r}: cannot import {module_part} "
                          f"({type(exc).__name__}: {exc})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{where}: binding {binding!r}: {module_part} has no attribute '{attr}'")
    if not callable(fn):
        raise ConfigError(f"{where}: binding {binding!r}: '{attr}' is not callable")
    return fn


class BoundTool:
    """A :class:`ToolSpec` with its function (imported now, or at first use when ``lazy``)."""

    def __init__(self, spec: ToolSpec, workspace: str):
        self.spec = spec
        self._workspace = workspace
        self._where = f"tool '{spec.name}'"
        self._fn = None if spec.lazy else resolve_binding(spec.binding, workspace, self._where)
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.spec.name

    def function(self) -> Callable[..., Any]:
        with self._lock:
            if self._fn is None:
                self._fn = resolve_binding(self.spec.binding, self._workspace, self._where)
            return self._fn


def argument_problems(schema: dict[str, Any], arguments: Any) -> list[str]:
    """What keeps ``arguments`` from fitting ``schema`` (top-level ``required``, ``properties``
    types and ``enum``, ``additionalProperties: false``); empty when they fit."""
    if not isinstance(arguments, dict):
        return [f"arguments must be a JSON object, got {type(arguments).__name__}"]
    props = schema.get("properties") or {}
    out = [f"missing required argument '{k}'" for k in schema.get("required") or [] if k not in arguments]
    if schema.get("additionalProperties") is False:
        out += [f"unknown argument '{k}' (expected: {', '.join(props) or 'none'})" for k in arguments if k not in props]
    for key, value in arguments.items():
        prop = props.get(key)
        if not isinstance(prop, dict):
            continue
        types = prop.get("type")
        types = [types] if isinstance(types, str) else list(types or [])
        if types and not any(_is_json_type(value, t) for t in types):
            out.append(f"argument '{key}' must be {' or '.join(types)}, got {_json_type_name(value)}")
        if "enum" in prop and value not in prop["enum"]:
            out.append(f"argument '{key}' must be one of {prop['enum']}, got {value!r}")
    return out


def _is_json_type(value: Any, name: str) -> bool:
    kinds = _JSON_TYPES.get(name)
    if kinds is None:
        return True  # a type this check does not know: let the tool decide
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, kinds)


def _json_type_name(value: Any) -> str:
    for name, _kinds in _JSON_TYPES.items():
        if _is_json_type(value, name) and name != "number":
            return name
    return type(value).__name__


@dataclass
class ToolOutcome:
    """What one tool call gave the agent: ``content`` is the text it sees."""

    content: str
    ok: bool
    error_kind: str | None = None  # unknown_tool, bad_arguments, exception, timeout, bad_output
    duration_s: float = 0.0
    raw: Any = None  # the function's return value (None on error)


class _Call:
    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any]):
        self.fn, self.kwargs = fn, kwargs
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            value = self.fn(**self.kwargs)
            if inspect.iscoroutine(value):
                value = asyncio.run(value)
            self.value = value
        except BaseException as exc:  # noqa: BLE001 - reported to the agent, never raised
            self.error = exc
        finally:
            with self.lock:
                self.done.set()
                if self.abandoned:
                    _abandoned.add(-1)


class ToolExecutor:
    """Runs one model reply's tool calls (concurrently, each with ``timeout`` seconds)."""

    def __init__(self, tools: dict[str, BoundTool], timeout: float = 30.0, max_output_chars: int = 8000):
        self.tools = tools
        self.timeout = float(timeout)
        self.max_output_chars = int(max_output_chars)

    def run_all(self, calls: list[tuple[str, Any]]) -> list[ToolOutcome]:
        """Outcomes of ``(tool name, arguments)`` pairs, in order. Arguments that failed to parse
        arrive as a :class:`ValueError` and become an error message."""
        started: list[tuple[_Call | ToolOutcome, float]] = []  # a running call, or the outcome of one not run
        for name, arguments in calls:
            problem = self._problem(name, arguments)
            if problem is not None:
                started.append((problem, time.monotonic()))
                continue
            tool = self.tools[name]
            try:
                fn = tool.function()
            except ConfigError as exc:
                started.append((ToolOutcome(f"Error: tool '{name}' is unavailable: {exc}", False, "exception"),
                                time.monotonic()))
                continue
            call = _Call(fn, {**tool.spec.extra_kwargs, **arguments})
            threading.Thread(target=call.run, name=f"tool-{name}", daemon=True).start()
            started.append((call, time.monotonic()))
        return [item if isinstance(item, ToolOutcome) else self._finish(name, item, t0)
                for (name, _), (item, t0) in zip(calls, started)]

    def _problem(self, name: str, arguments: Any) -> ToolOutcome | None:
        if isinstance(arguments, ValueError) and not name:
            return ToolOutcome(f"Error: your tool call could not be read: {arguments}", False, "bad_arguments")
        if name not in self.tools:
            known = ", ".join(self.tools) or "none"
            return ToolOutcome(f"Error: there is no tool named '{name}' (available tools: {known})", False,
                               "unknown_tool")
        if isinstance(arguments, ValueError):
            return ToolOutcome(f"Error: the arguments of your call to '{name}' could not be read: {arguments}", False,
                               "bad_arguments")
        problems = argument_problems(self.tools[name].spec.input_schema, arguments)
        if problems:
            return ToolOutcome(f"Error: invalid arguments for '{name}': {'; '.join(problems)}", False,
                               "bad_arguments")
        return None

    def _finish(self, name: str, call: _Call, t0: float) -> ToolOutcome:
        finished = call.done.wait(max(0.0, t0 + self.timeout - time.monotonic()))
        duration = time.monotonic() - t0
        if not finished:
            with call.lock:
                if not call.done.is_set():
                    call.abandoned = True
                    _abandoned.add(1)
                    return ToolOutcome(f"Error: tool '{name}' did not finish within {self.timeout:g} seconds",
                                       False, "timeout", duration)
        if call.error is not None:
            exc = call.error
            return ToolOutcome(f"Error: tool '{name}' failed: {type(exc).__name__}: {_short(str(exc), 500)}", False,
                               "exception", duration)
        text, problem = self._render(call.value)
        if problem is not None:
            return ToolOutcome(f"Error: tool '{name}' {problem}", False, "bad_output", duration)
        is_error = isinstance(call.value, dict) and "error" in call.value  # NexAU tools report errors so
        return ToolOutcome(text, not is_error, "exception" if is_error else None, duration, call.value)

    def _render(self, value: Any) -> tuple[str, str | None]:
        if isinstance(value, str):
            text = value
        else:
            try:
                text = json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError) as exc:
                return "", f"returned a value of type {type(value).__name__} that is neither text nor JSON ({exc})"
        if "\x00" in text:
            return "", "returned text with NUL characters"
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + f"\n[... {len(text) - self.max_output_chars} more characters cut]"
        return text, None


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
