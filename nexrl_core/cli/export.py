"""``nexrl export CHECKPOINT OUT``: a checkpoint's model, ready for inference, without the
optimizer and RNG state a resume needs.

The checkpoint names the trainer that wrote it (``trainer`` in ``nexrl_state.json``); that
trainer's ``export_checkpoint`` knows its own folder layout. The export is assembled next to
``OUT`` and renamed into place, and records where it came from in ``nexrl_export.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

from loguru import logger

from ..checkpoint import CORE_STATE_FILE, find_latest_checkpoint, is_checkpoint, make_readable, read_core_state
from ..errors import ConfigError, DataError

EXPORT_FILE = "nexrl_export.json"
DTYPES = ("float32", "bfloat16", "float16")


def export_checkpoint(checkpoint: str, out: str, plugin_manager: Any, dtype: str | None = None,
                      force: bool = False, merged: bool = False) -> str:
    """Export ``checkpoint`` (a ``global_step_<N>`` folder, or the folder holding them: its newest)
    to the new folder ``out``; returns ``out``.

    ``dtype``: cast floating-point weights; ``force``: replace an ``out`` that an earlier export
    wrote (any other existing folder is refused: nothing the user made is deleted); ``merged``: of
    a checkpoint of LoRA adapters, the merged model instead of the adapter.
    """
    if not os.path.isdir(checkpoint):
        raise ConfigError(f"{checkpoint}: no such checkpoint folder")
    if not is_checkpoint(checkpoint):
        latest = find_latest_checkpoint(checkpoint)  # the folder that holds them (trainer.checkpoint_path)
        if latest is None:
            inside = find_latest_checkpoint(os.path.join(checkpoint, "checkpoints"))
            raise ConfigError(f"{checkpoint}: not a complete checkpoint (no {CORE_STATE_FILE}) nor a folder holding "
                              f"one; give a global_step_<N> folder of trainer.checkpoint_path, or that folder"
                              + (f" (here: {os.path.dirname(inside)})" if inside else ""))
        logger.info(f"exporting {latest}, the newest checkpoint in {checkpoint}")
        checkpoint = latest
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    state = read_core_state(checkpoint)
    name = state.get("trainer")
    if not name:
        raise ConfigError(f"{os.path.join(checkpoint, CORE_STATE_FILE)}: does not name the trainer that wrote it "
                          f"(checkpoints of nexrl-core before 0.1 do not); cannot tell how to export it")
    if name == "python":  # a trainer loaded from a file (trainer.type python): the state names file and class
        section = {"type": name, "path": state.get("trainer_path"), "class": state.get("trainer_class")}
        trainer_cls = plugin_manager.resolve_section("trainer", section, f"{CORE_STATE_FILE} 'trainer'")
    else:
        trainer_cls = plugin_manager.resolve("trainer", name, f"{CORE_STATE_FILE} 'trainer'")
    _check_out(out, checkpoint, force)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.normpath(out))}.", dir=parent)
    try:
        try:
            # merged only when asked: a trainer written before the flag takes no such argument
            trainer_cls.export_checkpoint(checkpoint, tmp, dtype=dtype, **({"merged": True} if merged else {}))
        except (OSError, ValueError) as exc:  # a damaged or foreign folder: say so, no traceback
            raise DataError(f"{checkpoint}: cannot export: {type(exc).__name__}: {exc}") from None
        with open(os.path.join(tmp, EXPORT_FILE), "w", encoding="utf-8") as f:
            json.dump({"checkpoint": os.path.abspath(checkpoint), "global_step": state.get("global_step"),
                       "trainer": name, "dtype": dtype, "merged": merged, "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
                      f, indent=1)
        make_readable(tmp)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_out(out: str, checkpoint: str, force: bool) -> None:
    out_abs, ckpt_abs = os.path.abspath(out), os.path.abspath(checkpoint)
    if out_abs == ckpt_abs or out_abs.startswith(ckpt_abs + os.sep) or ckpt_abs.startswith(out_abs + os.sep):
        raise ConfigError(f"{out}: the export must not be inside the checkpoint or hold it; choose another folder")
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise ConfigError(f"{out}: exists and is not a folder")
    if not os.listdir(out):
        return
    if not force:
        raise ConfigError(f"{out}: exists and is not empty (--force replaces an earlier export)")
    if not os.path.isfile(os.path.join(out, EXPORT_FILE)):
        raise ConfigError(f"{out}: --force replaces only a folder an earlier `nexrl export` wrote "
                          f"(it holds {EXPORT_FILE}); this one does not")
