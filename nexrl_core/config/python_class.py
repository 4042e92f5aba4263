"""``type: python``: a rollout worker or a trainer class loaded from a file next to the recipe, for
the experiment before publishing it as a plugin (``nexrl new worker`` / ``nexrl new trainer``).

.. code-block:: yaml

    rollout_worker:
      type: python
      path: my_worker.py      # next to the recipe, or relative to the current folder
      class: MyRolloutWorker  # a BaseRolloutWorker subclass in that file

    trainer:
      type: python
      path: my_trainer.py
      class: MyTrainer        # a BaseTrainer subclass (e.g. of nexrl_grpo.trainers.SelfHostedTrainer)

What NexRL's ``custom_rollout_worker_module_path`` / ``custom_rollout_worker_class_name`` name
(``nexrl migrate`` rewrites them so). The section's other keys are the class's options, checked by
``nexrl validate`` as a registered class's are. The file is imported in the driver's process
(``launch_mode: local``; ``nexrl validate`` refuses it with ``launch_mode: ray``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .options import REQUIRED, Option

PYTHON = "python"
_modules: dict[tuple[str, float], Any] = {}  # (absolute path, mtime) -> module: one import per process
_lock = threading.Lock()
#: the kinds a recipe may load from a file with ``type: python`` -> the base class they must extend
KINDS = {"rollout_worker": "nexrl_core.rollout_worker:BaseRolloutWorker", "trainer": "nexrl_core.trainer:BaseTrainer"}
OPTIONS = {
    "path": Option(REQUIRED, str, "with type python: the Python file that defines the class", path=True),
    "class": Option(REQUIRED, str, "with type python: the class in that file"),
}


def loads_from_file(kind: str, section: Any) -> bool:
    """True when ``section`` selects a class of ``kind`` from a file (``type: python``)."""
    return kind in KINDS and isinstance(section, Mapping) and section.get("type") == PYTHON


def load_component_class(kind: str, section: Mapping[str, Any], key: str) -> type:
    """The class ``section['class']`` of the file ``section['path']``, checked to extend the kind's
    base class and to leave no abstract method; every problem a ConfigError naming the key."""
    for option in ("path", "class"):
        if not isinstance(section.get(option), str) or not section.get(option):
            raise ConfigError(f"{key}.{option}: required with {key}.type python")
    path, name = str(section["path"]), str(section["class"])
    found = class_from_file(path, name, key)
    if not any(f"{c.__module__}:{c.__qualname__}" == KINDS[kind] for c in found.__mro__):
        raise ConfigError(f"{key}.class: {name} in {path} does not extend nexrl_core.{KINDS[kind].split(':')[1]}")
    # Not inspect.isabstract: the module base classes are not ABCMeta, their @abstractmethod only marks
    abstract = sorted(n for n in dir(found) if getattr(getattr(found, n, None), "__isabstractmethod__", False))
    if abstract:
        raise ConfigError(f"{key}.class: {name} in {path} leaves abstract methods unimplemented: "
                          f"{', '.join(abstract)}")
    found.source_path = os.path.abspath(path)  # type: ignore[attr-defined]  # failures point at the user's file
    return found


def class_from_file(path: str, name: str, key: str) -> type:
    """The class ``name`` defined in the Python file ``path``; a missing file or class is a
    ConfigError naming ``key.path`` / ``key.class`` (and the classes the file does define)."""
    if not os.path.isfile(path):
        where = "a folder" if os.path.isdir(path) else "not found"
        raise ConfigError(f"{key}.path: '{path}' is {where} (a Python file that defines class {name})")
    module = import_file(os.path.abspath(path), key)
    found = getattr(module, name, None)
    if not inspect.isclass(found):
        classes = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module.__name__)
        what = "defines no" if found is None else f"has a {type(found).__name__}, not a class, named"
        raise ConfigError(f"{key}.class: {path} {what} '{name}' (classes in it: {', '.join(classes) or 'none'})")
    return found


def import_file(path: str, key: str) -> Any:
    """The module of the Python file ``path`` (absolute), imported once per process and version of
    the file; a file that does not import is a ConfigError naming ``key`` or ``file:line``."""
    stamp = (path, os.path.getmtime(path))
    with _lock:
        if stamp in _modules:
            return _modules[stamp]
        name = f"nexrl_recipe_file_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"{key}.path: '{path}' cannot be imported as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # found again by name (pickling a function, a second worker)
        try:
            spec.loader.exec_module(module)
        except SyntaxError as exc:
            sys.modules.pop(name, None)
            raise ConfigError(f"{exc.filename or path}:{exc.lineno}: {exc.msg} (the file of {key}.path)") from None
        except Exception as exc:
            from ..runtime.logs import failure_location  # the runtime's own helper (it sits above config)

            sys.modules.pop(name, None)
            where = failure_location(exc, os.path.dirname(path))
            raise ConfigError(f"{key}.path: importing {path} raised {type(exc).__name__}: {exc}"
                              f"{f' ({where})' if where else ''}") from None
        _modules[stamp] = module
        return module
