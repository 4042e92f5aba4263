"""Recipes the docs point users at exist: every ``recipes/...`` path named in README.md, docs/ and
the plugins' READMEs is a file of the repository (a README naming a recipe that was never
committed sends users to nothing). That every shipped recipe passes ``nexrl validate`` is
tests/core/test_nexrl_defects.py::test_recipe_names_registered_components."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("plugins/*/README.md")])
# A path under recipes/ as prose writes it: stops at a space, backtick, quote, bracket or comma.
RECIPE_PATH = re.compile(r"(?<![\w/.])recipes/[\w./-]*\w")


def _named_paths() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for line_no, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            found += [(f"{page.relative_to(ROOT)}:{line_no}", m.group(0)) for m in RECIPE_PATH.finditer(line)]
    return found


NAMED = _named_paths()


def test_the_readme_names_the_shipped_recipes():
    named = {path for _, path in NAMED}
    for recipe in ("recipes/quickstart.yaml", "recipes/agent_calculator.yaml"):
        assert recipe in named, f"README.md/docs no longer name {recipe}"


@pytest.mark.parametrize("where,path", NAMED, ids=[f"{w}:{p}" for w, p in NAMED])
def test_a_recipe_path_in_the_docs_exists(where, path):
    assert (ROOT / path).exists(), f"{where} names {path}, which is not in the repository"
