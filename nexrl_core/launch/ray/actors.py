"""What runs inside a Ray actor, and the handles the rest of the run holds to it.

One actor hosts every role of one co-location group (or a slice of the rollout workers). Its
class is built per group with one method per public method of each hosted role, prefixed with
the role (``trainer__get_status``), as the seed's co-located actors are; a
:class:`RayActorWrapper` rebinds those back to the module's own names, so a handle looks like
the module: ``execute(handle.get_status)``. A handle that arrives inside the actor hosting its
module turns into the module itself, so co-located modules call each other directly, as in
local mode.
"""

from __future__ import annotations

import inspect
import os
import random
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.exceptions

from ...errors import NexRLError
from ...runtime.execute import Deferred, ModuleUnavailable, RemoteMethod, RpcTimeout
from ..base import RoleConfig, built_with

# (actor name, role, index) -> the module built in this process
_LOCAL_MODULES: dict[tuple[str, str, int], Any] = {}
_LOCAL_LOCK = threading.Lock()


def public_methods(cls: type) -> list[str]:
    """Names a handle of ``cls`` offers: its public methods (no attributes, no properties)."""
    names = []
    for name in dir(cls):
        if name.startswith("_"):
            continue
        member = inspect.getattr_static(cls, name)
        if isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
            names.append(name)
    return names


def actor_method_name(role: str, method: str) -> str:
    return f"{role}__{method}"


@dataclass
class Slot:
    """One module an actor builds: ``cls(config, **kwargs)`` as instance ``index`` of ``role``."""

    role: str
    index: int
    cls: type
    config: RoleConfig
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        # A class from a recipe's file (type: python) travels as its text, not pickled by a module
        # name the actor cannot import; the actor compiles it under the file's name.
        from ...runtime.python_class import ClassSource

        return {**self.__dict__, "cls": ClassSource.of(self.cls) or self.cls}

    def __setstate__(self, state: dict[str, Any]) -> None:
        from ...runtime.python_class import ClassSource

        if isinstance(state["cls"], ClassSource):
            state = {**state, "cls": state["cls"].load()}
        self.__dict__.update(state)


@dataclass
class HostSetup:
    """What every actor process needs to resemble the driver (plain values: they are read
    before anything of the driver's is unpickled): its import path and environment (see
    :func:`~.cluster.actor_env`), which plugins to load (the driver's ``NEXRL_LOAD_PLUGINS``,
    None when unset), and where and how to log."""

    sys_path: list[str]
    env: dict[str, str]
    load_plugins: str | None
    run_dir: str | None
    log_level: str
    seed: int | None = None
    niceness: int | None = None  # the driver's
    secrets: list[str] = field(default_factory=list)  # what the driver hides: an actor's lines hide them too


@dataclass
class HostPayload:
    """The modules to build and the plugins the driver registered in its process; sent
    pickled (:func:`ray.cloudpickle.dumps`) and unpickled once :class:`HostSetup` is applied,
    so classes from anywhere on the driver's path resolve."""

    slots: list[Slot]
    in_process_plugins: list[tuple[str, Any, str, str]]


@dataclass
class _InActorCall:
    """A deferred argument produced by a module of the actor that consumes it: evaluated there."""

    role: str
    index: int
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class ModuleHost:
    """The body of every nexrl actor (see :func:`host_class`)."""

    def __init__(self, actor_name: str) -> None:
        self._actor_name = actor_name
        self._modules: dict[tuple[str, int], Any] = {}

    def build(self, setup: HostSetup, payload: bytes) -> dict[str, Any]:
        """Build the modules (in order) with a plugin manager like the driver's."""
        from ..parts import build_module

        _apply_setup(setup)
        content: HostPayload = ray.cloudpickle.loads(payload)
        pm = _process_plugin_manager(setup, content.in_process_plugins)
        _setup_logging(setup)
        for slot in content.slots:
            module = build_module(slot.cls, built_with(slot.config), slot.kwargs, pm)
            self._modules[(slot.role, slot.index)] = module
            with _LOCAL_LOCK:
                _LOCAL_MODULES[(self._actor_name, slot.role, slot.index)] = module
        register_tensor_transport()
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def _call(self, role: str, index: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if any(isinstance(a, _InActorCall) for a in args) or any(isinstance(v, _InActorCall) for v in kwargs.values()):
            args = tuple(self._evaluate(a) for a in args)
            kwargs = {k: self._evaluate(v) for k, v in kwargs.items()}
        return getattr(self._modules[(role, index)], method)(*args, **kwargs)

    def _evaluate(self, value: Any) -> Any:
        if not isinstance(value, _InActorCall):
            return value
        return getattr(self._modules[(value.role, value.index)], value.method)(*value.args, **value.kwargs)

    def ping(self) -> int:
        return os.getpid()


def _forwarder(role: str, method: str) -> Any:
    def forward(self: ModuleHost, index: int, *args: Any, **kwargs: Any) -> Any:
        return self._call(role, index, method, args, kwargs)

    forward.__name__ = actor_method_name(role, method)
    return forward


def host_class(group: str, roles: dict[str, list[str]]) -> type:
    """The actor class of ``group``: :class:`ModuleHost` plus ``<role>__<method>`` for each
    public method of each hosted role (``roles``: role -> method names)."""
    namespace: dict[str, Any] = {}
    for role, methods in roles.items():
        for method in methods:
            namespace[actor_method_name(role, method)] = _forwarder(role, method)
    safe = "".join(ch if ch.isalnum() else "_" for ch in group)
    return type(f"NexRL_{safe}", (ModuleHost,), namespace)


def _apply_setup(setup: HostSetup) -> None:
    """The driver's import path and environment, before anything (torch's thread pool, entry
    points) reads them."""
    for entry in reversed(setup.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.environ.update(setup.env)
    if setup.niceness is not None:
        _match_priority(setup.niceness)
    if setup.seed is not None:
        random.seed(setup.seed)  # as the controller seeds the one process of a local run
    if setup.load_plugins is None:
        os.environ.pop("NEXRL_LOAD_PLUGINS", None)
    else:
        os.environ["NEXRL_LOAD_PLUGINS"] = setup.load_plugins
    if "torch" in sys.modules and setup.env.get("OMP_NUM_THREADS"):
        sys.modules["torch"].set_num_threads(int(setup.env["OMP_NUM_THREADS"]))


def _match_priority(niceness: int) -> None:
    """Run at the driver's priority: Ray starts workers at niceness 15, and on a shared machine a
    module then gets far less CPU than the same module in a local run. Niceness is per thread on
    Linux: set it for every thread there is (later ones inherit it). Lowering it may be refused
    (no CAP_SYS_NICE); the run then goes on at Ray's priority."""
    if os.nice(0) <= niceness:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    try:
        for tid in tids:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except OSError as exc:
        from loguru import logger

        logger.debug(f"ray: this actor keeps niceness {os.nice(0)} ({exc})")


def _process_plugin_manager(setup: HostSetup, in_process: list[tuple[str, Any, str, str]]) -> Any:
    """This process's plugin manager: built-ins, the entry points ``NEXRL_LOAD_PLUGINS`` allows
    (the driver's value), and the plugins the driver registered in its process."""
    from ... import plugins

    pm = plugins.PluginManager()
    for name, module, distribution, version in in_process:
        pm.register(module, name=name, distribution=distribution, version=version)
    plugins.set_default_plugin_manager(pm)
    return pm


def _setup_logging(setup: HostSetup) -> None:
    """As the driver's: the console at the recipe's level (Ray forwards it to the driver's
    console), every line appended to run.log."""
    from ...redaction import add_secret
    from ...runtime.run_log import setup_logging

    for secret in setup.secrets:
        add_secret(secret)
    setup_logging(setup.run_dir, setup.log_level)


# -- tensors through the object store ------------------------------------------------------------

_TRANSPORT_REGISTERED = False


def register_tensor_transport() -> None:
    """Serialize torch tensors as raw bytes that Ray's object store holds without copying
    (pickle-5 buffers), instead of torch's own pickling (a torch.save into bytes per tensor).
    Done in processes that have torch loaded already (only they produce tensors)."""
    global _TRANSPORT_REGISTERED
    if _TRANSPORT_REGISTERED or "torch" not in sys.modules:
        return
    import torch

    ray.util.register_serializer(torch.Tensor, serializer=_tensor_parts, deserializer=_tensor_from_parts)
    _TRANSPORT_REGISTERED = True


def _tensor_parts(tensor: Any) -> tuple[Any, str, tuple[int, ...]]:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    import torch

    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return raw.numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)


def _tensor_from_parts(parts: tuple[Any, str, tuple[int, ...]]) -> Any:
    """A tensor that owns its memory (a copy out of the read-only object-store buffer, so the
    receiver may write to it as to any tensor)."""
    import torch

    raw, dtype, shape = parts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: cloned below before anyone can write
        flat = torch.from_numpy(raw)
    return flat.view(getattr(torch, dtype)).reshape(shape).clone()


# -- handles ------------------------------------------------------------------------------------


class RayMethod(RemoteMethod):
    """One method of a module in an actor; called only through ``execute``."""

    takes_deferred = True

    def __init__(self, wrapper: RayActorWrapper, name: str, timeout: float | None):
        self._wrapper = wrapper
        self.name = name
        self.timeout = timeout
        self._remote = getattr(wrapper._actor, actor_method_name(wrapper._role, name))

    @property
    def where(self) -> str:
        w = self._wrapper
        return f"{w._role}.{self.name} (actor {w._actor_name})"

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(self._argument(a) for a in args)
        kwargs = {k: self._argument(v) for k, v in kwargs.items()}
        try:
            return self._remote.remote(self._wrapper._index, *args, **kwargs)
        except ray.exceptions.RayActorError as exc:
            raise self._gone(exc) from None

    def _argument(self, value: Any) -> Any:
        if not isinstance(value, Deferred):
            return value
        producer = value.func
        if isinstance(producer, RayMethod):
            if producer._wrapper._actor_name == self._wrapper._actor_name:
                w = producer._wrapper
                return _InActorCall(w._role, w._index, producer.name, value.args, value.kwargs)
            # An object reference: Ray hands the result from the producer's actor to this one.
            return producer.submit(*value.args, **value.kwargs)
        return value.evaluate()

    def result(self, ref: Any, timeout: float | None) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            _cancel(ref)
            raise RpcTimeout(f"{self.where} did not answer within {timeout:g}s (ray.call_timeout)") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc
            while isinstance(cause, ray.exceptions.RayTaskError) and isinstance(cause.cause, BaseException):
                cause = cause.cause
            if isinstance(cause, ray.exceptions.RayActorError):
                raise self._gone(cause) from None
            if isinstance(cause, ray.exceptions.RayTaskError):
                raise NexRLError(f"{self.where} failed: {cause}") from None
            raise cause from None
        except ray.exceptions.RayActorError as exc:
            raise self._gone(exc) from None
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError) as exc:
            raise ModuleUnavailable(f"{self.where}: its result was lost ({type(exc).__name__})") from None

    def _gone(self, exc: BaseException) -> ModuleUnavailable:
        return ModuleUnavailable(f"{self._wrapper._role} (actor {self._wrapper._actor_name}) is gone: "
                                 f"{_first_line(exc)}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.where} is a method of a Ray actor: call it with execute(handle.{self.name}, ...)")


def _cancel(ref: Any) -> None:
    try:
        ray.cancel(ref)
    except Exception:  # already running or finished: nothing to cancel
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    for line in lines:  # Ray's death causes: the line that says why
        low = line.lower()
        if "died" in low or "killed" in low or "exit" in low or "oom" in low or "memory" in low:
            return line.strip()
    return lines[0].strip() if lines else type(exc).__name__


class RayActorWrapper:
    """A handle to one module in an actor: its public methods, each a :class:`RayMethod`
    (the seed's RayActorWrapper, rebinding the role-prefixed actor methods)."""

    def __init__(self, actor: Any, actor_name: str, role: str, index: int, methods: list[str],
                 call_timeout: float | None, unbounded: frozenset[str]):
        self._actor = actor
        self._actor_name = actor_name
        self._role = role
        self._index = index
        self._methods = frozenset(methods)
        self._call_timeout = call_timeout
        self._unbounded = unbounded
        self._bound: dict[str, RayMethod] = {}

    @property
    def actor_name(self) -> str:
        return self._actor_name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self.__dict__.get("_methods", ()):
            raise AttributeError(f"{self.__dict__.get('_role', '?')}.{name}: a Ray handle offers only the "
                                 f"module's public methods")
        method = self._bound.get(name)
        if method is None:
            timeout = None if name in self._unbounded else self._call_timeout
            method = self._bound[name] = RayMethod(self, name, timeout)
        return method

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _restore_handle, (self._actor, self._actor_name, self._role, self._index, sorted(self._methods),
                                 self._call_timeout, self._unbounded)

    def __repr__(self) -> str:
        return f"<{self._role}[{self._index}] in Ray actor {self._actor_name}>"


def _restore_handle(actor: Any, actor_name: str, role: str, index: int, methods: list[str],
                    call_timeout: float | None, unbounded: frozenset[str]) -> Any:
    """A handle arriving in a process: the module itself when this process hosts it."""
    local = _LOCAL_MODULES.get((actor_name, role, index))
    if local is not None:
        return local
    return RayActorWrapper(actor, actor_name, role, index, methods, call_timeout, unbounded)
