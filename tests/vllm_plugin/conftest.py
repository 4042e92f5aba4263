"""Fixtures of the nexrl-vllm tests: fake vLLM servers on loopback (in-process or as a fake
`vllm serve` executable), a plugin manager with the plugin, and process checks through /proc."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.support.vllm_server import FakeVLLMServer

FAKE_VLLM = [sys.executable, str(Path(__file__).resolve().parents[1] / "support" / "fake_vllm.py")]


@pytest.fixture
def fake_vllm():
    """An in-process fake vLLM server (development routes and weight transfer on)."""
    with FakeVLLMServer(model="fake-model") as server:
        yield server


@pytest.fixture
def vllm_pm(monkeypatch):
    """nexrl-core's built-ins plus nexrl-vllm, installed as the process default."""
    import nexrl_core.plugins as plugins
    import nexrl_vllm.plugin

    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "")
    pm = plugins.PluginManager()
    pm.register(nexrl_vllm.plugin, "vllm", "nexrl-vllm")
    monkeypatch.setattr(plugins, "_DEFAULT", pm)
    return pm


def serve_config(tmp_path: Path, *fake_flags: str, **keys) -> dict:
    """A managed-serve config that starts the fake `vllm serve` executable."""
    return {"model_path": str(tmp_path), "command": FAKE_VLLM, "model": "fake-model", "startup_timeout": 20.0,
            "shutdown_grace": 5.0, "log_file": str(tmp_path / "vllm_server.log"),
            "extra_args": ["--fake-record", str(tmp_path / "fake.json"), *fake_flags],
            "timeout": 5.0, "max_retries": 1, "retry_backoff": 0.05, "max_retry_time": 3.0, **keys}


def pid_alive(pid: int | None) -> bool:
    """True while ``pid`` is a live process (a zombie counts as gone)."""
    if not pid:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(*pids: int | None, timeout: float = 10.0) -> list[int]:
    """The pids still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    """Every process a test started is gone when it ends."""
    before = set(_children(os.getpid()))
    yield
    left = [p for p in wait_gone(*(set(_children(os.getpid())) - before), timeout=10)]
    assert not left, f"processes left running: {left}"


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out
