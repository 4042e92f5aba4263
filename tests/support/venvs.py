"""Fresh virtual environments for install tests, without the network.

A venv made here holds none of nexrl's own distributions; the third-party packages they need
come from the environment running the tests (linked into one folder named by a ``.pth`` file,
leaving out nexrl's distributions and their editable-install hooks), so ``pip install --no-deps``
of a wheel or project is all a test has to do.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

_OWN = ("nexrl", "__editable__", "_nexrl")


def make_venv(root: Path) -> Path:
    """Create a venv at ``root``; returns its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    python = root / "bin" / "python"
    deps = root / "shared-deps"
    deps.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        if entry.name.startswith(_OWN) or entry.suffix == ".pth" or entry.name == "__pycache__":
            continue
        (deps / entry.name).symlink_to(entry)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "_shared_deps.pth").write_text(f"{deps}\n")
    return python


def pip_install(python: Path, *args: str) -> subprocess.CompletedProcess:
    """``pip install --no-deps --no-index ARGS`` into the venv of ``python`` (pip runs from this
    environment: the new venv has none)."""
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-index", *args], capture_output=True, text=True, timeout=300)


def venv_env(python: Path, **extra: str) -> dict[str, str]:
    """Environment for a command of that venv: its bin/ first on PATH, nothing inherited that
    would point Python elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "NEXRL_LOAD_PLUGINS")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(python.parent.parent)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)
    return env
