"""Plugin manager: entry points of group ``nexrl`` -> registered component classes."""

from __future__ import annotations

import importlib.metadata as md
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import pluggy
from loguru import logger

from . import hookspecs
from .algorithms.registry import ALGORITHM_KINDS, option_defaults, unknown_name_error
from .errors import PluginError
from .markers import Lazy

ENTRY_POINT_GROUP = "nexrl"
CORE_DISTRIBUTION = "nexrl-core"
# The core's own components (nexrl_core/builtins/), loaded as default plugins:
# (plugin name, module), in registration order.
DEFAULT_PLUGINS: tuple[tuple[str, str], ...] = (
    ("core.dataloaders", "nexrl_core.builtins.dataloaders"),
    ("core.workers", "nexrl_core.builtins.workers"),
    ("core.evaluators", "nexrl_core.builtins.evaluators"),
    ("core.openai", "nexrl_core.builtins.openai_client"),
    ("core.mock", "nexrl_core.builtins.mock"),
    ("core.weight_sync", "nexrl_core.builtins.weight_sync"),
    ("core.sinks", "nexrl_core.builtins.sinks"),
    ("core.algorithms", "nexrl_core.builtins.algorithms"),
)

# kind -> (hook name, expected base class path, what a recipe key looks like)
KINDS: dict[str, tuple[str, str]] = {
    "dataloader": ("nexrl_dataloaders", "nexrl_core.dataloader:BaseDataLoader"),
    "rollout_worker": ("nexrl_rollout_workers", "nexrl_core.rollout_worker:BaseRolloutWorker"),
    "evaluator": ("nexrl_evaluators", "nexrl_core.evaluation:Evaluator"),
    "trainer": ("nexrl_trainers", "nexrl_core.trainer:BaseTrainer"),
    "train_service": ("nexrl_train_services", "nexrl_core.runtime.train_service:TrainService"),
    "weight_sync_backend": ("nexrl_weight_sync_backends", "nexrl_core.weight_sync:WeightSyncBackend"),
    "inference_backend": ("nexrl_inference_backends", "nexrl_core.runtime.inference:InferenceClient"),
    "metrics_sink": ("nexrl_metrics_sinks", ""),
}


@dataclass
class PluginLoadFailure:
    name: str
    distribution: str
    error: str


@dataclass
class Registration:
    """One registered name. ``target`` is what the hook returned: the class (components) or
    function (algorithm kinds), or a :class:`~nexrl_core.Lazy` path to it."""

    target: Any
    distribution: str
    plugin: str
    kind: str = ""
    name: str = ""
    _loaded: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def cls(self) -> Any:
        """The class or function; a lazy one is imported and checked at the first read (PluginError
        naming the plugin when that fails)."""
        if not isinstance(self.target, Lazy):
            return self.target
        if self._loaded is None:
            where = f"plugin '{self.plugin}' ({self.distribution}) registers {self.kind} '{self.name}' as {self.target!r}"
            try:
                loaded = self.target.load()
            except Exception as exc:
                raise PluginError(f"{where}, which failed to import: {type(exc).__name__}: {exc}") from exc
            why = registration_problem(self.kind, loaded)
            if why:
                raise PluginError(f"{where}, {why}")
            self._loaded = loaded
        return self._loaded


@dataclass
class PluginRecord:
    name: str
    distribution: str
    version: str
    module: Any
    hooks: list[str] = field(default_factory=list)
    #: "builtin", "entry_point" or "in_process" (registered by code; a launch mode re-registers
    #: these in its other processes, the others each process loads itself)
    source: str = "in_process"


def _import_base(path: str) -> type | None:
    if not path:
        return None
    module, _, name = path.partition(":")
    return getattr(__import__(module, fromlist=[name]), name)


def registration_problem(kind: str, obj: Any) -> str | None:
    """Why ``obj`` cannot be registered as ``kind`` (a key of :data:`KINDS` or of
    :data:`ALGORITHM_KINDS`), or None; a :class:`~nexrl_core.Lazy` is checked once imported."""
    if isinstance(obj, Lazy):
        return None if obj.well_formed() else "which is not a 'module:attribute' path"
    if kind in ALGORITHM_KINDS:
        if isinstance(obj, type) or not callable(obj):
            return "which is not a function"
        try:
            option_defaults(obj)
        except (TypeError, ValueError) as exc:
            return f"whose options cannot be read: {exc}"
        return None
    base = _import_base(KINDS[kind][1])
    if not isinstance(obj, type) or (base is not None and not issubclass(obj, base)):
        return f"which is not a subclass of {base.__name__ if base else 'a class'}"
    return None


class PluginManager:
    """Typed facade over pluggy: load plugins, list them, resolve ``type:`` names."""

    def __init__(self, load_entrypoints: bool = True):
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self.failures: list[PluginLoadFailure] = []
        self.bad_registrations: list[str] = []
        self.load_filter: set[str] | None = None  # NEXRL_LOAD_PLUGINS, when set
        self.filter_unmatched: list[str] = []  # names in it that no installed plugin has
        self.not_loaded: list[str] = []  # installed distributions the filter left out
        self._load_builtins()
        if load_entrypoints:
            self.load_entrypoints()
        self.pm.check_pending()
        self._cache: dict[str, dict[str, Registration]] = {}

    def register(self, module: Any, name: str, distribution: str = "(in-process)", version: str = "",
                 source: str = "in_process") -> None:
        """Register a plugin module (or object) in-process. Registering one that is already
        registered (an installed plugin, loaded through its entry point) is a no-op."""
        if self.pm.is_registered(module):
            return
        if name in self.records:
            raise PluginError(f"plugin name '{name}' is used by both {self.records[name].distribution} and "
                              f"{distribution}")
        self.pm.register(module, name=name)
        hooks = sorted(h.name for h in self.pm.get_hookcallers(module) or [])
        self.records[name] = PluginRecord(name, distribution, version, module, hooks, source)
        self._cache = {}

    def _load_builtins(self) -> None:
        """The core's own components: plugins like any other, isolated the same way."""
        import importlib

        version = _version(CORE_DISTRIBUTION)
        for name, module_path in DEFAULT_PLUGINS:
            try:
                module = importlib.import_module(module_path)
            except Exception as exc:  # one broken built-in must not stop the others
                self._import_failed(name, CORE_DISTRIBUTION, exc)
                continue
            self.register(module, name=name, distribution=CORE_DISTRIBUTION, version=version, source="builtin")

    def _import_failed(self, name: str, dist: str, exc: BaseException) -> None:
        failure = PluginLoadFailure(name, dist, f"{type(exc).__name__}: {exc}")
        self.failures.append(failure)
        logger.warning(f"plugin '{name}' from {dist} failed to import and is skipped: {failure.error}")

    def load_entrypoints(self) -> None:
        wanted = os.environ.get("NEXRL_LOAD_PLUGINS")
        allowed = None if wanted is None else {w.strip() for w in wanted.split(",") if w.strip()}
        self.load_filter = allowed
        matched: set[str] = set()
        entry_points = sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        for ep in entry_points:
            dist = ep.dist.name if ep.dist is not None else "(unknown distribution)"
            if allowed is not None and dist not in allowed and ep.name not in allowed:
                if dist not in self.not_loaded:
                    self.not_loaded.append(dist)
                continue
            matched |= {dist, ep.name}
            if ep.name in self.records:
                continue  # the same distribution visible twice on sys.path
            try:
                module = ep.load()
            except Exception as exc:  # one broken plugin must not stop the others
                self._import_failed(ep.name, dist, exc)
                continue
            self.register(module, name=ep.name, distribution=dist, version=ep.dist.version if ep.dist else "",
                          source="entry_point")
        if allowed:
            self.filter_unmatched = sorted(allowed - matched)
            for name in self.filter_unmatched:
                logger.warning(f"NEXRL_LOAD_PLUGINS names '{name}', which is not an installed nexrl plugin")

    # -- components and algorithm functions --------------------------------------------
    def components(self, kind: str) -> dict[str, Registration]:
        """Registered classes of one component kind (a key of :data:`KINDS`), by name."""
        return self._collect(kind, KINDS[kind][0], "dict[str, type]")

    def functions(self, kind: str) -> dict[str, Registration]:
        """Registered functions of one algorithm kind (a key of :data:`ALGORITHM_KINDS`), by name;
        ``Registration.cls`` holds the function."""
        return self._collect(kind, ALGORITHM_KINDS[kind], "dict[str, function]")

    def _collect(self, kind: str, hook_name: str, expected: str) -> dict[str, Registration]:
        if kind in self._cache:
            return self._cache[kind]
        found: dict[str, Registration] = {}
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            record = self.records.get(impl.plugin_name)
            dist = record.distribution if record else impl.plugin_name
            try:
                answer = impl.function()
            except Exception as exc:
                self._bad(f"plugin '{impl.plugin_name}' ({dist}): {hook_name}() raised {type(exc).__name__}: {exc}")
                continue
            if not isinstance(answer, dict):
                self._bad(f"plugin '{impl.plugin_name}' ({dist}): {hook_name}() returned {type(answer).__name__}, "
                          f"expected {expected}")
                continue
            for name, obj in answer.items():
                why = registration_problem(kind, obj)
                if why:
                    self._bad(f"plugin '{impl.plugin_name}' ({dist}) registers {kind} '{name}' as {obj!r}, {why}")
                    continue
                if name in found and not _same_target(found[name].target, obj):
                    raise PluginError(f"two plugins register the {kind} name '{name}': "
                                      f"{found[name].distribution} ({_qualname(found[name].target)}) and {dist} "
                                      f"({_qualname(obj)}); uninstall one or restrict loading with "
                                      f"NEXRL_LOAD_PLUGINS")
                found[name] = Registration(obj, dist, impl.plugin_name, kind, name)
        self._cache[kind] = found
        return found

    def _bad(self, message: str) -> None:
        if message not in self.bad_registrations:
            self.bad_registrations.append(message)
            logger.warning(message)

    def resolve(self, kind: str, name: Any, key: str) -> Any:
        """The class (component kinds) or function (algorithm kinds) registered as ``name``;
        ConfigError naming ``key``, with a "did you mean" and what is available, otherwise."""
        available = self.functions(kind) if kind in ALGORITHM_KINDS else self.components(kind)
        if isinstance(name, str) and name in available:
            return available[name].cls
        broken = "".join(f" Plugin '{f.name}' ({f.distribution}) failed to load: {f.error}." for f in self.failures)
        broken += "".join(f" Skipped: {m}." for m in self.bad_registrations if f"registers {kind} '{name}' " in m)
        broken += self._filter_note()
        raise unknown_name_error(kind, name, key, {n: r.distribution for n, r in available.items()}, broken)

    def resolve_section(self, kind: str, section: Mapping[str, Any], key: str, selector: str = "type",
                        name: Any = None) -> Any:
        """:meth:`resolve` of the section's ``selector`` (or ``name`` when given; ``key`` is the
        section's), or for a rollout worker or trainer with ``type: python`` the class its ``path``
        and ``class`` name."""
        from .runtime.python_class import load_component_class, loads_from_file

        if loads_from_file(kind, section):
            return load_component_class(kind, section, key)
        if name is None:
            name = section.get(selector) if hasattr(section, "get") else None
        return self.resolve(kind, name, f"{key}.{selector}")

    def _filter_note(self) -> str:
        """Why components may be missing: NEXRL_LOAD_PLUGINS left plugins out or names absent ones."""
        if self.load_filter is None:
            return ""
        note = f" NEXRL_LOAD_PLUGINS={','.join(sorted(self.load_filter)) or '(empty)'} restricts plugin loading"
        if self.filter_unmatched:
            note += f"; it names {', '.join(repr(n) for n in self.filter_unmatched)}, which no installed plugin has"
        if self.not_loaded:
            note += f"; installed but not loaded: {', '.join(sorted(self.not_loaded))}"
        return note + "."

    def call_step_end(self, **kwargs: Any) -> list[tuple[str, BaseException, str | None]]:
        """Call every plugin's ``nexrl_step_end``. One that raises neither stops the others nor the
        run: it is returned as ``(plugin label, exception, its module's file)`` for the caller to report."""
        failed: list[tuple[str, BaseException, str | None]] = []
        for impl in reversed(self.pm.hook.nexrl_step_end.get_hookimpls()):  # pluggy's calling order
            try:
                impl.function(*[kwargs[name] for name in impl.argnames])
            except Exception as exc:
                failed.append((self.label(impl.plugin_name), exc, getattr(impl.plugin, "__file__", None)))
        return failed

    def label(self, plugin: str) -> str:
        """``plugin 'NAME' (distribution)``: how messages name a plugin."""
        record = self.records.get(plugin)
        return f"plugin '{plugin}'" + (f" ({record.distribution})" if record is not None else "")

    def describe(self) -> list[dict[str, Any]]:
        """One entry per plugin: distribution, version, hooks and registered names (a lazy
        registration is imported: one that fails is listed as a bad registration instead)."""
        out = []
        for record in self.records.values():
            components: dict[str, list[str]] = {}
            for kind in (*KINDS, *ALGORITHM_KINDS):
                registry = self.functions(kind) if kind in ALGORITHM_KINDS else self.components(kind)
                names = sorted(n for n, r in registry.items() if r.plugin == record.name and self._imports(r))
                if names:
                    components[kind] = names
            out.append({"name": record.name, "distribution": record.distribution, "version": record.version,
                        "hooks": record.hooks, "components": components})
        return out

    def _imports(self, registration: Registration) -> bool:
        """Whether the registration's class or function imports: a lazy one is imported here, and
        reported as a bad registration when that fails."""
        try:
            return registration.cls is not None
        except PluginError as exc:
            self._bad(str(exc))
            return False


def _same_target(a: Any, b: Any) -> bool:
    return a == b if isinstance(a, Lazy) and isinstance(b, Lazy) else a is b


def _qualname(obj: Any) -> str:
    if isinstance(obj, Lazy):
        return obj.path
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "(not installed)"


_DEFAULT: PluginManager | None = None
_ACTIVE: ContextVar[PluginManager | None] = ContextVar("nexrl_active_plugin_manager", default=None)


def get_plugin_manager() -> PluginManager:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = PluginManager()
    return _DEFAULT


def set_default_plugin_manager(pm: PluginManager) -> None:
    """Make ``pm`` this process's default (a launch mode's actor process, built like the driver's)."""
    global _DEFAULT
    _DEFAULT = pm


@contextmanager
def use_plugin_manager(pm: PluginManager | None) -> Iterator[None]:
    """Modules built inside this block resolve their parts (evaluators, weight-sync backends, sinks)
    with ``pm``: a local launch builds every module in the controller's process, with its manager."""
    token = _ACTIVE.set(pm)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_plugin_manager() -> PluginManager:
    """The manager a module being built uses: the launch's (:func:`use_plugin_manager`), else this
    process's default (entry points and ``NEXRL_LOAD_PLUGINS``, as in a process of its own)."""
    return _ACTIVE.get() or get_plugin_manager()


def peek_plugin_manager() -> PluginManager:
    """The manager in use (the launch's, else this process's default) without creating the cached
    default: reading a recipe (:func:`nexrl_core.launch.recipe.load_recipe`) must not fix which plugins
    this process loads before the command has chosen its manager."""
    return _ACTIVE.get() or _DEFAULT or PluginManager()
