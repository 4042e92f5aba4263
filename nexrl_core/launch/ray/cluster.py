"""The Ray cluster of a run: attach to one (``ray.address`` / ``RAY_ADDRESS``, or a connection
this process already has), or start a local one that the run stops again."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray
import ray._private.ray_constants as ray_constants
from loguru import logger

from ...errors import NexRLError
from ..base import IN_RAY_ACTOR
from . import network
from .settings import RaySettings

# Environment every actor gets from the driver (besides ray.env_vars): what decides which
# plugins load and how libraries behave.
_PASSED_PREFIXES = ("NEXRL_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "WANDB_")
_PASSED_NAMES = ("MKL_NUM_THREADS", "PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG")
_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass
class Cluster:
    """``started``: this run started the cluster (and stops it); ``connected``: this run
    connected to it (and disconnects)."""

    started: bool
    connected: bool
    address: str

    def close(self) -> None:
        if self.connected and ray.is_initialized():
            ray.shutdown()  # a cluster this run started stops with it (its processes exit)


def connect(settings: RaySettings) -> Cluster:
    if settings.private_network is True and not network.inside():  # `nexrl run` checked the rest
        raise NexRLError(f"{network.KEY}: true, but the run was not started by `nexrl run`, which isolates "
                         f"the cluster (or set {network.KEY}: false)")
    if ray.is_initialized():  # a connection this process made (a test's cluster, a user's script)
        return Cluster(started=False, connected=False, address=_gcs_address())
    common: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    try:
        with _own_sigterm_handler():
            if settings.address:
                ray.init(address=settings.address, **common)
                logger.info(f"ray: attached to the cluster at {settings.address}")
                return Cluster(started=False, connected=True, address=_gcs_address())
            # Workers at the driver's priority (Ray's default niceness of 15 starves them on a shared machine).
            with _single_node():
                ray.init(num_cpus=settings.num_cpus, num_gpus=settings.num_gpus,
                         object_store_memory=settings.object_store_memory,
                         _system_config={"worker_niceness": os.nice(0)}, **common)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the cluster at {settings.address}" if settings.address else "a local cluster"
        raise NexRLError(f"ray: cannot connect to {where}: {exc}") from None
    except BaseException:  # a signal (KeyboardInterrupt) while connecting: no process of a half-started cluster stays
        _release_partial_init()
        raise
    cpus = f"{ray.cluster_resources().get('CPU', 0):g} CPUs"
    where = "in a private network namespace" if network.inside() else "on loopback only"
    address = _gcs_address()
    if address.rsplit(":", 1)[0].strip("[]") not in _LOOPBACK:  # a Ray that ignores single-node mode
        logger.warning(f"ray: the local cluster listens at {address}, not on loopback only (README, 'Ray')")
        where = "not on loopback only"
    logger.info(f"ray: started a local cluster ({cpus}) for this run, {where}")
    return Cluster(started=True, connected=True, address=_gcs_address())


@contextmanager
def _own_sigterm_handler() -> Iterator[None]:
    """ray.init replaces the process's SIGTERM handler with its own (``sys.exit(15)``); a handler
    the process had (``nexrl run``'s: stop, record the run as stopped by the signal) is put back
    after, and a SIGTERM during ray.init is handed to it, as if it had been in place."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main else None
    if not callable(previous):  # the default or no handler: Ray's stays (it exits cleanly)
        yield
        return
    try:
        yield
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:
            raise
        signal.signal(signal.SIGTERM, previous)
        previous(signal.SIGTERM, None)  # nexrl run's raises KeyboardInterrupt
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _release_partial_init() -> None:
    """After ray.init was interrupted: disconnect, and stop what it started of a local cluster
    (ray.shutdown does both, and nothing when ray.init got nowhere)."""
    try:
        ray.shutdown()
    except Exception as exc:
        logger.debug(f"ray: shutdown after a failed start: {exc}")


@contextmanager
def _single_node() -> Iterator[None]:
    """Ray's single-node mode (its default on macOS and Windows) while the cluster starts: its node
    address is 127.0.0.1, and its GCS, raylet and workers listen there only. Ray has no setting
    for the listening address (it listens on every interface, and replaces a loopback
    ``_node_ip_address`` with the machine's address); this mode is read from the environment once,
    when Ray is imported, hence the module's flag too. Restored after: attaching to a multi-node
    cluster later in this process must advertise this machine's address again."""
    previous_env = os.environ.get(_SINGLE_NODE_ENV)
    previous_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_SINGLE_NODE_ENV] = "0"  # the cluster's processes read it when they import Ray
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = previous_flag
        if previous_env is None:
            os.environ.pop(_SINGLE_NODE_ENV, None)
        else:
            os.environ[_SINGLE_NODE_ENV] = previous_env


def _gcs_address() -> str:
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:
        return "?"


def driver_path() -> list[str]:
    """The driver's import path beyond its Python installation (the project, plugins laid out
    next to it, test folders): an actor puts it in front of its own, so entry points and classes
    resolve there as here."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    path = [os.path.abspath(p) for p in sys.path if p and os.path.exists(p)
            and not any(os.path.realpath(p).startswith(pre + os.sep) for pre in prefixes)]
    return list(dict.fromkeys(path))


def actor_env(settings: RaySettings, num_cpus: float | None) -> dict[str, str]:
    """Environment of an actor process (set when it starts building its modules): the driver's
    NEXRL_/HF_/... variables, a torch thread count like a local run's, and ``ray.env_vars``."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_PREFIXES) or k in _PASSED_NAMES}
    env.pop("NEXRL_LOAD_PLUGINS", None)  # set in the actor from the driver's value (even when unset)
    # Ray pins an actor without num_cpus to one OpenMP thread; a local run's torch uses the machine.
    if num_cpus is not None and num_cpus >= 1:
        env["OMP_NUM_THREADS"] = str(int(num_cpus))
    else:
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count() or 1)
    env[IN_RAY_ACTOR] = "1"  # processes a module starts there are actors too (launch/processes.py)
    env.update(settings.env_vars)
    return env
