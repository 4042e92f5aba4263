"""Enter a private network namespace (only ``lo``, brought up) and exec a command there.

Started as ``python -I -S _netns.py -- CMD...`` (or ``--probe``: exit 0 when the kernel allows
it, else exit 3 printing why). Standard library only, and a fresh process: unshare of a user
namespace needs a single-threaded caller. Root unshares the network namespace alone; another
user gets a user namespace too, mapping its own ids to themselves (capabilities in it end at the
exec, after ``lo`` is up). Every process the command starts (a Ray cluster) inherits the
namespace, so whatever it listens on is reachable from that namespace only.

The code sandbox (plugins/nexrl_rewards/nexrl_rewards/_sandbox_launcher.py) unshares more namespaces with its
own copy of these constants: it runs isolated (``-I -S``) from a file and imports nothing of nexrl.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import struct
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PR_SET_PDEATHSIG = 1
MARKER = "NEXRL_PRIVATE_NETWORK"  # set in the command's environment: the run is inside


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def enter() -> None:
    """unshare the network namespace (and a user namespace unless root) and bring ``lo`` up;
    OSError saying which step the kernel refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWNET if uid == 0 else CLONE_NEWUSER | CLONE_NEWNET
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare({'net' if uid == 0 else 'user, net'}): {os.strerror(err)}")
    if uid != 0:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH22x", b"lo", 0)
        flags_now = struct.unpack("16sH22x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags_now | IFF_UP))


def main(argv: list[str]) -> int:
    try:
        enter()
    except OSError as exc:
        print(exc.strerror or str(exc), file=sys.stderr)
        return 3
    if argv[:1] == ["--probe"]:
        return 0
    command = argv[1:] if argv[:1] == ["--"] else argv
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # the waiting `nexrl run` killed: the run stops
    os.environ[MARKER] = "1"
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the only interface (the host name may
        os.environ.setdefault(name, "lo")                       # resolve to an address not in here)
    os.execv(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
