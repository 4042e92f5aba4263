"""A pool of math-verify worker processes that any number of threads can share.

A request runs in a worker's main thread under a SIGALRM deadline (soft: math-verify stops at
the next bytecode). A worker that does not answer within the deadline plus a grace period is
stuck in C code: it is killed and replaced, and the request counts as timed out. One pool per
(size, memory) setting is shared by every evaluator of the process.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from typing import Any

# A worker past its soft deadline gets this long to answer before it is killed.
_GRACE_S = 2.0
# Importing sympy + math-verify takes ~1 s on an idle machine; much more under load.
_STARTUP_TIMEOUT_S = 120.0


class VerifierUnavailable(RuntimeError):
    """The worker process cannot start or answer (an installation problem, not the model's)."""


class _Worker:
    def __init__(self, memory_mb: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-m", "nexrl_rewards._verify_worker", str(memory_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
            start_new_session=True)  # a Ctrl-C of the run reaches the run, not the workers mid-answer
        self._buffer = b""
        self.missed_deadline = False
        ready = self._read_line(time.monotonic() + _STARTUP_TIMEOUT_S)
        if ready is None or json.loads(ready).get("status") != "ready":
            self.kill()
            raise VerifierUnavailable(
                f"the math-verify worker ({sys.executable} -m nexrl_rewards._verify_worker) did not start "
                f"(exit code {self.proc.poll()}); is math-verify installed in this environment?")

    def ask(self, request: dict[str, Any], hard_timeout: float) -> dict[str, Any] | None:
        """The worker's answer, or None when it died or missed the hard deadline (then it is dead)."""
        stdin = self.proc.stdin
        assert stdin is not None  # started with stdin=PIPE
        try:
            stdin.write((json.dumps(request) + "\n").encode())
            stdin.flush()
        except OSError:
            self.kill()
            return None
        line = self._read_line(time.monotonic() + hard_timeout)
        if line is None:
            self.kill()
            return None
        return json.loads(line)

    def _read_line(self, deadline: float) -> bytes | None:
        stdout = self.proc.stdout
        assert stdout is not None  # started with stdout=PIPE
        fd = stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                self.missed_deadline = True
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


class VerifierPool:
    """At most ``size`` requests run at once; idle workers are reused."""

    def __init__(self, size: int, memory_mb: int):
        self.size = size
        self.memory_mb = memory_mb
        self._slots = threading.BoundedSemaphore(size)
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self.replaced = 0  # workers killed after a hard timeout or a crash

    def check(self, gold: str, pred: str, timeout_s: float) -> dict[str, Any]:
        """math-verify's verdict on ``pred`` against ``gold`` (see _verify_worker for the fields)."""
        with self._slots:
            worker = self._take()
            answer = worker.ask({"gold": gold, "pred": pred, "timeout": timeout_s}, timeout_s + _GRACE_S)
            if answer is None:
                with self._lock:
                    self._all.discard(worker)
                    self.replaced += 1
                if worker.missed_deadline:
                    return _no_verdict("timeout", f"no answer within {timeout_s + _GRACE_S:.3g}s; the worker was killed")
                return _no_verdict("error", f"the worker died (exit code {worker.proc.returncode})")
            self._idle.put(worker)
            return answer

    def _take(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            worker = _Worker(self.memory_mb)
            with self._lock:
                self._all.add(worker)
            return worker

    def close(self) -> None:
        with self._lock:
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.kill()


def _no_verdict(status: str, error: str) -> dict[str, Any]:
    return {"status": status, "equal": False, "gold": [], "pred": [], "gold_is_math": False, "pred_is_math": False,
            "error": error}


_POOLS: dict[tuple[int, int], VerifierPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(size: int, memory_mb: int) -> VerifierPool:
    with _POOLS_LOCK:
        pool = _POOLS.get((size, memory_mb))
        if pool is None:
            pool = _POOLS[(size, memory_mb)] = VerifierPool(size, memory_mb)
        return pool


@atexit.register
def _close_pools() -> None:
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()
