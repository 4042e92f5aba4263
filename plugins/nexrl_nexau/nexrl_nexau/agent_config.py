"""The agent YAML that NexAU reads, loaded for nexrl's own agent runner.

Agent file (NexAU's keys)::

    type: agent
    name: calculator_agent
    system_prompt: "You solve arithmetic word problems ..."
    system_prompt_type: string        # string | file (path next to this YAML) | jinja
    max_iterations: 6                 # LLM calls before the run is cut off (NexAU's default: 100)
    max_context_tokens: 2048          # prompt + reply tokens of one call; past it the run ends "truncated"
    tool_call_mode: structured        # structured (openai / anthropic: aliases) | xml
    stop_tools: [final_answer]        # a call to one of these ends the run; its result is the answer
    llm_config:                       # sampling defaults (the recipe's rollout_worker.sampling wins)
      temperature: 0.7
      max_tokens: 256
    tools:
      - name: calculator              # the name the model calls
        yaml_path: ./tools/calculator.yaml
        binding: calculator_tools:calculate     # "module:function" or "path/to/file.py:function"
        extra_kwargs: {precision: 6}  # passed to the function with every call

Tool file::

    type: tool
    name: Calculator
    description: Evaluates an arithmetic expression.
    input_schema: {type: object, properties: {expression: {type: string}}, required: [expression]}

Paths are relative to the file that names them. ``llm_config`` keys that choose a server
(``model``, ``base_url``, ``api_key``, ``api_type``, ``extra_body``, ...) have no effect here: the
worker samples from the recipe's inference service. ``tracers`` too: the runner always records
its trace. Keys that would change what the agent does but that this runner does not implement
(sub-agents, skills, MCP servers, hooks, middlewares, sandboxes) are an error that names them:
run such an agent with ``agent_runner: nexau``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from nexrl_core import ConfigError, SamplingParams

TOOL_CALL_MODES = {"structured": "structured", "openai": "structured", "anthropic": "structured", "xml": "xml"}
# The llm_config keys that are sampling parameters: those of the core's SamplingParams (seed is per request).
SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "seed")
# llm_config keys that pick or tune a server connection: meaningful to NexAU, not to a worker that
# samples from the recipe's inference service.
CONNECTION_KEYS = {"model", "base_url", "api_key", "api_type", "extra_body", "logprobs", "timeout", "max_retries",
                   "debug", "stream", "additional_drop_params", "cache_control_ttl", "tokenizer_path",
                   "stream_idle_timeout_ms", "connect_timeout_ms", "tool_streaming", "allow_unsigned_thinking",
                   "frequency_penalty", "presence_penalty", "top_logprobs", "parallel_tool_calls"}
_AGENT_KEYS = {"type", "name", "description", "system_prompt", "system_prompt_type", "tools", "llm_config",
               "max_iterations", "max_context_tokens", "tool_call_mode", "stop_tools", "tracers"}
_NEXAU_ONLY_AGENT_KEYS = {"sub_agents", "skills", "mcp_servers", "after_model_hooks", "after_tool_hooks",
                          "before_model_hooks", "before_tool_hooks", "middlewares", "sandbox_config", "plugins",
                          "token_counter", "global_storage", "initial_state", "initial_config", "context",
                          "initial_context", "system_prompt_suffix", "error_handler", "max_running_subagents",
                          "retry_attempts", "retry_backoff_max_seconds", "timeout", "source_id"}
_TOOL_ENTRY_KEYS = {"name", "yaml_path", "binding", "lazy", "extra_kwargs"}
_TOOL_FILE_KEYS = {"type", "name", "description", "input_schema", "binding", "lazy", "skill_description"}
_NEXAU_ONLY_TOOL_KEYS = {"as_skill", "defer_loading", "source_id", "disable_parallel", "search_hint",
                         "template_override", "builtin", "formatter"}


@dataclass
class ToolSpec:
    """One tool as the model sees it (name, description, JSON-schema parameters) and its binding."""

    name: str
    description: str
    input_schema: dict[str, Any]
    binding: str  # "module:function" or "path/to/file.py:function"
    extra_kwargs: dict[str, Any] = field(default_factory=dict)
    lazy: bool = False
    source: str = ""  # the tool YAML, for messages

    def openai_schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry (what chat templates' ``tools=`` take too)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description,
                             "parameters": self.input_schema or {"type": "object", "properties": {}}}}


@dataclass
class AgentSpec:
    name: str
    system_prompt: str | None
    system_prompt_type: str
    tools: list[ToolSpec]
    llm_config: dict[str, Any]
    max_iterations: int = 100
    max_context_tokens: int | None = None
    tool_call_mode: str = "structured"
    stop_tools: set[str] = field(default_factory=set)
    description: str = ""
    path: str = ""
    workspace: str = ""  # the folder tool bindings are imported from

    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling keys ``llm_config`` sets (the recipe's ``sampling`` overrides them)."""
        return {k: self.llm_config[k] for k in SAMPLING_KEYS if self.llm_config.get(k) is not None}


def load_agent_spec(path: str, workspace: str | None = None) -> AgentSpec:
    """Read and check an agent YAML and its tool YAMLs; ConfigError naming ``file: key`` on a problem."""
    raw = _read_yaml(path)
    where = path
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: an agent file is a mapping of keys, got {type(raw).__name__}")
    if raw.get("type", "agent") != "agent":
        raise ConfigError(f"{where}: type: expected 'agent', got {raw.get('type')!r}")
    _check_keys(raw, where, _AGENT_KEYS, _NEXAU_ONLY_AGENT_KEYS)
    base = os.path.dirname(os.path.abspath(path))
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: name: required (a non-empty string)")
    prompt_type = str(raw.get("system_prompt_type", "string"))
    if prompt_type not in ("string", "file", "jinja"):
        raise ConfigError(f"{where}: system_prompt_type: expected string, file or jinja, got {prompt_type!r}")
    prompt = raw.get("system_prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ConfigError(f"{where}: system_prompt: expected a string, got {type(prompt).__name__}")
    if prompt is not None and prompt_type == "file":
        prompt_path = os.path.join(base, prompt)
        if not os.path.isfile(prompt_path):
            raise ConfigError(f"{where}: system_prompt: file {prompt_path} not found")
        with open(prompt_path, encoding="utf-8") as f:
            prompt = f.read()
    if prompt is not None and prompt_type == "jinja":
        import jinja2

        try:  # checked now, rendered per task
            jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(prompt)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"{where}: system_prompt: not a valid jinja template (line {exc.lineno}: "
                              f"{exc.message})") from None
    mode_raw = str(raw.get("tool_call_mode", "structured")).lower()
    if mode_raw not in TOOL_CALL_MODES:
        raise ConfigError(f"{where}: tool_call_mode: expected one of {', '.join(TOOL_CALL_MODES)}, got {mode_raw!r}")
    max_iterations = _positive_int(raw.get("max_iterations", 100), where, "max_iterations")
    max_context = raw.get("max_context_tokens")
    max_context = None if max_context is None else _positive_int(max_context, where, "max_context_tokens")
    llm_config = raw.get("llm_config") or {}
    if not isinstance(llm_config, dict):
        raise ConfigError(f"{where}: llm_config: expected a mapping, got {type(llm_config).__name__}")
    unknown_llm = sorted(set(llm_config) - set(SAMPLING_KEYS) - CONNECTION_KEYS)
    if unknown_llm:
        raise ConfigError(f"{where}: llm_config: unknown key(s) {', '.join(unknown_llm)} (sampling keys: "
                          f"{', '.join(SAMPLING_KEYS)})")
    sampling_problems = SamplingParams.recipe_problems({k: v for k, v in llm_config.items() if k in SAMPLING_KEYS},
                                                       "llm_config")
    if sampling_problems:
        raise ConfigError(f"{where}: {'; '.join(sampling_problems)}")
    tools_raw = raw.get("tools") or []
    if not isinstance(tools_raw, list):
        raise ConfigError(f"{where}: tools: expected a list of tool entries, got {type(tools_raw).__name__}")
    tools = [_load_tool(entry, i, base, where) for i, entry in enumerate(tools_raw)]
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ConfigError(f"{where}: tools: two tools are named '{tool.name}'")
        seen.add(tool.name)
    stop_tools = raw.get("stop_tools") or []
    if not isinstance(stop_tools, list) or not all(isinstance(s, str) for s in stop_tools):
        raise ConfigError(f"{where}: stop_tools: expected a list of tool names")
    missing = sorted(set(stop_tools) - seen)
    if missing:
        raise ConfigError(f"{where}: stop_tools: {', '.join(missing)} is not one of the agent's tools")
    return AgentSpec(name=name, system_prompt=prompt, system_prompt_type=prompt_type, tools=tools,
                     llm_config=dict(llm_config), max_iterations=max_iterations, max_context_tokens=max_context,
                     tool_call_mode=TOOL_CALL_MODES[mode_raw], stop_tools=set(stop_tools),
                     description=str(raw.get("description") or ""), path=os.path.abspath(path),
                     workspace=os.path.abspath(workspace) if workspace else base)


def _check_keys(mapping: dict[str, Any], where: str, known: set[str], nexau_only_keys: set[str]) -> None:
    """NexAU's keys the built-in runner does not implement, then keys neither knows."""
    nexau_only = sorted(set(mapping) & nexau_only_keys)
    if nexau_only:
        raise ConfigError(f"{where}: {', '.join(nexau_only)}: not supported by nexrl's built-in agent runner; "
                          f"run this agent with NexAU itself (rollout_worker.agent_runner: nexau)")
    unknown = sorted(set(mapping) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")


def _load_tool(entry: Any, index: int, base: str, agent_file: str) -> ToolSpec:
    where = f"{agent_file}: tools[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with name and yaml_path, got {entry!r}")
    _check_keys(entry, where, _TOOL_ENTRY_KEYS, _NEXAU_ONLY_TOOL_KEYS)
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: name: required (a non-empty string)")
    where = f"{agent_file}: tools[{index}] ({name})"
    rel = entry.get("yaml_path")
    if not isinstance(rel, str) or not rel:
        raise ConfigError(f"{where}: yaml_path: required")
    tool_path = os.path.normpath(os.path.join(base, rel))
    if not os.path.isfile(tool_path):
        raise ConfigError(f"{where}: yaml_path: {tool_path} not found")
    tool = _read_yaml(tool_path)
    if not isinstance(tool, dict):
        raise ConfigError(f"{tool_path}: a tool file is a mapping of keys, got {type(tool).__name__}")
    _check_keys(tool, tool_path, _TOOL_FILE_KEYS, _NEXAU_ONLY_TOOL_KEYS)
    if tool.get("type", "tool") != "tool":
        raise ConfigError(f"{tool_path}: type: expected 'tool', got {tool.get('type')!r}")
    description = tool.get("description")
    if not isinstance(description, str):
        raise ConfigError(f"{tool_path}: description: required (a string)")
    schema = tool.get("input_schema") or {"type": "object", "properties": {}}
    if not isinstance(schema, dict) or schema.get("type", "object") != "object" or \
            not isinstance(schema.get("properties", {}), dict):
        raise ConfigError(f"{tool_path}: input_schema: expected a JSON schema of type object with 'properties'")
    reserved = sorted(set(schema.get("properties", {})) & {"agent_state", "global_storage", "ctx", "sandbox"})
    if reserved:
        raise ConfigError(f"{tool_path}: input_schema: {', '.join(reserved)} is reserved for the framework")
    binding = entry.get("binding") or tool.get("binding")
    if binding is not None and (not isinstance(binding, str) or ":" not in binding):
        raise ConfigError(f"{where}: binding: expected 'module:function' or 'path/to/file.py:function', got {binding!r}")
    if binding is None:
        raise ConfigError(f"{where}: binding: required (the function that implements the tool, 'module:function')")
    extra = entry.get("extra_kwargs") or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{where}: extra_kwargs: expected a mapping")
    lazy = entry.get("lazy", tool.get("lazy", False))
    if not isinstance(lazy, bool):
        raise ConfigError(f"{where}: lazy: expected true or false")
    return ToolSpec(name=name, description=description, input_schema=schema, binding=binding,
                    extra_kwargs=dict(extra), lazy=lazy, source=tool_path)


def _read_yaml(path: str) -> Any:
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None


def _positive_int(value: Any, where: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key}: expected an integer >= 1, got {value!r}")
    return value
