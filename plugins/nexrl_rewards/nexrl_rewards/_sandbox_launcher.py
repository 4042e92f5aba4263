"""Sandbox launcher: runs untrusted Python against test inputs. Standard library only.

Started by sandbox.py as ``python -I -S -B _sandbox_launcher.py`` with an empty environment. It
reads one JSON request on stdin and writes JSON lines on stdout: ``{"event": "ready", ...}``,
one ``{"event": "case", ...}`` per input, then ``{"event": "done"}``; a setup problem is
``{"event": "error", "message": ...}`` and exit code 3. It never compares outputs: the
evaluator does that outside the sandbox.

``mode: namespaces`` (the process tree)::

    launcher L  (host namespaces; root only: forks a helper H that writes L's uid/gid maps)
      unshare(user, mount, pid, net, ipc, uts)
      └─ init C  (pid 1 of the new pid namespace; builds the filesystem view, then per input:)
           └─ runner R  (uid 65534, no capabilities, rlimits, no_new_privs, execs python)

C mounts a tmpfs as the new root holding only read-only binds of the Python runtime, a few
device nodes and the solution file; ``pivot_root`` drops the host tree from the mount
namespace. No /proc, no /etc, no network interface up. Each input gets a fresh tmpfs at
/work (the only writable place, size-capped, noexec) and ends with SIGKILL to every other
process of the pid namespace. Nested user namespaces are disabled (max_user_namespaces=0)
where the kernel keeps that limit per namespace. When the request names cgroups, the launcher
joins them before anything else, so every process of the run is inside.

``mode: rlimits`` (no namespaces available) is the fallback: rlimits, an empty environment, a
fresh 0700 temporary directory, a separate uid when root, no_new_privs, and every descendant
killed after each input (the launcher is their child subreaper). See docs/rewards.md for what
it does not protect against.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

# shutil and tempfile are imported by the fallback only: a launcher's start is part of every run.

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 36, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
# statvfs f_flag bits -> the mount flags a bind remount must keep (the kernel locks them in a user namespace)
_KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
               (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
DEVICES = ("null", "zero", "random", "urandom")
NEW_ROOT = "/tmp"  # mounted over inside the private mount namespace only
SOLUTION = "/sandbox/solution.py"
_STDERR_KEPT = 4096  # the tail of stderr that travels back (enough for a traceback's last lines)
_CHUNK = 65536

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


# ----------------------------------------------------------------------------- seccomp
# A classic-BPF filter, written here so the launcher needs nothing beyond the standard library.
# It sees the syscall number, the architecture and the raw arguments (not what pointers point to).

SECCOMP_MODE_FILTER = 2
RET_KILL_PROCESS, RET_ALLOW = 0x80000000, 0x7FFF0000
RET_ERRNO = 0x00050000
EPERM, EAFNOSUPPORT, AF_UNIX = 1, 97, 1
# arch -> (AUDIT_ARCH_*, syscalls refused with EPERM, the socket/socketpair numbers)
# Refused: ptrace and what reads or steals from another process without it (process_vm_*,
# pidfd_getfd), and io_uring, whose socket operations would bypass the socket rule.
_SECCOMP_ARCH = {
    "x86_64": (0xC000003E, {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
                            "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}, (41, 53)),
    "aarch64": (0xC00000B7, {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
                             "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}, (198, 199)),
}
_X32_SYSCALL_BIT = 0x40000000


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions: another architecture's or ABI's syscalls kill
    the process; the listed calls fail with EPERM; socket()/socketpair() of any family but
    AF_UNIX fail with EAFNOSUPPORT; everything else is allowed."""
    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    arch, refused, (sock, sockpair) = _SECCOMP_ARCH[machine]
    prog = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, RET_KILL_PROCESS), (load, 0, 0, 0)]  # arch; nr
    if machine == "x86_64":  # the x32 ABI numbers the same calls differently
        prog += [(jge, 0, 1, _X32_SYSCALL_BIT), (ret, 0, 0, RET_KILL_PROCESS)]
    for nr in refused.values():
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, RET_ERRNO | EPERM)]
    prog += [(jeq, 1, 0, sock), (jeq, 0, 4, sockpair),
             (load, 0, 0, 16),  # args[0], its low 32 bits (little-endian): the family
             (jeq, 0, 1, AF_UNIX), (ret, 0, 0, RET_ALLOW), (ret, 0, 0, RET_ERRNO | EAFNOSUPPORT),
             (ret, 0, 0, RET_ALLOW)]
    return prog


def install_seccomp() -> None:
    """Filter this process and everything it starts (no_new_privs must be set first)."""
    machine = os.uname().machine
    if machine not in _SECCOMP_ARCH:
        raise SetupError(f"seccomp: no filter for {machine}")
    prog = seccomp_program(machine)
    array = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), array)
    _check(_libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog), 0, 0),
           "seccomp")


def seccomp_problem() -> str | None:
    """None when the filter installs here and refuses what it should (tried in a child), else why not."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        why = ""
        try:
            _prctl(PR_SET_NO_NEW_PRIVS, 1)
            install_seccomp()
            for family in (2, 10):  # AF_INET, AF_INET6
                if _libc.syscall(_SECCOMP_ARCH[os.uname().machine][2][0], family, 1, 0) != -1 \
                        or ctypes.get_errno() != EAFNOSUPPORT:
                    why = f"the filter let a socket of family {family} through"
            if _libc.ptrace(0, 0, None, None) != -1 or ctypes.get_errno() != EPERM:  # PTRACE_TRACEME
                why = "the filter let ptrace through"
        except BaseException as exc:  # noqa: BLE001
            why = str(exc) or type(exc).__name__
        os.write(write_end, why.encode()[:500])
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        why = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if not why and status != 0:
        why = f"the probe ended with status {status}"
    return why or None


class _Stop(BaseException):
    """SIGTERM from the evaluator (it needs no more cases): unwind, killing what runs."""


_INIT_PID: list[int] = []  # C's pid (as the launcher sees it), once forked


def _on_sigterm(_signum, _frame) -> None:
    if _INIT_PID:
        _kill(_INIT_PID[0])  # the pid namespace dies with its init: every sandbox process with it
    else:
        raise _Stop()


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or ''} on {target}")


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def emit(event: dict) -> None:
    data = (json.dumps(event) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


# ----------------------------------------------------------------------------- the runner (R)

def _limit_self(limits: dict, nproc: int) -> None:
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    for what, soft, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        (resource.RLIMIT_AS, limits["memory_bytes"], limits["memory_bytes"]),
        (resource.RLIMIT_NPROC, nproc, nproc),
        (resource.RLIMIT_NOFILE, limits["nofile"], limits["nofile"]),
        (resource.RLIMIT_FSIZE, limits["fsize_bytes"], limits["fsize_bytes"]),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_MEMLOCK, 0, 0),
        (resource.RLIMIT_MSGQUEUE, 0, 0),
    ):
        resource.setrlimit(what, (soft, hard))


def _exec_runner(req: dict, stdin_r: int, stdout_w: int, stderr_w: int, report_w: int, workdir: str,
                 script: str, drop_to: tuple[int, int] | None, nproc: int) -> None:
    """In the forked child: become the runner and exec python. Never returns."""
    try:
        os.dup2(stdin_r, 0)
        os.dup2(stdout_w, 1)
        os.dup2(stderr_w, 2)
        os.closerange(3, report_w)
        os.closerange(report_w + 1, 1 << 16)
        for sig in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)  # python itself decides again after exec
        os.setsid()  # its own process group: kill(0) / killpg(0) cannot reach the launcher's group
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with whoever started it
        if drop_to is not None:
            uid, gid = drop_to
            try:
                os.setgroups([])
            except PermissionError:  # setgroups is denied in an unprivileged user namespace
                pass
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _limit_self(req["limits"], nproc)
        os.chdir(workdir)
        if req.get("seccomp"):
            install_seccomp()  # kept through execve: python and everything it starts are filtered
        python = req["python"]
        os.execve(python, [python, "-I", "-S", "-B", script], {})
    except BaseException as exc:  # noqa: BLE001 - report why the runner could not start, then die
        hint = ""
        if isinstance(exc, PermissionError) and drop_to is not None:
            hint = (f" (the code runs as uid {drop_to[0]}: the interpreter and every folder above it must be "
                    f"readable by that uid; set the evaluator's `python` option)")
        try:
            os.write(report_w, f"{type(exc).__name__}: {exc}{hint}".encode()[:2000])
        finally:
            os._exit(127)


class _Output:
    """One of the runner's output pipes, read without blocking. ``keep`` bytes are kept: the
    head for stdout (reading stops once past it), the tail for stderr."""

    def __init__(self, fd: int, keep: int, tail: bool):
        self.fd, self.keep, self.tail = fd, keep, tail
        self.data = bytearray()
        self.eof = False
        os.set_blocking(fd, False)

    @property
    def over(self) -> bool:
        return not self.tail and len(self.data) > self.keep

    def read(self, max_chunks: int = 1) -> None:
        for _ in range(max_chunks):
            if self.eof or self.over:
                return
            try:
                chunk = os.read(self.fd, _CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                self.eof = True
                return
            self.data += chunk
            if self.tail and len(self.data) > self.keep:
                del self.data[:-self.keep]

    def text(self) -> str:
        return bytes(self.data[:self.keep] if not self.tail else self.data).decode("utf-8", errors="replace")


def run_case(req: dict, index: int, stdin_data: bytes, workdir: str, script: str,
             drop_to: tuple[int, int] | None, nproc: int) -> dict:
    limits = req["limits"]
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    stderr_r, stderr_w = os.pipe()
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _exec_runner(req, stdin_r, stdout_w, stderr_w, report_w, workdir, script, drop_to, nproc)
    for fd in (stdin_r, stdout_w, stderr_w, report_w):
        os.close(fd)
    with os.fdopen(report_r, "rb") as report_pipe:  # closes on exec: empty when python started
        report = report_pipe.read()
    if report:
        os.waitpid(pid, 0)
        for fd in (stdin_w, stdout_r, stderr_r):
            os.close(fd)
        raise SetupError(f"the runner could not start python: {report.decode(errors='replace')}")

    deadline = start + limits["wall_s"]
    pidfd = os.pidfd_open(pid)
    stdout = _Output(stdout_r, limits["output_bytes"], tail=False)
    stderr = _Output(stderr_r, _STDERR_KEPT, tail=True)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(stdout_r, select.POLLIN)
    poller.register(stderr_r, select.POLLIN)
    pending = memoryview(stdin_data)
    os.set_blocking(stdin_w, False)
    if pending:
        poller.register(stdin_w, select.POLLOUT)
    else:
        os.close(stdin_w)
        stdin_w = -1
    timed_out = exited = False
    while not exited and not stdout.over:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        for fd, _mask in poller.poll(remaining * 1000):
            if fd == pidfd:
                exited = True
            elif fd == stdin_w:
                try:
                    pending = pending[os.write(stdin_w, pending[:_CHUNK]):]
                except BlockingIOError:
                    continue
                except BrokenPipeError:  # the runner closed its stdin or exited: it wants no more
                    pending = pending[:0]
                if not pending:
                    poller.unregister(stdin_w)
                    os.close(stdin_w)
                    stdin_w = -1
            else:
                output = stdout if fd == stdout_r else stderr
                output.read()
                if output.eof:
                    poller.unregister(fd)
    if exited:  # what the runner wrote before it exited is still in the pipes (bounded: a pipe's size)
        stdout.read(max_chunks=64)
        stderr.read(max_chunks=64)
    else:
        _kill(pid)
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - start
    for fd in (pidfd, stdin_w, stdout_r, stderr_r):
        if fd >= 0:
            os.close(fd)
    return {"event": "case", "index": index,
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": timed_out, "output_limited": stdout.over,
            "wall_s": round(wall, 4), "cpu_s": round(usage.ru_utime + usage.ru_stime, 4),
            "stdout": stdout.text(), "stderr": stderr.text()}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_cases(req: dict, workdir_for_case, script: str, drop_to, nproc: int, cleanup) -> None:
    for index, text in enumerate(req["inputs"]):
        workdir = workdir_for_case()
        try:
            emit(run_case(req, index, text.encode("utf-8"), workdir, script, drop_to, nproc))
        finally:
            cleanup(workdir)
    emit({"event": "done"})


# ----------------------------------------------------------------------------- namespaces

def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _map_ids(pid: int, sandbox_uid: int, sandbox_gid: int, host_ids: tuple[int, int] | None) -> None:
    """Write ``pid``'s uid/gid maps. ``host_ids`` None: the writer is root in the parent namespace
    and maps two ranges (0 for the init, the sandbox id for the runner); else an unprivileged
    process maps its own (pre-unshare) ids, the only thing it may map, to the sandbox id."""
    try:
        if host_ids is None:
            _write(f"/proc/{pid}/uid_map", f"0 0 1\n{sandbox_uid} {sandbox_uid} 1\n")
            _write(f"/proc/{pid}/gid_map", f"0 0 1\n{sandbox_gid} {sandbox_gid} 1\n")
        else:
            _write(f"/proc/{pid}/setgroups", "deny")
            _write(f"/proc/{pid}/uid_map", f"{sandbox_uid} {host_ids[0]} 1\n")
            _write(f"/proc/{pid}/gid_map", f"{sandbox_gid} {host_ids[1]} 1\n")
    except OSError as exc:
        raise SetupError(f"writing the uid/gid maps: {exc}") from exc


def enter_namespaces(req: dict) -> None:
    """unshare every namespace and get the uid/gid maps written; the caller is still in host pid ns."""
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = req["uid"], req["gid"]
    if os.geteuid() != 0:
        host_ids = (os.geteuid(), os.getegid())  # read before unshare: unmapped ids read as 65534 after
        _check(_libc.unshare(flags), "unshare")
        _map_ids(os.getpid(), uid, gid, host_ids)
        return
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    launcher = os.getpid()
    helper = os.fork()
    if helper == 0:  # H: stays in the host namespaces, writes the maps once L has unshared
        os.close(go_w)
        os.close(done_r)
        ok = os.read(go_r, 1) == b"1"
        try:
            if ok:
                _map_ids(launcher, uid, gid, None)
            os.write(done_w, b"1" if ok else b"0")
        except BaseException as exc:  # noqa: BLE001
            os.write(done_w, f"0{exc}".encode()[:500])
        os._exit(0)
    os.close(go_r)
    os.close(done_w)
    try:
        _check(_libc.unshare(flags), "unshare")
    except SetupError:
        os.write(go_w, b"0")
        os.waitpid(helper, 0)
        raise
    os.write(go_w, b"1")
    answer = os.read(done_r, 600)
    os.waitpid(helper, 0)
    if answer != b"1":
        raise SetupError(f"writing the uid/gid maps failed: {answer[1:].decode(errors='replace')}")


def _bind(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "a"):
            pass
    _mount(source, target, None, MS_BIND | MS_REC)


def _remount_readonly(under: str, skip: str) -> None:
    """Every mount below ``under`` (binds and the submounts they brought along), read-only,
    keeping the flags the kernel locks in a user namespace."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]  # \040 is a space
    for point in points:
        if point.startswith(under + "/") and not point.startswith(skip + "/"):
            kept = os.statvfs(point).f_flag
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
            for st, ms in _KEPT_FLAGS:
                if kept & st:
                    flags |= ms
            _mount(None, point, None, flags)


def build_root(req: dict) -> None:
    """In C (pid 1): the sandbox's whole filesystem view, then pivot_root into it."""
    try:  # no nested user namespaces: less kernel surface (they could not reach the host tree anyway)
        _write("/proc/sys/user/max_user_namespaces", "0")
    except OSError:
        pass  # kernels without per-namespace limits: the rest of the isolation still holds
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    _mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for path in req["binds"]:
        if os.path.islink(path):  # merged-/usr layouts: /lib -> usr/lib
            os.makedirs(os.path.dirname(NEW_ROOT + path), exist_ok=True)
            os.symlink(os.readlink(path), NEW_ROOT + path)
        elif os.path.exists(path):
            _bind(path, NEW_ROOT + path)
    _remount_readonly(NEW_ROOT, skip=NEW_ROOT + "/dev")
    os.makedirs(NEW_ROOT + "/dev")
    for name in DEVICES:
        target = f"{NEW_ROOT}/dev/{name}"
        with open(target, "w"):
            pass
        _mount(f"/dev/{name}", target, None, MS_BIND)
    os.makedirs(NEW_ROOT + "/work")
    os.symlink("/work", NEW_ROOT + "/tmp")
    os.makedirs(NEW_ROOT + os.path.dirname(SOLUTION))
    with open(NEW_ROOT + SOLUTION, "w", encoding="utf-8") as f:
        f.write(req["code"])
    os.chmod(NEW_ROOT + SOLUTION, 0o644)
    os.chdir(NEW_ROOT)
    machine = os.uname().machine
    number = SYS_PIVOT_ROOT.get(machine)
    if number is None:
        raise SetupError(f"pivot_root: unknown syscall number on {machine}")
    _check(_libc.syscall(number, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount the host root")  # the host tree is gone from here
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _check(_libc.sethostname(b"sandbox", 7), "sethostname")


def init_main(req: dict) -> None:
    """C: pid 1 of the sandbox's pid namespace."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(PR_SET_DUMPABLE, 0)  # the runner cannot ptrace or read us even if it shared our uid
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # pid 1 gets only signals it handles: handle none
    build_root(req)
    emit({"event": "ready", "mode": "namespaces"})
    limits = req["limits"]
    uid, gid = req["uid"], req["gid"]

    def fresh_work() -> str:
        _mount("tmpfs", "/work", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               f"size={limits['disk_bytes']},nr_inodes=4096,mode=0700,uid={uid},gid={gid}")
        return "/work"

    def cleanup(_workdir: str) -> None:
        try:
            os.kill(-1, signal.SIGKILL)  # from pid 1: every other process of this pid namespace
        except ProcessLookupError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
        _check(_libc.umount2(b"/work", MNT_DETACH), "umount /work")

    run_cases(req, fresh_work, SOLUTION, (uid, gid), limits["nproc"], cleanup)


def run_namespaced(req: dict) -> int:
    enter_namespaces(req)
    init = os.fork()
    if init == 0:
        code = 0
        try:
            init_main(req)
        except SetupError as exc:
            emit({"event": "error", "message": str(exc)})
            code = 3
        except BaseException as exc:  # noqa: BLE001
            emit({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
            code = 3
        os._exit(code)
    _INIT_PID.append(init)
    _, status = os.waitpid(init, 0)
    return os.waitstatus_to_exitcode(status)


# ----------------------------------------------------------------------------- fallback

def _children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(b")") + 2:].split()
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _processes_of_uid(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid and len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
    return count


def run_plain(req: dict) -> int:
    import shutil
    import tempfile

    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # every orphan of the runner becomes our child: none escapes
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    limits = req["limits"]
    as_root = os.geteuid() == 0
    drop_to = (req["uid"], req["gid"]) if as_root else None
    # RLIMIT_NPROC counts every process of the real uid: without a uid of its own the runner gets
    # what this user already runs plus its allowance.
    nproc = limits["nproc"] if as_root else _processes_of_uid(os.getuid()) + limits["nproc"]
    code_dir = tempfile.mkdtemp(prefix="nexrl-sandbox-code-")
    script = os.path.join(code_dir, "solution.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(req["code"])
    os.chmod(script, 0o444)
    os.chmod(code_dir, 0o755)
    emit({"event": "ready", "mode": "rlimits"})

    def fresh_work() -> str:
        path = tempfile.mkdtemp(prefix="nexrl-sandbox-")
        if drop_to is not None:
            os.chown(path, *drop_to)
        return path

    def cleanup(workdir: str) -> None:
        if drop_to is not None:  # the run's uid is its own: one kill(-1) as that uid stops them all at once
            killer = os.fork()
            if killer == 0:
                os.setresuid(drop_to[0], drop_to[0], drop_to[0])
                try:
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            os.waitpid(killer, 0)
        while True:  # kill the whole subtree: orphans are re-parented to us as their parents die
            children = _children_of(os.getpid())
            if not children:
                break
            for child in children:
                _kill(child)
            for child in children:
                try:
                    os.waitpid(child, 0)
                except ChildProcessError:
                    pass
        shutil.rmtree(workdir, ignore_errors=True)

    try:
        run_cases(req, fresh_work, script, drop_to, nproc, cleanup)
    finally:
        shutil.rmtree(code_dir, ignore_errors=True)
    return 0


def main() -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    req = json.loads(sys.stdin.buffer.read())
    if req["mode"] == "probe_seccomp":
        emit({"event": "seccomp", "problem": seccomp_problem()})
        return 0
    try:
        for procs in req.get("cgroup_procs", []):  # first: everything started from here is inside
            try:
                _write(procs, str(os.getpid()))
            except OSError as exc:
                raise SetupError(f"joining the run's cgroup ({procs}): {exc}") from exc
        if req["mode"] == "namespaces":
            return run_namespaced(req)
        return run_plain(req)
    except SetupError as exc:
        emit({"event": "error", "message": str(exc)})
        return 3
    except _Stop:
        return 143


if __name__ == "__main__":
    os._exit(main())  # everything went out through os.write: skip the interpreter's teardown
