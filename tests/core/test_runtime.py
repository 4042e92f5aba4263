"""The runtime every launch mode shares: ``execute`` (local calls and the RemoteMethod protocol,
timeouts), the ThreadedModule lifecycle of trainers and workers, and the resource-manager
interface with its local implementation."""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest

from nexrl_core import BaseRolloutWorker, BaseTrainer, NexRLError, RunFailed, ThreadedModule, hookimpl
from nexrl_core.builtins.mock import MockTrainer
from nexrl_core.errors import ConfigError
from nexrl_core.launch import create_resource_manager, launch_mode_problem
from nexrl_core.launch.base import ResourceManager
from nexrl_core.launch.local import LocalResourceManager
from nexrl_core.plugins import PluginManager, active_plugin_manager, get_plugin_manager
from nexrl_core.runtime.activity import ActivityTracker
from nexrl_core.runtime.execute import (
    ModuleUnavailable,
    RemoteMethod,
    RpcTimeout,
    execute,
    execute_async,
    execute_with_timeout,
    wait_result,
)
from nexrl_core.types import NexRLRole

# ----------------------------------------------------------------------------- execute


class Remote(RemoteMethod):
    """A RemoteMethod over a local function; records the timeouts it is asked to honour."""

    def __init__(self, func, timeout=None, gone=False):
        self.func, self.timeout, self.gone = func, timeout, gone
        self.waits: list[float | None] = []

    def submit(self, *args, **kwargs):
        if self.gone:
            raise ModuleUnavailable("actor died")
        return self.func(*args, **kwargs)

    def result(self, ref, timeout):
        self.waits.append(timeout)
        return ref


def test_execute_calls_local_functions_and_remote_methods():
    assert execute(lambda a, b=0: a + b, 2, b=3) == 5
    remote = Remote(lambda a, b=0: a * b, timeout=7.0)
    assert execute(remote, 2, b=3) == 6
    assert remote.waits == [7.0]  # the handle's own timeout (set by the launch mode from the recipe)
    assert execute_with_timeout(1.5, remote, 4, b=1) == 4
    assert remote.waits == [7.0, 1.5]
    pending = execute_async(remote, 3, b=3)
    assert wait_result(pending, 2.0) == 9 and remote.waits[-1] == 2.0
    assert wait_result(execute_async(lambda: "now")) == "now"


def test_execute_with_timeout_stops_waiting_for_a_hung_local_call():
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(RpcTimeout, match="did not answer within 0.2s"):
        execute_with_timeout(0.2, release.wait, 30)
    assert time.monotonic() - t0 < 5
    release.set()
    with pytest.raises(ZeroDivisionError):  # the method's own exception reaches the caller
        execute_with_timeout(1.0, lambda: 1 / 0)


def test_a_module_that_is_gone_or_hung_is_dead_for_the_health_check():
    class Module:
        def __init__(self, answer):
            self.health_check = answer

    tracker = ActivityTracker()
    tracker.register_module("alive", Module(Remote(lambda: True)))
    tracker.register_module("gone", Module(Remote(lambda: True, gone=True)))  # raises from execute
    tracker.register_module("unwell", Module(lambda: False))
    hang = threading.Event()
    tracker.register_module("hung", Module(lambda: hang.wait(30)))
    try:
        assert tracker.dead_modules(0.3) == ["gone", "unwell", "hung"]
    finally:
        hang.set()


# ----------------------------------------------------------------------------- ThreadedModule


class Looping(ThreadedModule):
    """Counts loop turns; ``fail_at`` raises on that turn; ``finish_at`` returns on that turn."""

    def __init__(self, fail_at=None, finish_at=None, done=False, turn_s=0.001):
        super().__init__()
        self.set_module_name("looping")
        self.turns = 0
        self.fail_at, self.finish_at, self.done, self.turn_s = fail_at, finish_at, done, turn_s

    def _main_loop(self):
        while not self._should_stop():
            self.turns += 1
            if self.turns == self.fail_at:
                raise ValueError(f"broken at turn {self.turns}")
            if self.turns == self.finish_at:
                return
            time.sleep(self.turn_s)

    def _loop_finished_normally(self):
        return self.done


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_run_stop_and_status():
    module = Looping()
    assert module.health_check() and not module.is_running()  # not started: nothing wrong
    module.run()
    _wait(lambda: module.turns > 3)
    assert module.is_running() and module.health_check()
    assert module.get_status() == {"running": True, "last_error": None}
    module.stop()
    assert not module.is_running() and module.health_check() and module.get_last_error() is None
    turns = module.turns
    time.sleep(0.05)
    assert module.turns == turns  # the loop really ended


def test_an_exception_ends_the_loop_and_is_described():
    module = Looping(fail_at=5)
    module.run()
    _wait(lambda: not module.is_running())
    assert module.get_last_error() == "ValueError: broken at turn 5"
    assert module.get_status() == {"running": False, "last_error": "ValueError: broken at turn 5"}
    assert not module.health_check()
    module.run()  # a new run starts clean
    assert module.get_last_error() is None
    module.stop()


def test_a_loop_that_ends_by_itself_is_healthy_only_when_its_work_is_done():
    unfinished = Looping(finish_at=3)
    unfinished.run()
    _wait(lambda: not unfinished.is_running())
    assert not unfinished.health_check()  # it stopped while it should still run
    done = Looping(finish_at=3, done=True)
    done.run()
    _wait(lambda: not done.is_running())
    assert done.health_check()


def test_request_stop_does_not_wait_and_stop_waits_at_most_its_timeout():
    module = Looping(turn_s=2.0)
    module.run()
    _wait(lambda: module.turns >= 1)
    t0 = time.monotonic()
    module.request_stop()
    assert time.monotonic() - t0 < 0.1 and module.is_running()
    module.stop(timeout=0.01)
    assert time.monotonic() - t0 < 1.5 and module.is_running()  # gave up waiting; the turn in hand goes on
    assert module.health_check()  # asked to stop: not a failure
    module.stop()
    assert not module.is_running()


def test_stop_from_the_loop_itself_does_not_deadlock():
    class SelfStopping(Looping):
        def _main_loop(self):
            self.stop()

    module = SelfStopping()
    module.run()
    _wait(lambda: not module.is_running(), timeout=5)
    assert module.health_check()


def test_trainers_and_workers_share_the_one_lifecycle():
    for cls in (BaseTrainer, BaseRolloutWorker):
        assert issubclass(cls, ThreadedModule)
        for name in ("run", "stop", "request_stop", "health_check", "is_running", "get_last_error", "_loop_body"):
            assert name not in vars(cls), f"{cls.__name__} redefines {name}"


class FailingTrainer(MockTrainer):
    def train(self, trajectories):
        if self.global_step + 1 == 2:
            raise RuntimeError("out of memory")
        return super().train(trajectories)


def test_a_trainer_whose_step_raises_stops_the_run_with_its_error(run_local, core_pm):
    class Plugin:
        @hookimpl
        def nexrl_trainers(self):
            return {"failing": FailingTrainer}

    core_pm.register(Plugin(), name="failing-trainer")
    with pytest.raises(RunFailed, match=r"^the trainer stopped at step 2: RuntimeError: out of memory$"):
        run_local({"data": {"type": "inline", "rows": [{"prompt": "1 + 1", "answer": "2"}]},
                   "rollout_worker": {"num_workers": 1},
                   "trajectory_pool": {"batch_size": 2, "group_size": 2},
                   "trainer": {"type": "failing", "total_train_steps": 5},
                   "service": {"inference_service": {"backend": "mock", "mode": "sum"}}})


# ----------------------------------------------------------------------------- resource managers

BUILT: list[tuple[str, object, dict]] = []


class Recorded:
    def __init__(self, config, **kwargs):
        self.config, self.kwargs = config, kwargs
        self.plugin_manager = active_plugin_manager()
        BUILT.append((type(self).__name__, config, kwargs))


class First(Recorded):
    pass


class Second(Recorded):
    pass


def test_local_resource_manager_builds_roles_in_order_with_the_runs_plugin_manager(core_pm):
    BUILT.clear()
    pm = PluginManager(load_entrypoints=False)
    rm = LocalResourceManager(plugin_manager=pm)
    rm.register_role(NexRLRole.DATA_LOADER, First, {"a": 1}, kwargs={"is_validate": False})
    rm.register_role(NexRLRole.ROLLOUT_WORKER, Second, {"b": 2}, count=3, colocation_group="workers")
    assert BUILT == []  # nothing is built before create_all_actors
    rm.create_all_actors()
    assert BUILT == [("First", {"a": 1}, {"is_validate": False})] + [("Second", {"b": 2}, {})] * 3
    workers = rm.get_actor_wrapper(NexRLRole.ROLLOUT_WORKER)
    assert len(workers) == 3 and len({id(w) for w in workers}) == 3 and all(isinstance(w, Second) for w in workers)
    assert all(w.plugin_manager is pm for w in workers)
    assert active_plugin_manager() is get_plugin_manager() is core_pm  # the scope ended with the construction
    assert rm.get_actor_wrapper(NexRLRole.TRAINER) == []
    assert rm.is_colocated(NexRLRole.DATA_LOADER, NexRLRole.ROLLOUT_WORKER)  # one process holds them all
    assert not rm.is_colocated(NexRLRole.DATA_LOADER, NexRLRole.TRAINER)  # not registered


def test_resource_manager_refuses_inconsistent_registrations(core_pm):
    rm = LocalResourceManager()
    rm.register_role(NexRLRole.TRAINER, First, {})
    with pytest.raises(NexRLError, match="registered twice"):
        rm.register_role(NexRLRole.TRAINER, First, {})
    with pytest.raises(NexRLError, match="count must be at least 1"):
        rm.register_role(NexRLRole.VALIDATOR, First, {}, count=0)
    rm.create_all_actors()
    with pytest.raises(NexRLError, match="after create_all_actors"):
        rm.register_role(NexRLRole.VALIDATOR, First, {})
    with pytest.raises(NexRLError, match="already called"):
        rm.create_all_actors()

    BUILT.clear()
    rm = LocalResourceManager()
    rm.register_role(NexRLRole.TRAINER, First, {}, count=1, colocation_group="gpu")
    rm.register_role(NexRLRole.INFERENCE_SERVICE, Second, {}, count=2, colocation_group="gpu")
    with pytest.raises(NexRLError, match=r"co-location group 'gpu': its roles need the same count, got "
                                         r"trainer=1, inference_service=2"):
        rm.create_all_actors()
    assert BUILT == []  # refused before anything was built


class Grouping(ResourceManager):
    """The interface's own bookkeeping, for a mode where groups share a process and others do not."""

    def _create(self):
        self.created = {spec.role: [spec.cls(spec.config, **spec.kwargs) for _ in range(spec.count)]
                        for spec in self.roles()}

    def get_actor_wrapper(self, role):
        return self.created.get(role, [])


def test_colocation_groups_as_a_distributed_mode_sees_them(core_pm):
    rm = Grouping()
    rm.register_role(NexRLRole.TRAINER, First, {}, colocation_group="gpu")
    rm.register_role(NexRLRole.INFERENCE_SERVICE, Second, {}, colocation_group="gpu")
    rm.register_role(NexRLRole.TRAJECTORY_POOL, First, {})
    rm.register_role(NexRLRole.ROLLOUT_WORKER, Second, {}, count=4, colocation_group="rollout")
    groups = rm.colocation_groups()
    assert {name: [s.role for s in specs] for name, specs in groups.items()} == {
        "gpu": [NexRLRole.TRAINER, NexRLRole.INFERENCE_SERVICE], "rollout": [NexRLRole.ROLLOUT_WORKER]}
    assert rm.is_colocated(NexRLRole.TRAINER, NexRLRole.INFERENCE_SERVICE)
    assert not rm.is_colocated(NexRLRole.TRAINER, NexRLRole.TRAJECTORY_POOL)
    rm.create_all_actors()
    assert len(rm.get_actor_wrapper(NexRLRole.ROLLOUT_WORKER)) == 4


def test_launch_mode_selects_the_resource_manager(tmp_path):
    from nexrl_core.launch.recipe import load_recipe
    from nexrl_core.testing import make_recipe, write_recipe

    path = write_recipe(make_recipe(), tmp_path / "r.yaml")
    rm = create_resource_manager(load_recipe(path, ["launch_mode=local"]))
    assert type(rm) is LocalResourceManager
    assert launch_mode_problem("local") is None
    message = "launch_mode: 'slurm' is not one of local, ray"
    assert launch_mode_problem("slurm") == message
    with pytest.raises(ConfigError, match=message):
        create_resource_manager(load_recipe(path, ["launch_mode=slurm"]))
    if importlib.util.find_spec("ray") is not None:  # building the manager starts nothing yet
        rm = create_resource_manager(load_recipe(path, ["launch_mode=ray"]))
        assert type(rm).__name__ == "RayResourceManager"


def test_validate_and_run_reject_ray_without_ray_with_the_same_message(core_pm, capfd, reset_loguru, tmp_path,
                                                                       monkeypatch):
    import nexrl_core.config.schema
    from nexrl_core.cli import main

    monkeypatch.setattr(nexrl_core.config.schema, "ray_installed", lambda: False)  # as on a machine without the extra

    path = tmp_path / "recipe.yaml"
    path.write_text(f"launch_mode: ray\nrun_dir: {tmp_path / 'run'}\n"
                    "data: {type: inline, rows: [{prompt: '1 + 2', answer: '3'}]}\n"
                    "trainer: {type: mock}\nservice: {inference_service: {backend: mock}}\n"
                    "trajectory_pool: {batch_size: 2, group_size: 2}\n")
    message = launch_mode_problem("ray")
    assert message == "launch_mode: 'ray' needs Ray, an optional extra: pip install 'nexrl-core[ray]'"
    assert main(["validate", str(path)]) == 2
    assert capfd.readouterr().err == f"error: {message}\n"
    assert main(["run", str(path)]) == 2  # bad input: the same line and exit code as validate
    err = capfd.readouterr().err
    assert err == f"error: {message}\n" and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_ray_keys_in_a_local_run_are_named_not_silently_ignored(core_pm, capfd, reset_loguru, tmp_path):
    """A Ray recipe switched to local mode with one key still validates and runs, and both
    commands say which of its keys this mode does not use."""
    from loguru import logger

    from nexrl_core.cli import main

    path = tmp_path / "recipe.yaml"
    path.write_text(f"launch_mode: ray\nrun_dir: {tmp_path / 'run'}\n"
                    "data: {type: inline, rows: [{prompt: '1 + 2', answer: '3'}]}\n"
                    "rollout_worker: {num_workers: 2, num_actors: 2}\n"
                    "trajectory_pool: {batch_size: 2, group_size: 2}\ntrainer: {type: mock, total_train_steps: 1}\n"
                    "service: {inference_service: {backend: mock}}\n"
                    "ray: {num_cpus: 8, colocation: {trainer: null}, call_timeout: 300}\n")
    note = ("ray.num_cpus, ray.colocation, rollout_worker.num_actors: apply to launch_mode: ray only; this run is "
            "launch_mode: local and does not use them")
    assert main(["validate", str(path), "launch_mode=local"]) == 0
    assert f"warning: {note}\n" in capfd.readouterr().err  # call_timeout 300 is the default: not named
    assert main(["run", str(path), "launch_mode=local"]) == 0
    logger.remove()  # `nexrl run` pointed loguru at the captured stderr
    assert note in capfd.readouterr().err
    assert main(["validate", str(path)]) in (0, 2)  # in Ray mode (with or without Ray installed): no note
    assert "apply to launch_mode: ray only" not in capfd.readouterr().err


class GoneOnStopTrainer(MockTrainer):
    def stop(self, timeout=None):
        super().stop(timeout)
        raise ModuleUnavailable("the trainer's process is gone")


class ClosingSink:
    closed: list[str] = []

    def __init__(self, config, run_dir):
        self.run_dir = run_dir

    def log(self, metrics, step):
        pass

    def close(self):
        ClosingSink.closed.append(self.run_dir)


def test_stopping_goes_on_when_a_module_fails_to_stop(run_local, core_pm, tmp_path):
    from loguru import logger

    class Plugin:
        @hookimpl
        def nexrl_trainers(self):
            return {"gone_on_stop": GoneOnStopTrainer}

        @hookimpl
        def nexrl_metrics_sinks(self):
            return {"closing": ClosingSink}

    core_pm.register(Plugin(), name="gone-on-stop")
    ClosingSink.closed = []
    lines: list[str] = []
    handler = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        controller, summary = run_local({
            "data": {"type": "inline", "rows": [{"prompt": "1 + 1", "answer": "2"}]},
            "rollout_worker": {"num_workers": 2},
            "trajectory_pool": {"batch_size": 2, "group_size": 2},
            "trainer": {"type": "gone_on_stop", "total_train_steps": 2},
            "logger": {"backend": ["closing"], "level": "WARNING"},
            "service": {"inference_service": {"backend": "mock", "mode": "sum"}}})
    finally:
        logger.remove(handler)
    assert summary.stopped_by == "finished" and summary.global_step == 2
    assert any("while stopping, stopping the trainer failed: ModuleUnavailable" in line for line in lines)
    assert ClosingSink.closed == [str(tmp_path / "run")]  # the records were still closed
    assert not any(execute(w.is_running) for w in controller.rollout_workers)  # and the workers stopped
