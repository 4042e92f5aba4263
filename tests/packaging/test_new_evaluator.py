"""``nexrl new evaluator NAME`` (issue 18, item 5): the scaffolded package installs with
``pip install -e`` into a fresh venv, passes its own tests there, is listed by ``nexrl plugins``,
passes ``nexrl plugins check``, trains its example recipe in a real ``nexrl run`` on the mock
components, and builds with ``python -m build``. Its tests can fail: a broken evaluator fails
them and the check."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from nexrl_core.cli import main
from nexrl_core.cli.scaffold import names
from tests.support.venvs import make_venv, pip_install, venv_env

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_names():
    assert names("length-penalty") == {"name": "length_penalty", "dist": "nexrl-evaluator-length-penalty",
                                       "package": "nexrl_evaluator_length_penalty", "cls": "LengthPenaltyEvaluator"}
    assert names("f1")["cls"] == "F1Evaluator"


@pytest.mark.parametrize("name, message", [
    ("Caps", "error: 'Caps': an evaluator name is lowercase letters and digits, words joined by - or _"),
    ("a--b", "error: 'a--b': an evaluator name is lowercase"),
    ("exact_match", "error: 'exact_match': an installed plugin already registers an evaluator of that name"),
])
def test_bad_names_are_one_line(name, message, tmp_path, core_pm, capfd):
    assert main(["new", "evaluator", name, "--dir", str(tmp_path)]) == 2
    err = capfd.readouterr().err
    assert err.startswith(message) and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_never_overwritten(tmp_path, core_pm, capfd):
    assert main(["new", "evaluator", "twice", "--dir", str(tmp_path)]) == 0
    plugin = tmp_path / "nexrl-evaluator-twice" / "nexrl_evaluator_twice" / "plugin.py"
    plugin.write_text("# my work\n")
    assert main(["new", "evaluator", "twice", "--dir", str(tmp_path)]) == 2
    assert "nexrl-evaluator-twice: already exists" in capfd.readouterr().err
    assert plugin.read_text() == "# my work\n"


def _run(cmd, cwd, env, timeout=300):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_scaffold_installs_tests_runs_and_builds_in_a_fresh_venv(tmp_path, core_pm, capfd):
    assert main(["new", "evaluator", "answer-check", "--dir", str(tmp_path), "--license", "MIT"]) == 0
    assert "pip install -e '.[test]'" in capfd.readouterr().out
    pkg = tmp_path / "nexrl-evaluator-answer-check"

    python = make_venv(tmp_path / "venv")
    for project in (REPO_ROOT, pkg):  # nexrl-core and the plugin, as a plugin author installs them
        done = pip_install(python, "--no-build-isolation", "-e", str(project))
        assert done.returncode == 0, done.stderr[-3000:]
    env = venv_env(python)
    bin_dir = python.parent

    # its own tests pass (the kit's pytest fixtures come from nexrl-core's pytest11 entry point)
    tests = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], pkg, env)
    assert tests.returncode == 0 and "3 passed" in tests.stdout, tests.stdout[-3000:] + tests.stderr[-2000:]

    # nexrl finds it through the entry point
    listing = _run([bin_dir / "nexrl", "plugins", "--json"], tmp_path, env)
    assert listing.returncode == 0, listing.stderr
    [ours] = [p for p in json.loads(listing.stdout)["plugins"] if p["distribution"] == "nexrl-evaluator-answer-check"]
    assert ours["name"] == "answer_check" and ours["components"] == {"evaluator": ["answer_check"]}
    check = _run([bin_dir / "nexrl", "plugins", "check", "answer_check"], tmp_path, env)
    assert check.returncode == 0 and check.stdout.startswith(
        "evaluator 'answer_check' (nexrl-evaluator-answer-check 0.1.0): ok ("), check.stdout + check.stderr

    # its example recipe trains in a real `nexrl run` (mock inference learns the sums: reward rises)
    run = _run([bin_dir / "nexrl", "run", "recipe.yaml"], pkg, env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (pkg / "runs" / "answer_check" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["train/reward_mean"] for r in rows if "train/reward_mean" in r]
    assert len(rewards) == 4 and rewards[0] < rewards[-1] == 1.0

    # it builds for publishing (the sdist path is covered for nexrl's own packages in test_packaging.py)
    built = _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", tmp_path / "dist", pkg],
                 tmp_path, env)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    [wheel] = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        info = "nexrl_evaluator_answer_check-0.1.0.dist-info"
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
        assert "[nexrl]\nanswer_check = nexrl_evaluator_answer_check.plugin" in entry_points
        assert "License-Expression: MIT" in zf.read(f"{info}/METADATA").decode()

    # the tests and the check can fail: an evaluator that raises on an empty reply fails both
    plugin = pkg / "nexrl_evaluator_answer_check" / "plugin.py"
    plugin.write_text(plugin.read_text().replace("        reply = evaluation_target.final_answer\n",
                                                 "        reply = evaluation_target.final_answer\n"
                                                 "        reply[0]\n"))
    tests = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "conformance"], pkg, env)
    assert tests.returncode == 1 and "an empty reply" in tests.stdout
    check = _run([bin_dir / "nexrl", "plugins", "check", "answer_check"], tmp_path, env)
    assert check.returncode == 1 and "IndexError: string index out of range" in check.stdout
