"""``nexrl new worker|trainer|dataloader|weight-sync NAME`` (issue 30, item 4): each scaffold
installs (``pip install --no-deps --target``, no venv touched), passes its own tests, passes
``nexrl plugins check``, and validates in the quickstart recipe when selected there; the trainer
scaffold trains the tiny model in tests/grpo_plugin/test_guide_trainer.py."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nexrl_core.cli import main
from nexrl_core.cli.scaffold import KINDS, names

REPO_ROOT = Path(__file__).resolve().parents[2]
NEW = {"worker": "rollout_worker.type", "dataloader": "data.type", "weight-sync": "weight.backend",
       "trainer": "trainer.type"}


def test_names_of_each_kind():
    assert names("my-env", "worker") == {"name": "my_env", "dist": "nexrl-worker-my-env",
                                         "package": "nexrl_worker_my_env", "cls": "MyEnvRolloutWorker"}
    assert names("push", "weight-sync")["package"] == "nexrl_weight_sync_push"
    assert names("csv", "dataloader")["cls"] == "CsvDataLoader"
    assert {kind: spec.selects for kind, spec in KINDS.items() if kind in NEW} == NEW


def test_a_name_taken_by_an_installed_component_is_refused(tmp_path, core_pm, capfd):
    assert main(["new", "worker", "simple", "--dir", str(tmp_path)]) == 2
    assert capfd.readouterr().err.startswith("error: 'simple': an installed plugin already registers a rollout "
                                             "worker of that name")
    assert main(["new", "dataloader", "Bad", "--dir", str(tmp_path)]) == 2
    assert "'Bad': a data loader name is lowercase" in capfd.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def scaffolds(tmp_path_factory):
    """The four packages, written by `nexrl new` and installed into one --target folder."""
    root = tmp_path_factory.mktemp("scaffolds")
    site = root / "site"
    packages = {}
    for kind in NEW:
        name = f"demo-{kind}".replace("weight-sync", "push")
        assert main(["new", kind, name, "--dir", str(root)]) == 0
        packages[kind] = (names(name, kind), root / names(name, kind)["dist"])
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                               "--no-build-isolation", "--target", str(site), str(packages[kind][1])],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    return site, packages


def test_each_scaffold_passes_its_own_tests(scaffolds):
    site, packages = scaffolds
    env = {k: v for k, v in os.environ.items() if k not in ("NEXRL_LOAD_PLUGINS", "PYTHONPATH")}
    env.update(PYTHONPATH=str(site), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    folders = [str(pkg / "tests") for _, pkg in packages.values()]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *folders],
                          cwd=site.parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "10 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


def test_each_scaffold_passes_the_plugin_check_and_is_selectable_in_the_quickstart(scaffolds, monkeypatch, capfd):
    import nexrl_core.plugins as plugins
    from nexrl_core.testing.conformance import check_plugin

    site, packages = scaffolds
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.delenv("NEXRL_LOAD_PLUGINS", raising=False)
    pm = plugins.PluginManager()
    monkeypatch.setattr(plugins, "_DEFAULT", pm)
    for kind, (n, _) in packages.items():
        reports = check_plugin(n["dist"], pm)
        assert reports and all(r.ok for r in reports), [r.text() for r in reports]
        component = KINDS[kind].component
        assert pm.components(component)[n["name"]].distribution == n["dist"]
        extra = {"dataloader": [f"+data.path={packages['dataloader'][1] / 'data.csv'}", "+data.prompt_column=question"],
                 "weight-sync": ["+weight.log_every=2"], "trainer": ["+trainer.advantage_scale=0.5"],
                 "worker": ["+rollout_worker.instruction=Hi"]}[kind]
        # the quickstart recipe with it selected passes every check of `nexrl validate`
        if kind == "dataloader":  # the arithmetic loader's keys go
            extra += ["~data.split", "~data.num_rows", "~data.min_value", "~data.max_value"]
        extra = [f"{KINDS[kind].selects}={n['name']}"] + extra
        code = main(["validate", str(REPO_ROOT / "recipes" / "quickstart.yaml"), *extra])
        assert code == 0, capfd.readouterr().err
