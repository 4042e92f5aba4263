"""Run a command where the kernel refuses new user namespaces, as on hosts that set
``user.max_user_namespaces=0``: ``python no_namespaces.py CMD ...`` (as root).

The command runs in a user namespace of its own that maps uids/gids 0-65535 to the same host ids
(so it is root there and may switch to the sandbox's uids), with that namespace's
``max_user_namespaces`` set to 0: every ``unshare(CLONE_NEWUSER)`` below it fails with ENOSPC.
Exit code 97: this machine cannot set that up (the caller skips).
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWUSER = 0x10000000
IDS = 65536


def main(argv: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    child = os.fork()
    if child == 0:
        if libc.unshare(CLONE_NEWUSER) != 0:
            os.write(unshared_w, b"0")
            os._exit(97)
        os.write(unshared_w, b"1")
        if os.read(mapped_r, 1) != b"1":
            os._exit(97)
        try:
            with open("/proc/sys/user/max_user_namespaces", "w") as f:
                f.write("0")
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
            os.execvp(argv[0], argv)
        except OSError as exc:
            print(f"no_namespaces: {exc}", file=sys.stderr)
            os._exit(97)
    ok = os.read(unshared_r, 1) == b"1"
    if ok:  # the parent, root in the host namespace, may map any range
        try:
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{child}/{name}", "w") as f:
                    f.write(f"0 0 {IDS}\n")
        except OSError as exc:
            print(f"no_namespaces: {exc}", file=sys.stderr)
            ok = False
        os.write(mapped_w, b"1" if ok else b"0")
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
