"""What a run directory records about the run itself: ``config.yaml`` (the resolved recipe,
secrets redacted) and ``run.json`` (command line, host, versions, start/end times, exit status).

What is a secret is decided in :mod:`nexrl_core.redaction`; both files are redacted with it.
"""

from __future__ import annotations

import getpass
import importlib.metadata as md
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

from ..config.schema import RecipeSettings
from ..config.settings import plain
from ..redaction import redact, redact_command

CONFIG_FILE = "config.yaml"
RUN_FILE = "run.json"
# Libraries whose versions explain a run's numbers (read from metadata: nothing is imported).
_LIBRARIES = ("torch", "transformers", "vllm", "ray", "tinker", "numpy", "safetensors", "omegaconf", "hydra-core",
              "pluggy", "wandb", "tensorboard", "tensorboardX", "rich", "matplotlib")


def plain_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved recipe as plain dicts and lists, less what nexrl adds itself (``recipe_dir``):
    what ``nexrl config`` prints and ``config.yaml`` holds is a recipe ``nexrl run`` accepts."""
    values = plain(config)
    assert isinstance(values, dict)
    return {str(k): v for k, v in values.items() if k != "recipe_dir"}


def redacted_yaml(config: Mapping[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(redact(plain_config(config)), sort_keys=False, default_flow_style=False,
                          allow_unicode=True)


def versions(plugin_manager: Any = None) -> dict[str, Any]:
    """Python, nexrl-core, every loaded plugin distribution and the libraries that shape a run."""
    out: dict[str, Any] = {"python": platform.python_version(), "nexrl-core": _version("nexrl-core")}
    if plugin_manager is not None:
        out["plugins"] = {r.distribution: r.version for r in plugin_manager.records.values()
                          if r.distribution != "nexrl-core"}
    out["libraries"] = {name: v for name in _LIBRARIES if (v := _version(name))}
    return out


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _git(folder: str) -> dict[str, Any] | None:
    """Commit (and whether the tree has changes) of the git repository holding ``folder``, if any."""
    try:
        commit = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", folder, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


class RunRecord:
    """``run.json`` of one ``nexrl run``: written at the start, completed at the end. A resumed run
    keeps the earlier attempts under ``previous``."""

    def __init__(self, run_dir: str, recipe: str, overrides: list[str], argv: list[str] | None = None,
                 plugin_manager: Any = None, settings: RecipeSettings | None = None):
        self.path = os.path.join(run_dir, RUN_FILE)
        self.start = time.time()
        recipe_dir = os.path.dirname(os.path.abspath(recipe))
        self.data: dict[str, Any] = {
            "command": redact_command(list(argv if argv is not None else sys.argv)),
            "recipe": recipe, "overrides": redact_command(list(overrides)), "cwd": os.getcwd(),
            "host": socket.gethostname(), "user": _user(), "pid": os.getpid(),
            "platform": platform.platform(), "start_time": _iso(self.start), "start": self.start,
            "end_time": None, "end": None, "duration_s": None, "exit_status": "running", "exit_code": None,
            "versions": versions(plugin_manager), "git": _git(recipe_dir), "restarts": 0,
        }
        if settings is not None:
            self.data.update(launch_mode=settings.launch_mode, resume_mode=settings.resume.mode, seed=settings.seed)

    def write_start(self, keep_previous: bool = True) -> None:
        """Write run.json; ``keep_previous`` (a resumed run) keeps the earlier attempts under ``previous``."""
        previous = []
        try:
            if not keep_previous:
                raise OSError("a fresh run")
            with open(self.path, encoding="utf-8") as f:
                earlier = json.load(f)
            if isinstance(earlier, dict):
                previous = earlier.pop("previous", []) + [earlier]
        except (OSError, ValueError):
            pass
        if previous:
            self.data["previous"] = previous
        self._write()

    def elapsed(self) -> float:
        return time.time() - self.start

    def finish(self, exit_status: str, exit_code: int, global_step: int | None = None,
               error: str | None = None) -> None:
        end = time.time()
        self.data.update(end_time=_iso(end), end=end, duration_s=round(end - self.start, 3), exit_status=exit_status,
                         exit_code=exit_code, global_step=global_step, error=error)
        self._write()

    def note_restart(self, global_step: int | None, error: str) -> None:
        """One more automatic restart (``resume.on_failure: restart``): counted, with its cause."""
        causes = self.data.setdefault("restart_causes", [])
        causes.append({"time": _iso(time.time()), "global_step": global_step, "error": error})
        self.data["restarts"] = len(causes)
        self._write()

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(redact(self.data), f, indent=1, default=str)  # an error message may quote a secret
            f.write("\n")
        os.replace(tmp, self.path)


def _user() -> str | None:
    try:
        return getpass.getuser()
    except Exception:  # no user name in a container without /etc/passwd entry
        return None


def write_config(run_dir: str, config: Mapping[str, Any]) -> str:
    """``<run_dir>/config.yaml``: the recipe as resolved for this run, secrets redacted."""
    path = os.path.join(run_dir, CONFIG_FILE)
    os.makedirs(run_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(redacted_yaml(config))
    return path
