"""Agent workspaces for the nexrl-nexau tests: an agent YAML, tool YAMLs and a tool module."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

TOOLS_MODULE = '''
import threading

RELEASE = threading.Event()  # set by the test that hangs a tool, so its thread ends
CALLS = []


def add(a, b):
    CALLS.append(("add", a, b))
    return a + b


def echo(text, suffix=""):
    return text + suffix


def explode(text):
    raise RuntimeError("boom: " + text)


def hang(text):
    RELEASE.wait(30)
    return "late"


def garbage(text):
    return object()


def huge(text):
    return "y" * 100000


def nexau_error(text):
    return {"error": "not found: " + text}


async def slow_echo(text):
    return text.upper()
'''

SCHEMAS = {
    "add": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"], "additionalProperties": False},
}
TEXT_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}, "suffix": {"type": "string"}},
               "required": ["text"]}


def write_agent(folder: Path, tools: list[str], module: str = "agent_tools_mod", **keys: Any) -> str:
    """An agent YAML in ``folder`` with the named tools of TOOLS_MODULE (binding by module name)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(textwrap.dedent(TOOLS_MODULE))
    (folder / "tools").mkdir(exist_ok=True)
    entries = []
    for name in tools:
        (folder / "tools" / f"{name}.yaml").write_text(yaml.safe_dump({
            "type": "tool", "name": name.capitalize(), "description": f"The {name} tool.",
            "input_schema": SCHEMAS.get(name, TEXT_SCHEMA)}))
        entries.append({"name": name, "yaml_path": f"./tools/{name}.yaml", "binding": f"{module}:{name}"})
    agent = {"type": "agent", "name": "test_agent", "system_prompt": "You are a test agent.",
             "max_iterations": 5, "tool_call_mode": "structured", "llm_config": {"max_tokens": 200},
             "tools": entries, **keys}
    path = folder / "agent.yaml"
    path.write_text(yaml.safe_dump(agent, sort_keys=False))
    return str(path)


@pytest.fixture
def agent_factory(tmp_path, request):
    """``make(tools, **agent keys) -> path``; each test gets its own module name (imports are cached)."""
    counter = iter(range(1000))

    def make(tools: list[str], **keys: Any) -> str:
        module = "agent_tools_" + re.sub(r"\W", "_", request.node.name) + f"_{next(counter)}"
        return write_agent(tmp_path / module, tools, module, **keys)
    return make


@pytest.fixture
def nexau_pm(monkeypatch):
    """A plugin manager with nexrl-core's built-ins and nexrl-nexau only (loading every installed
    plugin imports torch: seconds for nothing in these tests)."""
    import nexrl_core.plugins as plugins

    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-nexau")
    pm = plugins.PluginManager()
    monkeypatch.setattr(plugins, "_DEFAULT", pm)
    return pm
