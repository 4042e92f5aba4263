"""The one owner of the checkpoint format: ``<root>/global_step_<N>/``.

A checkpoint folder holds what the trainer's ``save_model_state`` wrote (safetensors/JSON,
never pickle) and ``nexrl_state.json``: the core state (step, data-loader position,
weight-sync versions, pool). It is built under a temporary name and renamed into place, so a
crash at any point leaves either the complete folder or none of it; ``auto`` resume never
picks a temporary folder, and the next save removes the ones a crash left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from loguru import logger

from .redaction import scrub_values

CHECKPOINT_RE = re.compile(r"^global_step_(\d+)$")
CORE_STATE_FILE = "nexrl_state.json"
TMP_CHECKPOINT_PREFIX = ".tmp_global_step_"
# Also matches a train service's own scratch folders (``..tmp_global_step_*``) inside the root.
TMP_CHECKPOINT_RE = re.compile(r"^\.+tmp_global_step_")


def checkpoint_folder(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def checkpoint_step(path: str) -> int | None:
    """``N`` for a path ending in ``global_step_<N>``, else None."""
    m = CHECKPOINT_RE.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def is_checkpoint(path: str) -> bool:
    """A complete checkpoint folder (its core state was written last, so it exists only when whole)."""
    return os.path.isfile(os.path.join(path, CORE_STATE_FILE))


def write_checkpoint(root: str, step: int, write_model_state: Callable[[str], None],
                     core_state: Callable[[], dict[str, Any]], keep_only_latest: bool = False) -> str:
    """Write ``<root>/global_step_<step>`` atomically and return its path.

    ``write_model_state(folder)`` fills the folder first; ``core_state()`` is then written as
    ``nexrl_state.json``. An existing folder of the same step is replaced whole.
    ``keep_only_latest`` removes every other ``global_step_<N>`` once the new one is in place.
    """
    os.makedirs(root, exist_ok=True)
    remove_stale_tmp_checkpoints(root)
    final = checkpoint_folder(root, step)
    tmp = os.path.join(root, f"{TMP_CHECKPOINT_PREFIX}{step}_{os.getpid()}")
    old = tmp + "_old"
    try:
        os.makedirs(tmp)
        write_model_state(tmp)
        with open(os.path.join(tmp, CORE_STATE_FILE), "w", encoding="utf-8") as f:
            json.dump(scrub_values(core_state()), f)  # a task row may quote a secret
            f.flush()
            os.fsync(f.fileno())
        make_readable(tmp)
        _fsync_tree(tmp)
        if os.path.exists(final):  # move the old folder aside first: never a half-deleted global_step_<N>
            os.replace(final, old)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(root)
    shutil.rmtree(old, ignore_errors=True)
    logger.info(f"checkpoint saved: {final}")
    if keep_only_latest:
        for name in os.listdir(root):
            m = CHECKPOINT_RE.match(name)
            if m and int(m.group(1)) != step:
                doomed = os.path.join(root, f"{TMP_CHECKPOINT_PREFIX}{m.group(1)}_{os.getpid()}_removed")
                os.replace(os.path.join(root, name), doomed)  # gone from `auto` at once, then deleted
                shutil.rmtree(doomed, ignore_errors=True)
    return final


def read_core_state(folder: str) -> dict[str, Any]:
    """The core state of a checkpoint; a missing, truncated or malformed file is one DataError."""
    from .errors import DataError

    path = os.path.join(folder, CORE_STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read the checkpoint's state ({exc})") from None
    try:
        state = json.loads(text)
    except ValueError as exc:
        raise DataError(f"{path}:{getattr(exc, 'lineno', 1)}: not valid JSON ({getattr(exc, 'msg', exc)}); the "
                        f"checkpoint is damaged (truncated?): resume from another global_step_<N> with "
                        f"resume.mode=from_path") from None
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise DataError(f"{path}: not a nexrl checkpoint state (no integer global_step)")
    return state


def remove_stale_tmp_checkpoints(root: str) -> list[str]:
    """Delete temporary folders a crashed save left behind; returns their names."""
    removed = []
    for name in os.listdir(root):
        if TMP_CHECKPOINT_RE.match(name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    if removed:
        logger.info(f"removed incomplete checkpoint folders left by a crashed save: {', '.join(sorted(removed))}")
    return removed


def find_latest_checkpoint(root: str) -> str | None:
    """Newest complete ``global_step_<N>`` folder under ``root`` (temporary folders never match)."""
    if not root or not os.path.isdir(root):
        return None
    best: tuple[int, str] | None = None
    for name in os.listdir(root):
        m = CHECKPOINT_RE.match(name)
        path = os.path.join(root, name)
        if m and is_checkpoint(path):
            if best is None or int(m.group(1)) > best[0]:
                best = (int(m.group(1)), path)
    return best[1] if best else None


def make_readable(folder: str) -> None:
    """Give a finished checkpoint or export the permissions of any folder and file the user makes
    (0755 / 0644 under the usual umask 022): safetensors writes each file through a private temporary
    file (0600) and ``mkdtemp`` makes private folders (0700), so a model would otherwise be unreadable
    to the user's other accounts and services."""
    umask = _umask()
    for root, _, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)


def _umask() -> int:
    # read, not set: os.umask() would change it for every thread for a moment
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _fsync_tree(path: str) -> None:
    """Flush every file of a finished checkpoint to disk before it is renamed into place."""
    for folder, _, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def fsync_path(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
