"""Host side of the code sandbox: runs untrusted Python on a list of stdin inputs.

Each :meth:`Sandbox.run` starts one launcher process (``_sandbox_launcher.py``, which documents the
process tree and isolation) and reads its per-input results as they come. Isolation is chosen
once per process: ``auto`` (and ``namespaces``) requires Linux namespaces and refuses where the
kernel denies them, naming the opt-in to the weaker mode; ``rlimits`` is that opt-in, announced by
a one-time warning that says what it does not protect against. Either way the runner gets the
launcher's seccomp filter where the kernel accepts it (probed once per process).
Thread-safe: every run has its own processes; the shared state (the chosen mode, the fallback's
uid slots) is behind locks.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

LAUNCHER = str(Path(__file__).with_name("_sandbox_launcher.py"))
ISOLATION_MODES = ("auto", "namespaces", "rlimits")
# The sandbox's uid/gid (also in the host's namespaces when running as root with namespaces).
SANDBOX_ID = 65534
# The rlimits fallback as root gives every concurrent run a uid of its own from this range, so
# a run cannot signal another's processes and RLIMIT_NPROC is per run.
_FALLBACK_UID_BASE, _FALLBACK_UID_SLOTS = 64000, 256
# Starting the launcher and building the namespaces (what a run may take beyond its inputs' limits).
_STARTUP_ALLOWANCE_S = 30.0
_PER_CASE_SLACK_S = 2.0
_STOP_TIMEOUT_S = 10.0

# What the rlimits fallback does not protect against (the warning and docs/rewards.md list these).
FALLBACK_GAPS = (
    "it can read every world-readable file and list every process with its command line (/proc)",
    "it can import every package it can read (a virtualenv's site-packages included) by adding it to sys.path",
    "it can write to world-writable places (/tmp, /dev/shm) within the file-size limit, and such files stay",
    "it can connect to unix-domain sockets it may write to and to abstract ones of the host's network namespace",
)
FALLBACK_GAPS_WITHOUT_SECCOMP = (
    "no network isolation: the code can open sockets, reach loopback services and the internet",
)
FALLBACK_GAPS_WITHOUT_CGROUPS = (
    "memory is capped per process (RLIMIT_AS), not for the whole run",
    "a process that escapes the launcher's process tree after the launcher itself is killed survives",
)
FALLBACK_GAPS_NOT_ROOT = (
    "it runs as your user: it can read and change your files, read /proc/<pid>/environ of your processes "
    "(API keys) and signal or kill the trainer",
    "its process limit counts all of your processes",
)
# Memory of the run's own launcher processes, on top of the code's limits in the run's cgroup.
_CGROUP_SLACK = 96 * 1024 * 1024


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code under test): the evaluation must fail, not score 0."""


class NamespacesRefused(SandboxError):
    """``isolation: auto`` or ``namespaces`` where the kernel refuses Linux namespaces."""

    def __init__(self, why: str):
        self.why = why
        super().__init__(f"Linux namespaces are not available here ({why}), so the code would run without "
                         f"network, filesystem and process isolation; isolation: rlimits accepts that weaker "
                         f"sandbox (docs/rewards.md says what it does not protect against)")


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512
    max_processes: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 1 << 20
    max_file_mb: int = 16

    def as_request(self) -> dict:
        mb = 1024 * 1024
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "memory_bytes": self.memory_mb * mb,
                "nproc": self.max_processes, "nofile": self.max_open_files,
                "output_bytes": self.max_output_bytes, "fsize_bytes": self.max_file_mb * mb,
                "disk_bytes": self.max_file_mb * mb}


@dataclass
class CaseRun:
    """One input's run. ``status``: ``ok`` (exit code 0), ``timeout``, ``cpu_limit``,
    ``memory_limit``, ``output_limit``, ``syntax_error``, ``runtime_error`` or ``crashed``."""

    index: int
    status: str
    exit_code: int | None
    signal: str | None
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float


def classify(raw: dict, limits: Limits, oom_killed: bool = False) -> CaseRun:
    sig = raw.get("signal")
    last_lines = "\n".join(raw["stderr"].strip().splitlines()[-3:])
    if raw["output_limited"]:
        status = "output_limit"
    elif raw["timed_out"]:
        status = "timeout"
    elif oom_killed and (sig == signal.SIGKILL or "MemoryError" in last_lines or raw["exit_code"] != 0):
        status = "memory_limit"
    elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and raw["cpu_s"] >= limits.cpu_s - 0.05):
        status = "cpu_limit"
    elif sig is not None:
        status = "crashed"
    elif raw["exit_code"] == 0:
        status = "ok"
    elif "MemoryError" in last_lines:
        status = "memory_limit"
    elif any(name in last_lines for name in ("SyntaxError", "IndentationError", "TabError")):
        status = "syntax_error"
    else:
        status = "runtime_error"
    return CaseRun(index=raw["index"], status=status, exit_code=raw["exit_code"],
                   signal=signal.Signals(sig).name if sig is not None else None,
                   stdout=raw["stdout"], stderr=raw["stderr"], wall_s=raw["wall_s"], cpu_s=raw["cpu_s"])


def _stop_launcher(proc: subprocess.Popen, asked_to_stop: bool) -> None:
    """Wait for the launcher to end; SIGTERM first when it still has cases to run (it then kills
    what runs and exits), SIGKILL to its whole process group as the last resort."""
    try:
        if asked_to_stop and proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # safe: the group leader is not reaped yet
            proc.wait()
    finally:
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def base_interpreter() -> str:
    """The real interpreter behind this one (a virtualenv's python is a link to it)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


_RUNTIME_CACHE: dict[str, list[str]] = {}
_SYSTEM_LIB_DIRS = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32")


def runtime_paths(python: str) -> list[str]:
    """What the sandbox must see to run ``python``: the binary, its standard library and shared
    libraries (system library folders and its own LIBDIR), read-only."""
    if python not in _RUNTIME_CACHE:
        probe = ("import json, sys, sysconfig; p = sysconfig.get_paths(); "
                 "print(json.dumps([p['stdlib'], p['platstdlib'], sysconfig.get_config_var('LIBDIR') or '']))")
        try:
            out = subprocess.run([python, "-I", "-S", "-c", probe], capture_output=True, text=True, env={},
                                 timeout=60, check=True).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise SandboxError(f"cannot run the sandbox interpreter {python}: {exc}") from exc
        paths = [python, *json.loads(out), *_SYSTEM_LIB_DIRS]
        kept: list[str] = []
        for path in sorted({os.path.normpath(p) for p in paths if p and os.path.lexists(p)}):
            if os.path.islink(path) or not any(path.startswith(k.rstrip("/") + "/") for k in kept
                                               if not os.path.islink(k)):
                kept.append(path)
        _RUNTIME_CACHE[python] = kept
    return _RUNTIME_CACHE[python]


class _UidSlots:
    def __init__(self) -> None:
        self._free = list(range(_FALLBACK_UID_SLOTS))
        self._cond = threading.Condition()

    def take(self) -> int:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return _FALLBACK_UID_BASE + self._free.pop()

    def give(self, uid: int) -> None:
        with self._cond:
            self._free.append(uid - _FALLBACK_UID_BASE)
            self._cond.notify()


class RunCgroup:
    """Memory and pids cgroups holding one run's processes (the launcher joins them first, so
    everything it starts is inside): a memory cap for the whole run, however many processes it
    forks, an OOM count to tell an out-of-memory kill from other kills, and a list of every
    process to kill at the end. Only where this process may create cgroups (root, v1 or v2)."""

    _layout: list[tuple[str, str]] | None = None  # (controller, folder of this process's cgroup)
    _layout_lock = threading.Lock()
    _counter = 0

    def __init__(self, folders: dict[str, str]):
        self.folders = folders  # controller -> the run's cgroup folder

    @classmethod
    def layout(cls) -> list[tuple[str, str]]:
        with cls._layout_lock:
            if cls._layout is None:
                cls._layout = _cgroup_layout()
            return cls._layout

    @classmethod
    def create(cls, memory_bytes: int, pids: int) -> RunCgroup | None:
        layout = cls.layout()
        if not layout:
            return None
        with cls._layout_lock:
            cls._counter += 1
            name = f"nexrl-sandbox-{os.getpid()}-{cls._counter}"
        folders: dict[str, str] = {}
        try:
            for controller, parent in layout:
                folder = os.path.join(parent, name)
                os.mkdir(folder)
                folders[controller] = folder
                for file, value in _cgroup_limits(controller, memory_bytes, pids):
                    if os.path.exists(os.path.join(folder, file)):
                        with open(os.path.join(folder, file), "w") as f:
                            f.write(str(value))
        except OSError as exc:
            RunCgroup(folders).remove()
            raise SandboxError(f"cannot set up the run's cgroup: {exc}") from exc
        return cls(folders)

    def procs_files(self) -> list[str]:
        return [os.path.join(folder, "cgroup.procs") for folder in self.folders.values()]

    def oom_kills(self) -> int:
        folder = self.folders.get("memory") or self.folders.get("unified")
        if folder is None:
            return 0
        for file in ("memory.events", "memory.oom_control"):
            try:
                with open(os.path.join(folder, file)) as f:
                    for line in f:
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value)
            except OSError:
                continue
        return 0

    def remove(self) -> None:
        """Kill whatever is still inside (a process that left the launcher's tree), then remove."""
        for folder in self.folders.values():
            for _ in range(100):
                try:
                    with open(os.path.join(folder, "cgroup.procs")) as f:
                        pids = [int(line) for line in f if line.strip()]
                except OSError:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    os.rmdir(folder)
                    break
                except OSError:
                    time.sleep(0.01)  # the killed processes are still exiting


def _cgroup_limits(controller: str, memory_bytes: int, pids: int) -> list[tuple[str, int]]:
    if controller == "memory":  # v1; memsw (memory + swap) must come after the memory limit
        return [("memory.limit_in_bytes", memory_bytes), ("memory.memsw.limit_in_bytes", memory_bytes)]
    if controller == "pids":
        return [("pids.max", pids)]
    return [("memory.max", memory_bytes), ("memory.swap.max", 0), ("pids.max", pids)]  # v2


def _cgroup_layout() -> list[tuple[str, str]]:
    """Where this process may create the run's cgroups: v2 with memory and pids enabled for its
    children, else v1 memory + pids; [] when neither is writable here."""
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        return []
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return []
    paths = {ctrl: path for _, ctrls, path in entries for ctrl in (ctrls.split(",") if ctrls else ["unified"])}
    candidates: list[list[tuple[str, str]]] = []
    if "unified" in paths and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        folder = "/sys/fs/cgroup" + paths["unified"]
        try:
            with open(os.path.join(folder, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
        except OSError:
            enabled = []
        if {"memory", "pids"} <= set(enabled):
            candidates.append([("unified", folder)])
    if "memory" in paths and "pids" in paths:
        candidates.append([("memory", "/sys/fs/cgroup/memory" + paths["memory"]),
                           ("pids", "/sys/fs/cgroup/pids" + paths["pids"])])
    for layout in candidates:
        probe = f"nexrl-sandbox-probe-{os.getpid()}"
        made = []
        try:
            for _, parent in layout:
                os.mkdir(os.path.join(parent, probe))
                made.append(os.path.join(parent, probe))
            return layout
        except OSError:
            continue
        finally:
            for folder in made:
                os.rmdir(folder)
    return []


_UID_SLOTS = _UidSlots()
_MODES: dict[tuple[str, str], str] = {}
_MODES_LOCK = threading.Lock()
_WARNED = False
_SECCOMP: list[bool] = []  # probed once per process
_SECCOMP_LOCK = threading.Lock()


def seccomp_available() -> bool:
    """Whether the launcher's seccomp filter installs here and refuses what it should (a child
    of a launcher tries it); a one-time warning says why not."""
    with _SECCOMP_LOCK:
        if not _SECCOMP:
            why = "seccomp needs Linux" if not sys.platform.startswith("linux") else _probe_seccomp()
            if why:
                logger.warning(f"code_sandbox: no seccomp filter ({why}): the sandboxed code may use ptrace "
                               f"and open sockets of every family. See docs/rewards.md.")
            _SECCOMP.append(why is None)
        return _SECCOMP[0]


def _probe_seccomp() -> str | None:
    try:
        done = subprocess.run([base_interpreter(), "-I", "-S", "-B", LAUNCHER], input=b'{"mode": "probe_seccomp"}',
                              capture_output=True, env={}, timeout=_STARTUP_ALLOWANCE_S)
        return json.loads(done.stdout)["problem"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
        return f"the probe failed: {exc}"


class Sandbox:
    def __init__(self, python: str | None = None, isolation: str = "auto", limits: Limits = Limits()):
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation {isolation!r} is not one of {', '.join(ISOLATION_MODES)}")
        # The code's interpreter: a real binary (a virtualenv's python is a link) the sandbox binds.
        self.python = os.path.realpath(python) if python else base_interpreter()
        self.isolation = isolation
        self.limits = limits

    @property
    def run_cgroups(self) -> bool:
        """Whether runs get a cgroup (a memory cap for the whole run) on this machine."""
        return bool(RunCgroup.layout())

    @property
    def mode(self) -> str:
        """``namespaces`` or ``rlimits``: probed once per process and interpreter."""
        global _WARNED
        key = (self.python, self.isolation)
        with _MODES_LOCK:
            if key in _MODES:
                return _MODES[key]
            if self.isolation == "rlimits":
                mode = "rlimits"
            else:
                why = self._probe_namespaces()
                if why is None:
                    mode = "namespaces"
                else:
                    raise NamespacesRefused(why)
            if mode == "rlimits" and not _WARNED:
                _WARNED = True
                gaps = self.fallback_gaps()
                logger.warning(f"code_sandbox: isolation: rlimits: the code runs without Linux namespaces, under "
                               f"rlimits, an empty environment, a temporary directory"
                               f"{', a separate uid' if os.geteuid() == 0 else ''}"
                               f"{' and a seccomp filter' if self.seccomp else ''}. This does NOT protect "
                               f"against: {'; '.join(gaps)}. See docs/rewards.md.")
            _MODES[key] = mode
            return mode

    @property
    def seccomp(self) -> bool:
        return seccomp_available()

    def fallback_gaps(self) -> tuple[str, ...]:
        """What the rlimits mode does not protect against on this machine, as this user."""
        return FALLBACK_GAPS + (() if self.seccomp else FALLBACK_GAPS_WITHOUT_SECCOMP) + \
            (() if RunCgroup.layout() else FALLBACK_GAPS_WITHOUT_CGROUPS) + \
            (() if os.geteuid() == 0 else FALLBACK_GAPS_NOT_ROOT)

    def _probe_namespaces(self) -> str | None:
        """None when a namespaced launcher starts here, else why not."""
        if not sys.platform.startswith("linux"):
            return f"{sys.platform} is not Linux"
        try:
            self._launch("namespaces", "pass", [], None)
        except SandboxError as exc:
            return str(exc)
        return None

    def run(self, code: str, inputs: Sequence[str],
            keep_going: Callable[[CaseRun], bool] | None = None) -> list[CaseRun]:
        """Run ``code`` once per input (its stdin). ``keep_going(run)`` returning False stops the
        remaining inputs (they are left out of the result)."""
        return self._launch(self.mode, code, list(inputs), keep_going)

    def _launch(self, mode: str, code: str, inputs: list[str],
                keep_going: Callable[[CaseRun], bool] | None) -> list[CaseRun]:
        mb = 1024 * 1024
        cgroup = RunCgroup.create(memory_bytes=(self.limits.memory_mb + self.limits.max_file_mb) * mb + _CGROUP_SLACK,
                                  pids=self.limits.max_processes + 8)
        try:
            return self._launch_in(mode, code, inputs, keep_going, cgroup)
        finally:
            if cgroup is not None:
                cgroup.remove()

    def _launch_in(self, mode: str, code: str, inputs: list[str], keep_going: Callable[[CaseRun], bool] | None,
                   cgroup: RunCgroup | None) -> list[CaseRun]:
        fallback_uid = _UID_SLOTS.take() if mode == "rlimits" and os.geteuid() == 0 else None
        sandbox_id = fallback_uid if fallback_uid is not None else SANDBOX_ID
        request = {"mode": mode, "python": self.python, "binds": runtime_paths(self.python), "code": code,
                   "inputs": inputs, "limits": self.limits.as_request(), "uid": sandbox_id, "gid": sandbox_id,
                   "seccomp": self.seccomp,
                   "cgroup_procs": cgroup.procs_files() if cgroup is not None else []}
        # The launcher runs on nexrl's own interpreter (it needs Python >= 3.10); only the code runs on
        # self.python.
        proc = subprocess.Popen([base_interpreter(), "-I", "-S", "-B", LAUNCHER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, close_fds=True,
                                start_new_session=True)  # its own process group: one killpg ends it all
        complete: list[bool] = []  # set once the launcher said "done": it is exiting by itself
        try:
            return self._collect(proc, json.dumps(request).encode(), len(inputs), keep_going, complete, cgroup)
        finally:
            _stop_launcher(proc, asked_to_stop=not complete)
            if fallback_uid is not None:
                _UID_SLOTS.give(fallback_uid)

    def _collect(self, proc: subprocess.Popen, request: bytes, n_inputs: int,
                 keep_going: Callable[[CaseRun], bool] | None, complete: list,
                 cgroup: RunCgroup | None) -> list[CaseRun]:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None  # all PIPE
        try:
            proc.stdin.write(request)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the launcher died at once: its stderr says why (below)
        budget = _STARTUP_ALLOWANCE_S + n_inputs * (self.limits.wall_s + _PER_CASE_SLACK_S)
        deadline = time.monotonic() + budget
        streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        open_fds = set(streams)
        runs: list[CaseRun] = []
        done = False
        oom_kills = 0
        while open_fds and not done:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxError(f"the sandbox launcher did not finish within {budget:.0f}s")
            for fd in select.select(list(open_fds), [], [], remaining)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_fds.discard(fd)
                    continue
                streams[fd] += chunk
            out = streams[proc.stdout.fileno()]
            while b"\n" in out and not done:
                line, _, rest = bytes(out).partition(b"\n")
                out[:] = rest
                event = json.loads(line)
                if event["event"] == "error":
                    raise SandboxError(f"sandbox setup failed: {event['message']}")
                if event["event"] == "case":
                    # an OOM kill in the run's cgroup since the last case: this case ran out of memory
                    now = cgroup.oom_kills() if cgroup is not None else 0
                    runs.append(classify(event, self.limits, oom_killed=now > oom_kills))
                    oom_kills = now
                    if keep_going is not None and not keep_going(runs[-1]):
                        done = True
                elif event["event"] == "done":
                    done = True
                    complete.append(True)
        if not done:
            proc.wait()
            err = bytes(streams[proc.stderr.fileno()]).decode(errors="replace").strip()[-2000:]
            raise SandboxError(f"the sandbox launcher exited with code {proc.returncode} after {len(runs)} of "
                               f"{n_inputs} inputs{': ' + err if err else ''}")
        return runs
