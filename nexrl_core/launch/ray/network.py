"""``ray.private_network: true``: ``nexrl run`` runs itself, driver included, and so the local Ray
cluster it starts, in a network namespace of its own that has only loopback (``_netns.py``): no
other process of the machine, another user's included, reaches the cluster's ports. (Without it
the local cluster listens on loopback only: :func:`nexrl_core.launch.ray.cluster.connect`.)

A run there reaches nothing outside, so ``true`` is refused (one function, for ``nexrl validate``
and ``nexrl run``) when the recipe needs the network: a recipe value that is a URL; a
``*model_path`` / ``*tokenizer_path`` that is no local path (the Hugging Face Hub; none with
``HF_HUB_OFFLINE=1``); a component whose class declares ``network_use(recipe) -> str | None``
(a hosted service, an online tracker). Imports neither Ray nor nexrl's components."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...config.options import option_defaults
from ...config.schema import RaySectionSettings
from ._netns import MARKER

KEY = "ray.private_network"
_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_netns.py")
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_MODEL_KEY = re.compile(r"(^|_)(model|tokenizer)_path$")

@dataclass(frozen=True)
class Plan:
    """``private``: run in a private network namespace; ``problem``: why ``true`` cannot be honoured."""

    private: bool = False
    problem: str | None = None


def inside() -> bool:
    """This process runs in the namespace ``_netns.py`` made (its mark, and no interface but ``lo``)."""
    return os.environ.get(MARKER) == "1" and [name for _, name in socket.if_nameindex()] == ["lo"]


def network_uses(values: Mapping[str, Any], found: Mapping[str, type], sinks: list[type]) -> list[str]:
    """What of the recipe reaches the network, one phrase each (key first)."""
    uses: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
        elif isinstance(value, str) and _URL.match(value):
            uses.append(f"{path} is a URL")  # the value may carry credentials: named by key only
        elif (isinstance(value, str) and value and _MODEL_KEY.search(path.rsplit(".", 1)[-1])
              and not os.path.exists(os.path.expanduser(value)) and os.environ.get("HF_HUB_OFFLINE") != "1"):
            uses.append(f"{path} '{value}' comes from the Hugging Face Hub (HF_HUB_OFFLINE=1 uses the cache)")

    walk({k: v for k, v in values.items() if k != "ray"}, "")
    for path, cls in found.items():
        use = getattr(cls, "network_use", None)
        if callable(use) and (what := use(values)):
            uses.append(f"{path}: {what}")
    for cls in sinks:
        use = getattr(cls, "network_use", None)
        if callable(use) and (what := use(values)):
            uses.append(f"logger.backend: {what}")
    return uses


def requested(values: Mapping[str, Any]) -> bool:
    """The recipe asks for it (``launch_mode: ray`` and ``ray.private_network: true``)."""
    return values.get("launch_mode") == "ray" and _ray_section(values)["private_network"] is True


def _ray_section(values: Mapping[str, Any]) -> dict[str, Any]:
    return {**option_defaults(RaySectionSettings.options()), **(values.get("ray") or {})}


def plan(values: Mapping[str, Any], found: Mapping[str, type], sinks: list[type]) -> Plan:
    """The decision for a loaded recipe (its components already resolved)."""
    if not requested(values):
        return Plan()
    address = _ray_section(values)["address"] or os.environ.get("RAY_ADDRESS")
    if address:
        return Plan(problem=f"{KEY}: true isolates a cluster the run starts; the run attaches to "
                            f"{address} (ray.address / RAY_ADDRESS), whose security is its owner's")
    uses = network_uses(values, found, sinks)
    if uses:
        return Plan(problem=f"{KEY}: true cuts the run off the network, but {'; '.join(uses)} (set {KEY}: false)")
    refused = None if inside() else probe()
    if refused:
        return Plan(problem=f"{KEY}: true, but the kernel refuses a network namespace here ({refused}); set "
                            f"{KEY}: false (the local cluster still listens on loopback only)")
    return Plan(private=True)


_probed: list[str | None] = []


def probe() -> str | None:
    """None when this process may make a private network namespace, else the kernel's answer."""
    if not _probed:
        try:
            done = subprocess.run([sys.executable, "-I", "-S", _SCRIPT, "--probe"], capture_output=True,
                                  text=True, timeout=30)
            _probed.append(None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}"))
        except (OSError, subprocess.SubprocessError) as exc:
            _probed.append(str(exc))
    return _probed[0]


def rerun_inside(argv: list[str]) -> int:
    """Run ``nexrl <argv>`` again in a private network namespace; its exit code. This process only
    waits: SIGTERM and SIGHUP go on to the run; Ctrl-C reaches it directly (one process group), so
    SIGINT is ignored here (the run stops cleanly on both)."""
    command = [sys.executable, "-I", "-S", _SCRIPT, "--", sys.executable, "-m", "nexrl_core.cli", *argv]
    child = subprocess.Popen(command)

    def forward(signum: int, _frame: Any) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
                signal.SIGHUP: signal.signal(signal.SIGHUP, forward)}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code
