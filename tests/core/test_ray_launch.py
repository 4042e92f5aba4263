"""``launch_mode: ray`` on the session's local Ray cluster (2 CPUs, no dashboard): modules in
actors, co-location, deferred weight hand-over, rollout workers over several actors, plugins
inside actors, faults. Torch-free: the actors load only nexrl-core's built-ins and the test's
own plugins (registered in this process, re-registered in every actor)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from nexrl_core import ModuleUnavailable, NexRLError, RunFailed, execute
from nexrl_core.builtins.mock import mock_sum_threshold
from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.plugins import PluginManager
from nexrl_core.testing import make_recipe, write_recipe
from nexrl_core.types import NexRLRole
from tests.support.ray_cluster import alive, wait_until_gone
from tests.support.ray_probe import FailingPlugin, ProbePlugin

LEARN_STEPS = 3
TRAIN = [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3), (0, 7)]
VAL = [(1, 0), (2, 1), (3, 3), (4, 4)]


def _row(a: int, b: int) -> dict:
    return {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}


def _expected_val_reward(version: int) -> float:
    return sum(float(version >= mock_sum_threshold(a, b, LEARN_STEPS)) for a, b in VAL) / len(VAL)


def _recipe(tmp_path, **sections) -> dict:
    """The kit's mock recipe in launch_mode ray on TRAIN, validated on VAL every 2 of 4 steps, a
    checkpoint every 2, a 5 s health-check timeout; ``sections`` merge in as make_recipe merges them
    (a mapping naming its type or backend replaces the base's)."""
    base = make_recipe(launch_mode="ray", run_dir=str(tmp_path / "run"),
                       runtime_monitor={"health_check": {"timeout": 5.0}},
                       data={"type": "inline", "rows": [_row(a, b) for a, b in TRAIN]},
                       rollout_worker={"evaluator": {"type": "exact_match"}},
                       trainer={"total_train_steps": 4, "save_freq": 2}, weight={"validate_freq": 2},
                       service={"inference_service": {"learn_steps": LEARN_STEPS}},
                       validate={"validate_before_train": True,
                                 "data": {"type": "inline", "rows": [_row(a, b) for a, b in VAL]}})
    return make_recipe(base, **sections)


@pytest.fixture
def build(ray_cluster, tmp_path, core_pm, reset_loguru):
    """``build(recipe, pm=None)`` -> a controller whose modules live in actors of the test cluster;
    every actor it started is checked to be gone at teardown."""
    controllers: list[NexRLController] = []

    def make(recipe: dict, pm: PluginManager | None = None) -> NexRLController:
        path = write_recipe(recipe, tmp_path / f"recipe{len(controllers)}.yaml")
        controller = NexRLController(load_recipe(path), plugin_manager=pm or core_pm)
        controllers.append(controller)
        return controller

    yield make
    for controller in controllers:
        rm = controller.resource_manager
        type(rm).shutdown(rm)  # idempotent: a finished run has released them already
        pids = [info.pid for info in controller.resource_manager.actors()]
        assert pids and os.getpid() not in pids
        assert not wait_until_gone(lambda: [p for p in pids if alive(p)], 30), \
            "actor processes left behind"  # noqa: B023 (called within this iteration)


def run_with_reads(controller: NexRLController, **reads):
    """``controller.run()``; each ``reads[name] = (role, method)`` is called through its handle
    when the modules are stopped but not yet released."""
    taken: dict = {}
    release = controller.resource_manager.shutdown

    def read_then_release():
        for name, (role, method) in reads.items():
            handle = controller.modules()[role]
            taken[name] = execute(getattr(handle, method))
        release()

    controller.resource_manager.shutdown = read_then_release
    return controller.run(), taken


def _metrics(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def probe_pm(core_pm):
    core_pm.register(ProbePlugin(), name="ray-probe", distribution="nexrl-ray-probe (in-process)")
    return core_pm


@pytest.mark.parametrize("placement", ["colocated", "apart"])
def test_colocation_and_the_weight_hand_over(build, probe_pm, tmp_path, placement):
    steps = 4
    colocation = {} if placement == "colocated" else {"ray": {"colocation": {"trainer": None}}}
    controller = build(_recipe(tmp_path, trainer={"type": "pid_mock", "total_train_steps": steps, "save_freq": 2},
                               service={"inference_service": {"backend": "pid_mock", "mode": "sum",
                                                              "learn_steps": LEARN_STEPS}},
                               weight={"backend": "deferred_probe", "validate_freq": 2}, **colocation),
                       probe_pm)
    rm = controller.resource_manager
    trainer_actor = rm.actor_of(NexRLRole.TRAINER)
    engine_actor = rm.actor_of(NexRLRole.INFERENCE_SERVICE)
    assert (trainer_actor.name == engine_actor.name) == (placement == "colocated")
    assert rm.is_colocated(NexRLRole.TRAINER, NexRLRole.INFERENCE_SERVICE) == (placement == "colocated")
    if placement == "colocated":  # the default places two roles in one actor
        assert sorted(r for r, _ in trainer_actor.roles) == ["inference_service", "trainer"]
    # a handle offers the module's methods, only through execute
    with pytest.raises(AttributeError):
        controller.trainer.global_step  # noqa: B018
    with pytest.raises(TypeError, match="execute"):
        controller.trainer.get_global_step()

    summary, reads = run_with_reads(controller, loads=(NexRLRole.INFERENCE_SERVICE, "weight_loads"))
    assert summary.stopped_by == "finished" and summary.global_step == steps
    loads = reads["loads"]
    assert [(x["version"], x["step"]) for x in loads] == [(v, v) for v in range(steps + 1)]  # initial + each step
    for load in loads:
        assert load["pid"] == engine_actor.pid != os.getpid()
        assert load["from_pid"] == trainer_actor.pid
        # co-located: the trainer's very object, handed over in process; apart: a copy from the other process
        assert load["same_object"] == (placement == "colocated")
    assert [(v["step"], v["val/reward"]) for v in summary.validation] == \
        [(s, _expected_val_reward(s)) for s in (0, 2, 4)]
    # the run released its actors: a call now fails at once, naming the role and the actor
    pool_actor = rm.actor_of(NexRLRole.TRAJECTORY_POOL).name
    with pytest.raises(ModuleUnavailable, match=f"trajectory_pool \\(actor {pool_actor}\\) is gone"):
        execute(controller.trajectory_pool.is_empty)


def test_workers_over_several_actors_taking_several_tasks_per_call(build, probe_pm, tmp_path):
    controller = build(_recipe(tmp_path, rollout_worker={"num_workers": 5, "num_actors": 2, "tasks_per_call": 3,
                                                         "evaluator": {"type": "pid_probe"}},
                               trainer={"total_train_steps": 6, "save_freq": 3}), probe_pm)
    rm = controller.resource_manager
    worker_actors = {rm.actor_of(NexRLRole.ROLLOUT_WORKER, i).name for i in range(5)}
    assert len(worker_actors) == 2
    assert [rm.actor_of(NexRLRole.ROLLOUT_WORKER, i).name for i in range(5)].count(
        rm.actor_of(NexRLRole.ROLLOUT_WORKER, 0).name) == 3  # workers 0-2 and 3-4
    summary, reads = run_with_reads(controller, batches=(NexRLRole.TRAINER, "get_batches"))
    assert summary.stopped_by == "finished" and summary.global_step == 6
    batches = reads["batches"]
    assert [len(b) for b in batches] == [4] * 6
    worker_pids = {info.pid for info in rm.actors() if info.name in worker_actors}
    assert {t["extra_info"]["pid"] for b in batches for t in b} <= worker_pids  # scored inside the worker actors
    for step, batch in enumerate(batches, start=1):
        assert {t["model_version"] for t in batch} == {step - 1}  # sync mode: each step's own version
        assert sorted(t["sample_index"] for t in batch) == [0, 0, 1, 1]
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows if "train/reward_mean" in r] == list(range(1, 7))
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["global_step_3", "global_step_6"]


def test_multi_domain_data_and_dynamic_sampling_in_actors(build, core_pm, tmp_path):
    """The multi_domain loader, the pool's dynamic sampling (replacements asked of the loader actor,
    slots of the weight-sync actor) and per-domain metrics across actors: mock answers are all
    wrong, then all right, so most groups are flat and get replaced from their own domain."""
    domains = {"low": {"type": "inline", "rows": [_row(a, b) for a, b in TRAIN[:3]]},
               "high": {"type": "inline", "rows": [_row(a, b) for a, b in TRAIN[3:]]}}
    recipe = _recipe(tmp_path, trajectory_pool={"dynamic_sampling": {"enabled": True, "max_replacements": 1}},
                     rollout_worker={"num_workers": 2, "num_actors": 2},
                     data={"type": "multi_domain", "domains": domains, "domain_interleave_probs": {"low": 1, "high": 1}})
    controller = build(recipe, core_pm)
    summary, reads = run_with_reads(controller, batches=(NexRLRole.TRAINER, "get_batches"))
    assert summary.stopped_by == "finished" and summary.global_step == 4
    for batch in reads["batches"]:  # one group of each domain, whole
        assert sorted((t["domain"], t["sample_index"]) for t in batch) == [("high", 0), ("high", 1),
                                                                         ("low", 0), ("low", 1)]
    rows = [r for r in _metrics(tmp_path) if "train/reward_mean" in r]
    assert all(r["train/low/num_groups"] == r["train/high/num_groups"] == 1 for r in rows)
    assert rows[-1]["pool/dynamic_sampling_dropped_groups"] > 0
    assert sum(r["train/low/dropped_groups"] + r["train/high/dropped_groups"] for r in rows) == \
        rows[-1]["pool/dynamic_sampling_dropped_groups"]
    replaced = [t for b in reads["batches"] for t in b if t["task"].get("sampling_attempt")]
    assert replaced  # replacement groups were trained on


def test_a_third_party_plugin_is_found_inside_every_actor(build, tmp_path, write_dist, monkeypatch):
    """An evaluator installed as its own distribution (entry point in a .dist-info on the path):
    the worker actors discover it themselves, and honour NEXRL_LOAD_PLUGINS as the driver does."""
    root = write_dist(tmp_path / "site", "nexrl-pidprobe", {"pidprobe": "nexrl_pidprobe"}, {"nexrl_pidprobe": """
        import os
        from nexrl_core import EvaluationRunResult, Evaluator, hookimpl

        class Probe(Evaluator):
            def evaluate(self, data, evaluation_target):
                return EvaluationRunResult(reward=1.0, extra_info={"pid": os.getpid()})

        @hookimpl
        def nexrl_evaluators():
            return {"dist_probe": Probe}
    """})
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-pidprobe")
    pm = PluginManager()
    assert pm.records["pidprobe"].source == "entry_point"
    recipe = _recipe(tmp_path, rollout_worker={"num_workers": 2, "evaluator": {"type": "dist_probe"}},
                     trainer={"total_train_steps": 2, "save_freq": 0}, weight={"validate_freq": 0},
                     validate={"validate_before_train": False, "data": None})
    controller = build(recipe, pm)
    summary, reads = run_with_reads(controller, batches=(NexRLRole.TRAINER, "get_batches"))
    assert summary.stopped_by == "finished"
    worker_pid = controller.resource_manager.actor_of(NexRLRole.ROLLOUT_WORKER).pid
    assert {t["extra_info"]["pid"] for b in reads["batches"] for t in b} == {worker_pid}

    # The driver loaded the plugin; the actors are told NEXRL_LOAD_PLUGINS excludes it: they do not load it.
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-core")
    with pytest.raises(NexRLError, match="rollout_worker.evaluator.type: unknown evaluator 'dist_probe'"):
        build({**recipe, "run_dir": str(tmp_path / "run-filtered")}, pm)


def test_an_actors_log_lines_hide_the_drivers_secrets(build, core_pm, tmp_path):
    """docs/reliability.md §Secrets: a fresh actor process knows nothing of the recipe's secrets until
    the driver hands them over; the evaluator in the worker actor logs its declared-secret option."""
    from tests.support import leaky

    secret = "ray-passphrase-6d2e1f"
    core_pm.register(leaky, name="leaky", distribution="nexrl-leaky (in-process)")
    recipe = _recipe(tmp_path, rollout_worker={"num_workers": 2, "evaluator": {"type": "leaky", "passphrase": secret}},
                     trainer={"total_train_steps": 1, "save_freq": 0}, weight={"validate_freq": 0},
                     validate={"validate_before_train": False, "data": None})
    summary = build(recipe, core_pm).run()
    assert summary.stopped_by == "finished"
    log = (tmp_path / "run" / "run.log").read_text()
    assert "leaky evaluator: again, for run.log: ***" in log  # written by the worker actor
    assert secret not in log


def test_an_exception_in_an_actors_thread_stops_the_run_as_in_local_mode(build, core_pm, tmp_path):
    core_pm.register(FailingPlugin(), name="failing", distribution="nexrl-failing (in-process)")
    controller = build(_recipe(tmp_path, trainer={"type": "failing_mock", "total_train_steps": 4, "fail_at": 2,
                                                  "save_freq": 0}), core_pm)
    with pytest.raises(RunFailed) as failed:
        controller.run()
    # as in local mode: the trainer's status, the error policy (the reported exception) or the health
    # check, whichever of the monitor's checks sees it first
    message = str(failed.value)
    assert any(m in message for m in ("the trainer stopped at step 2: RuntimeError: injected failure in process",
                                      "(policy stop_on_error): trainer/train step 2: RuntimeError: injected failure in",
                                      "health check failed: module trainer is dead or hung")), message
    errors = controller._final_errors  # what the tracker (in its actor) recorded
    trainer_pid = controller.resource_manager.actor_of(NexRLRole.TRAINER).pid
    assert f"injected failure in process {trainer_pid}" in " ".join(errors) and trainer_pid != os.getpid()


def test_a_killed_actor_is_detected_and_reported_by_role_and_actor(build, core_pm, tmp_path):
    interval = 1.0
    controller = build(_recipe(tmp_path, rollout_worker={"num_workers": 2, "num_actors": 2},
                               trainer={"total_train_steps": 100000, "save_freq": 0, "step_time_s": 0.02},
                               weight={"validate_freq": 0}, validate={"validate_before_train": False, "data": None},
                               runtime_monitor={"stop_timeout": 30, "health_check": {"check_interval": interval,
                                                                                     "timeout": 5.0}}))
    victim = controller.resource_manager.actor_of(NexRLRole.ROLLOUT_WORKER, 1)
    outcome: list = []
    runner = threading.Thread(target=lambda: outcome.append(_outcome(controller.run)))
    runner.start()
    deadline = time.monotonic() + 60
    while len([r for r in _metrics_or_empty(tmp_path) if "train/reward_mean" in r]) < 3:
        assert time.monotonic() < deadline and runner.is_alive(), outcome
        time.sleep(0.05)
    killed_at = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    runner.join(60)
    assert not runner.is_alive()
    took = time.monotonic() - killed_at
    error = outcome[0]
    assert isinstance(error, RunFailed), error
    message = str(error)
    assert "module rollout_worker_1 is dead or hung" in message and victim.name in message, message
    # found by the next health check (one interval); the stop that follows does not wait for the dead
    # actor's work in flight (it would never end)
    print(f"a killed rollout-worker actor: the run failed {took:.2f}s later (health-check interval {interval}s)")
    assert took < interval + 3, took


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:
        return exc


def _metrics_or_empty(tmp_path) -> list[dict]:
    path = tmp_path / "run" / "metrics.jsonl"
    return _metrics(tmp_path) if path.exists() else []


def test_bad_ray_settings_are_named(core_pm, tmp_path, capfd, reset_loguru):
    from nexrl_core.cli import main

    path = write_recipe(make_recipe(
        None, launch_mode="ray", run_dir=str(tmp_path / "run"),
        data={"type": "inline", "rows": [_row(1, 2)]},
        rollout_worker={"num_workers": 2, "num_actors": 3, "tasks_per_call": 0},
        trajectory_pool={"batch_size": 2, "group_size": 2},
        ray={"call_timeout": -1, "num_cpus": "many", "colokation": {},
             "colocation": {"rollout_worker": "control", "trainer": 3},
             "resources": {"trainer": {"num_gpu": 1}, "coach": {"num_cpus": 1}}}), tmp_path / "recipe.yaml")
    assert main(["validate", path]) == 2
    err = capfd.readouterr().err
    for line in ["ray.colokation: unknown key; did you mean 'ray.colocation'?",
                 "ray.call_timeout: expected a positive number, got -1",
                 "ray.num_cpus: expected a number or null, got a string ('many')",
                 "ray.colocation.trainer: expected a string or null, got an integer (3)",
                 "ray.resources.trainer.num_gpu: unknown key; did you mean 'ray.resources.trainer.num_gpus'?",
                 "ray.resources.coach: unknown key",
                 "rollout_worker.num_actors (3) exceeds rollout_worker.num_workers (2)",
                 "rollout_worker.tasks_per_call: expected a positive integer, got 0"]:
        assert line in err, (line, err)
    assert "Traceback" not in err


def test_objects_in_actors_of_their_own(ray_cluster, monkeypatch):
    """start_objects (what engine replicas in actors use): each object in an actor of its own, its
    methods called through the handle, a shared value sent once to several, and a dead actor's
    calls failing with one message that names it."""
    import collections

    from nexrl_core import share, start_objects
    from nexrl_core.launch.base import IN_RAY_ACTOR

    monkeypatch.setenv(IN_RAY_ACTOR, "1")  # as inside a Ray run's actor
    first, second = start_objects(collections.Counter, [("aab",), ("b",)], ["nexrl-test-object-0", "nexrl-test-object-1"])
    try:
        assert len({first.pid, second.pid, os.getpid()}) == 3 and first.kind == "Ray actor"
        assert first.most_common(1) == [("a", 2)]
        letters = share("ccc")
        first.update(letters)
        second.update(letters)
        assert (first.total(), second.total()) == (6, 4)
        os.kill(second.pid, signal.SIGKILL)
        with pytest.raises(NexRLError, match=rf"nexrl-test-object-1 \(.+, pid {second.pid}\) stopped: its actor died"):
            second.total()
        assert first.total() == 6
    finally:
        first.stop()
        second.stop()


def test_a_resource_request_no_node_has_fails_at_once_naming_the_role(ray_cluster, core_pm, tmp_path, reset_loguru):
    """Ray itself waits for ever for a node with a GPU (``recipes/ray_multi_gpu.yaml`` on a CPU
    machine): nexrl says which actor asked for what, and what the nodes have, before creating any."""
    import time

    from nexrl_core.errors import NexRLError

    path = write_recipe(_recipe(tmp_path, ray={"resources": {"trainer": {"num_gpus": 1}}}), tmp_path / "gpu.yaml")
    started = time.monotonic()
    with pytest.raises(NexRLError) as failed:
        controller = NexRLController(load_recipe(path), plugin_manager=core_pm)
        controller.run()
    assert time.monotonic() - started < 60
    message = str(failed.value)
    assert "ray.resources: the actor of trainer, inference_service asks for GPU 1, which no node of the cluster has (nodes: GPU 0)" in \
        message, message
    assert not [a for a in __import__("ray").util.list_named_actors() if a.startswith("nexrl-trainer")]
