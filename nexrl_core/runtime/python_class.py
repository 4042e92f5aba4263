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
``nexrl validate`` as a registered class's are. The driver reads the file once and imports that
text; with ``launch_mode: ray`` the same text travels to the actors (:class:`ClassSource`, never a
pickled class), which compile it under the file's name, so a traceback there names file:line.
"""

from __future__ import annotations

import hashlib
import inspect
import linecache
import os
import sys
import threading
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config.settings import Settings, setting
from ..errors import ConfigError

PYTHON = "python"
_modules: dict[tuple[str, str], Any] = {}  # (absolute path, digest of its text) -> module: one import per process
_lock = threading.Lock()
#: the kinds a recipe may load from a file with ``type: python`` -> the base class they must extend
KINDS = {"rollout_worker": "nexrl_core.rollout_worker:BaseRolloutWorker", "trainer": "nexrl_core.trainer:BaseTrainer"}


@dataclass(frozen=True, kw_only=True)
class PythonClassSettings(Settings):
    """The keys that name the class of a ``type: python`` section (next to the class's own keys)."""

    path: str = setting(help="with type python: the Python file that defines the class", path=True)
    class_: str = setting(help="with type python: the class in that file", key="class")


def loads_from_file(kind: str, section: object) -> bool:
    """True when ``section`` selects a class of ``kind`` from a file (``type: python``)."""
    return kind in KINDS and isinstance(section, Mapping) and section.get("type") == PYTHON


def load_component_class(kind: str, section: Mapping[str, Any], key: str) -> type:
    """The class ``section['class']`` of the file ``section['path']``, checked to extend the kind's
    base class and to leave no abstract method; every problem a ConfigError naming the key."""
    settings = PythonClassSettings.own(section, key)
    path, name = settings.path, settings.class_
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
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}.path: '{path}' cannot be read: {exc}") from None
    return import_text(path, text, key)


def import_text(path: str, text: str, key: str) -> Any:
    """The module that the Python source ``text`` of file ``path`` defines, compiled under that
    file's name (tracebacks and ``inspect`` name it; its lines are served from ``text`` where the
    file is not on disk), once per process and text."""
    digest = hashlib.sha1(text.encode()).hexdigest()
    with _lock:
        if (path, digest) in _modules:
            return _modules[(path, digest)]
        name = f"nexrl_recipe_file_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
        module = types.ModuleType(name)
        module.__file__ = path
        sys.modules[name] = module  # found again by name (pickling a function, a second worker)
        linecache.cache[path] = (len(text), None, text.splitlines(True), path)
        folder = os.path.dirname(path)
        if folder and os.path.isdir(folder) and folder not in sys.path:
            # a module beside the file imports as it would for `python file.py` (last: installed packages win)
            sys.path.append(folder)
        try:
            exec(compile(text, path, "exec", dont_inherit=True), module.__dict__)  # the recipe's own file, as import would
        except SyntaxError as exc:
            sys.modules.pop(name, None)
            raise ConfigError(f"{exc.filename or path}:{exc.lineno}: {exc.msg} (the file of {key}.path)") from None
        except Exception as exc:
            from .logs import failure_location  # the runtime's own helper (it sits above config)

            sys.modules.pop(name, None)
            where = failure_location(exc, os.path.dirname(path))
            raise ConfigError(f"{key}.path: importing {path} raised {type(exc).__name__}: {exc}"
                              f"{f' ({where})' if where else ''}") from None
        module.__dict__["__nexrl_source__"] = text  # what ClassSource sends on
        _modules[(path, digest)] = module
        return module


@dataclass(frozen=True)
class ClassSource:
    """A class loaded from a recipe's file, as the text the driver imported: how it reaches a
    process that may not see the file (a Ray actor), without pickling the class."""

    path: str
    text: str
    name: str

    @classmethod
    def of(cls, found: Any) -> ClassSource | None:
        """The source of ``found`` when it came from a recipe's file (None otherwise)."""
        module = sys.modules.get(getattr(found, "__module__", ""), None)
        text = getattr(module, "__nexrl_source__", None)
        if module is None or not isinstance(found, type) or text is None:
            return None
        return cls(str(module.__file__), text, found.__qualname__)

    def load(self) -> type:
        """The class, compiled here from the text under the file's name."""
        found = getattr(import_text(self.path, self.text, self.name), self.name)
        found.source_path = self.path  # as load_component_class marks it: failures point at the user's file
        return found
