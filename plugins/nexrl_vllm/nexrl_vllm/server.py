"""`vllm serve` as a managed subprocess: start, wait until ready, watch, stop without orphans.

The server runs in its own process group (vLLM starts engine-core and worker processes), so a
stop signals the whole group: SIGTERM, then SIGKILL after a grace period. Every exit path of
nexrl stops it: :meth:`ManagedVLLMServer.stop` (the client's ``close()``), a finalizer at
interpreter exit (a run that failed before the controller could close the client), and on
Linux the kernel's parent-death signal when nexrl itself is killed with SIGKILL.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from nexrl_core import InferenceError, NexRLError

from .control import HTTPFailure, request

LOOPBACK_NAMES = ("localhost",)
WORKER_EXTENSION = "nexrl_vllm.worker_extension.NexrlWorkerExtension"  # methods nexrl calls via /collective_rpc
_PR_SET_PDEATHSIG = 1


class ServerStartError(NexRLError, InferenceError):
    """The managed vLLM server exited during start-up or never became ready (the CLI prints the
    message, with the end of the server's log, and no traceback)."""


@dataclass
class ServeOptions:
    """What `vllm serve` is started with (the serve keys of ``service.inference_service``)."""

    model_path: str
    command: list[str] = field(default_factory=lambda: ["vllm", "serve"])
    host: str = "127.0.0.1"
    port: int | None = None
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    max_model_len: int | None = None
    logprobs_mode: str = "processed_logprobs"
    weight_transfer: str | None = None  # "nccl": serve with vLLM's NCCL weight-transfer engine
    max_lora_rank: int | None = None  # set: serve LoRA adapters, loaded at run time (vllm_lora)
    worker_extension: bool = False  # --worker-extension-cls WORKER_EXTENSION (a vLLM that can import nexrl_vllm)
    dev_endpoints: bool = True
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    startup_timeout: float = 900.0
    shutdown_grace: float = 15.0
    log_file: str = "vllm_server.log"


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def serve_command(opts: ServeOptions, port: int) -> list[str]:
    """The full command line: ``command`` then vLLM's own flags (vLLM's spelling, `vllm serve --help`)."""
    cmd = [*opts.command, opts.model_path, "--host", opts.host, "--port", str(port),
           "--tensor-parallel-size", str(opts.tensor_parallel_size),
           "--gpu-memory-utilization", str(opts.gpu_memory_utilization),
           "--dtype", opts.dtype, "--logprobs-mode", opts.logprobs_mode]
    if opts.served_model_name:
        cmd += ["--served-model-name", opts.served_model_name]
    if opts.max_model_len:
        cmd += ["--max-model-len", str(opts.max_model_len)]
    if opts.worker_extension:
        cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    if opts.max_lora_rank:
        cmd += ["--enable-lora", "--max-lora-rank", str(opts.max_lora_rank)]
    if opts.weight_transfer:
        cmd += ["--weight-transfer-config", f'{{"backend": "{opts.weight_transfer}"}}']
    return cmd + [str(a) for a in opts.extra_args]


def log_tail(path: str, lines: int = 30, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"
    tail = "\n".join(text.splitlines()[-lines:])
    return tail[-limit:] if tail.strip() else "(the log is empty)"


def _prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()  # looked up here: the forked child only calls it


def _set_parent_death_signal() -> None:
    # Linux: the server gets SIGTERM when the thread that started it dies (nexrl killed with SIGKILL).
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop_group(proc: subprocess.Popen, grace: float) -> int | None:
    """SIGTERM the process group, SIGKILL it after ``grace`` seconds; the leader's exit code."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                return proc.returncode
            time.sleep(0.05)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    return proc.returncode


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies of the group still count for killpg; look for a live member.
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


class ManagedVLLMServer:
    """One `vllm serve` subprocess. :meth:`start` returns once it answers ``/health`` and ``/v1/models``."""

    READY_POLL_S = 0.25

    def __init__(self, opts: ServeOptions):
        self.opts = opts
        self.port = int(opts.port) if opts.port else free_port(opts.host)
        self.command = serve_command(opts, self.port)
        self.proc: subprocess.Popen | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._finalizer: Any = None

    @property
    def url(self) -> str:
        host = f"[{self.opts.host}]" if ":" in self.opts.host else self.opts.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> ManagedVLLMServer:
        opts = self.opts
        env = {**os.environ, **{str(k): str(v) for k, v in opts.env.items()}}
        if opts.dev_endpoints:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # pause/resume, reset_prefix_cache, reload and weight transfer
        if opts.max_lora_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        if opts.api_key:
            env["VLLM_API_KEY"] = opts.api_key  # not on the command line, where `ps` and the log would show it
        log_dir = os.path.dirname(os.path.abspath(opts.log_file))
        os.makedirs(log_dir, exist_ok=True)
        with open(opts.log_file, "ab") as log:
            log.write(f"--- nexrl starts: {shlex.join(self.command)}\n".encode())
            log.flush()
            main_thread = threading.current_thread() is threading.main_thread()
            try:
                self.proc = subprocess.Popen(
                    self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True, preexec_fn=_set_parent_death_signal if main_thread and _PRCTL else None)
            except OSError as exc:
                raise ServerStartError(f"cannot start the vLLM server ({shlex.join(self.command)}): {exc}") from None
        # Stops the server at interpreter exit if nobody called stop() (e.g. the run failed to build).
        self._finalizer = weakref.finalize(self, _stop_group, self.proc, opts.shutdown_grace)
        logger.info(f"vLLM server starting (pid {self.proc.pid}, {self.url}); log: {opts.log_file}")
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        logger.info(f"vLLM server ready at {self.url}")
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + float(self.opts.startup_timeout)
        headers = {"Authorization": f"Bearer {self.opts.api_key}"} if self.opts.api_key else {}
        last = "no answer yet"
        assert self.proc is not None  # started
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"the vLLM server exited with code {code} during start-up ({shlex.join(self.command)}). "
                    f"Last lines of {self.opts.log_file}:\n{log_tail(self.opts.log_file)}")
            try:
                health = request(self.url, "GET", "/health", headers=headers, timeout=5.0)
                if health.status == 200:
                    models = request(self.url, "GET", "/v1/models", headers=headers, timeout=5.0)
                    if models.status == 200 and models.json().get("data"):
                        return
                    last = f"/v1/models answered HTTP {models.status}"
                else:
                    last = f"/health answered HTTP {health.status}"
            except (HTTPFailure, ValueError, AttributeError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"the vLLM server at {self.url} did not become ready within {self.opts.startup_timeout:g}s "
                    f"(service.inference_service.startup_timeout; last check: {last}). "
                    f"Last lines of {self.opts.log_file}:\n{log_tail(self.opts.log_file)}")
            time.sleep(self.READY_POLL_S)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Stop the server and everything it started (idempotent)."""
        with self._lock:
            if self._stopped or self.proc is None:
                return
            self._stopped = True
        if self._finalizer is not None:
            self._finalizer.detach()
        code = _stop_group(self.proc, float(self.opts.shutdown_grace))
        logger.info(f"vLLM server (pid {self.proc.pid}) stopped (exit code {code})")


def parse_command(value: Any, key: str) -> list[str]:
    """``command`` as a list of strings (a string is split like a shell would)."""
    if isinstance(value, str):
        parts = shlex.split(value)
    elif isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        parts = list(value)
    else:
        raise ValueError(f"{key}: expected a command (a string or a list of strings), got {value!r}")
    if not parts:
        raise ValueError(f"{key}: the command is empty")
    return parts
