"""Every hook spec is prefixed, typed and documented (datasette's tests/test_docs.py, for nexrl).

The hooks are discovered from ``nexrl_core/hookspecs.py`` itself, so a new hook is checked the
moment it is added: one without a docstring, a ``:param:`` line per parameter, a ``:return:``
line (when it returns something) or type annotations makes this file fail.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from nexrl_core import hookspecs
from nexrl_core.plugins import KINDS, PluginManager

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _specs() -> list:
    return sorted((f for _, f in inspect.getmembers(hookspecs, inspect.isfunction)
                   if f.__module__ == hookspecs.__name__), key=lambda f: f.__name__)


def _is_spec(func) -> bool:
    return hasattr(func, "nexrl_spec")


def doc_problems(func) -> list[str]:
    """What is missing from one hook spec's signature and docstring."""
    problems = []
    name = func.__name__
    if not name.startswith("nexrl_"):
        problems.append(f"{name}: hook names must start with 'nexrl_'")
    if not _is_spec(func):
        problems.append(f"{name}: not marked with @hookspec")
    sig = inspect.signature(func)
    doc = inspect.getdoc(func) or ""
    summary = doc.strip().splitlines()[0] if doc.strip() else ""
    if len(summary) < 10:
        problems.append(f"{name}: needs a docstring whose first line says what the hook is for")
    if sig.return_annotation is inspect.Signature.empty:
        problems.append(f"{name}: return type not annotated")
    returns_value = sig.return_annotation not in (None, "None", inspect.Signature.empty)
    if returns_value and not re.search(r":return:\s*\S", doc):
        problems.append(f"{name}: docstring does not document the return value (':return: ...')")
    for param in sig.parameters.values():
        if param.annotation is inspect.Parameter.empty:
            problems.append(f"{name}: parameter '{param.name}' not annotated")
        if not re.search(rf":param {re.escape(param.name)}:\s*\S", doc):
            problems.append(f"{name}: parameter '{param.name}' not documented (':param {param.name}: ...')")
    return problems


def test_there_are_hooks_and_every_function_in_the_module_is_a_hook():
    specs = _specs()
    names = {f.__name__ for f in specs}
    assert {"nexrl_dataloaders", "nexrl_rollout_workers", "nexrl_evaluators", "nexrl_trainers",
            "nexrl_weight_sync_backends", "nexrl_inference_backends"} <= names
    assert [f.__name__ for f in specs if not _is_spec(f)] == []


@pytest.mark.parametrize("spec", _specs(), ids=lambda f: f.__name__)
def test_hook_is_prefixed_typed_and_documented(spec):
    assert doc_problems(spec) == []


@pytest.mark.parametrize("spec", _specs(), ids=lambda f: f.__name__)
def test_component_hooks_return_a_registry_and_are_resolvable(spec):
    """A hook returning ``dict[str, type...]`` registers components: the plugin manager must know
    its kind, or a recipe could never select what it registers."""
    annotation = str(inspect.signature(spec).return_annotation)
    hooks_with_kind = {hook for hook, _ in KINDS.values()}
    if annotation.startswith("dict[str, type"):
        assert spec.__name__ in hooks_with_kind
        assert ":return: registered name ->" in " ".join(inspect.getdoc(spec).split())
    else:
        assert spec.__name__ not in hooks_with_kind


def test_plugin_manager_knows_every_spec():
    pm = PluginManager(load_entrypoints=False)
    assert {f.__name__ for f in _specs()} <= {name for name in dir(pm.pm.hook) if name.startswith("nexrl_")}


def test_the_checker_catches_an_undocumented_hook():
    """The checks above must be able to fail."""
    @hookspecs.hookspec
    def nexrl_new_thing(step, metrics: dict) -> dict[str, type]:
        """Something new.

        :param step: the step.
        """

    def undocumented_thing(x: int):
        pass

    problems = doc_problems(nexrl_new_thing)
    assert "nexrl_new_thing: parameter 'step' not annotated" in problems
    assert "nexrl_new_thing: parameter 'metrics' not documented (':param metrics: ...')" in problems
    assert "nexrl_new_thing: docstring does not document the return value (':return: ...')" in problems
    problems = doc_problems(undocumented_thing)
    assert any("must start with 'nexrl_'" in p for p in problems)
    assert any("not marked with @hookspec" in p for p in problems)
    assert any("needs a docstring" in p for p in problems)
    assert any("return type not annotated" in p for p in problems)


def _hook_docs_page() -> Path | None:
    if not DOCS.is_dir():
        return None
    for page in sorted(DOCS.rglob("*.md")):
        if "nexrl_evaluators" in page.read_text(encoding="utf-8", errors="replace"):
            return page
    return None


def test_plugin_docs_page_mentions_every_hook():
    page = _hook_docs_page()
    assert page is not None, "no page under docs/ documents the hooks (docs/plugins.md)"
    text = page.read_text(encoding="utf-8")
    missing = [f.__name__ for f in _specs() if f.__name__ not in text]
    assert missing == [], f"{page.relative_to(DOCS.parent)} does not document {missing}"
