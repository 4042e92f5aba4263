"""The generated reference pages match the code (issue 18, item 9): docs/hooks.md (the hook
specs' docstrings), docs/recipe.md (every recipe key: the core's schema and the options of
every component and algorithm function of nexrl-core and the plugins under plugins/) and
docs/migrating.md (issue 30: the NexRL -> nexrl table nexrl migrate follows). Every key
has a meaning; the core's defaults hold every core key; a declared core key is read by the core."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from nexrl_core.cli.docgen import flatten_options, hook_specs, options_table
from nexrl_core.config.options import REQUIRED, Option
from nexrl_core.config.schema import CORE_OPTIONS, core_defaults

ROOT = Path(__file__).resolve().parents[2]
FIX = "regenerate them: python scripts/gen_docs.py"


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages():
    return {path.name: text for path, text in _gen_docs().pages().items()}


@pytest.mark.parametrize("name", ["hooks.md", "recipe.md", "migrating.md"])
def test_the_generated_pages_are_current(pages, name):
    current = (ROOT / "docs" / name).read_text(encoding="utf-8")
    if current != pages[name]:
        added = sorted(set(pages[name].splitlines()) - set(current.splitlines()))[:5]
        gone = sorted(set(current.splitlines()) - set(pages[name].splitlines()))[:5]
        pytest.fail(f"docs/{name} is out of date with the code; {FIX}\n  missing: {added}\n  stale: {gone}")


def test_every_hook_is_in_the_hook_reference_with_its_parameters(pages):
    text = pages["hooks.md"]
    for spec in hook_specs():
        assert f"## {spec.__name__}\n" in text
        for param in inspect.signature(spec).parameters:
            assert f"- `{param}`: " in text.split(f"## {spec.__name__}\n", 1)[1].split("\n## ", 1)[0]


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in text.splitlines()
            if line.startswith("| `")]


def test_every_key_of_the_recipe_reference_has_a_type_default_and_meaning(pages):
    rows = _rows(pages["recipe.md"])
    assert len(rows) > 150
    empty = [row[0] for row in rows if not all(row)]
    assert empty == [], f"keys without a meaning (give their Option a help text, or a :param line): {empty}"


def test_the_core_keys_are_all_in_the_reference_and_in_the_defaults(pages):
    documented = {row[0].strip("`") for row in _rows(pages["recipe.md"])}
    defaults = core_defaults()
    for key, opt in flatten_options({k: v for k, v in CORE_OPTIONS.items() if k != "recipe_dir"}):
        assert key in documented, key
        assert opt.help, f"{key}: no help text in nexrl_core/config/schema.py"
        if not opt.required and opt.options is None and "<name>" not in key:  # a leaf with a default: the
            # recipe is merged onto it (an entry the recipe names, <name>, has no default)
            node = defaults
            for part in key.split("."):
                if node is None or node == {}:
                    break  # inside an optional section (validate.data, ray.resources.<role>): applies when given
                assert isinstance(node, dict) and part in node, f"core_defaults() lacks {key}"
                node = node[part]


def _unread(options: dict[str, Option], source: str) -> list[str]:
    """Declared keys whose name the code never mentions (accepted, then ignored)."""
    return [key for key, _ in flatten_options(options) if not key.endswith("<name>")
            and not re.search(rf"""["'.]{re.escape(key.split('.')[-1])}\b""", source)]


def test_every_declared_core_key_is_read_by_the_core():
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "nexrl_core").rglob("*.py")
                       if p.name != "schema.py")
    assert _unread(CORE_OPTIONS, source) == []
    # the check can fail: a key nothing reads
    assert _unread({"trainer": Option(options={"never_read_anywhere": Option(1, help="x")})}, source) == \
        ["trainer.never_read_anywhere"]


def test_the_table_escapes_pipes_and_shows_required_keys():
    table = options_table({"mode": Option("a", str, "a | b", choices=("a", "b")),
                           "path": Option(REQUIRED, str, "where")}, "x.")
    assert table[2:] == ["| `x.mode` | a string | `a` | a \\| b; one of `a`, `b` |",
                         "| `x.path` | a string | required | where |"]


def test_mappings_of_named_entries_get_one_row_for_each_entry_and_its_keys():
    entry = Option(options={"scale": Option(1.0, float, "weight")}, help="one domain")
    rows = [key for key, _ in flatten_options({"domains": Option({}, dict, "by name", values=entry)}, "x.")]
    assert rows == ["x.domains", "x.domains.<name>", "x.domains.<name>.scale"]
