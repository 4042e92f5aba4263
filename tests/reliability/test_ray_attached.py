"""``nexrl run`` attached by ``ray.address`` to a running cluster (the session's test cluster) that
has no node for an actor (``ray.resources.trainer.num_gpus: 1`` on a cluster without GPUs, as
``recipes/ray_multi_gpu.yaml`` on a CPU machine): Ray would wait for such a node for ever. The run
waits at most ``ray.placement_timeout``, then fails naming the actor's roles, what they ask for and
what the nodes have; a SIGTERM while it waits stops it at once. Either way run.json ends with a
final status."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import pytest

from nexrl_core.testing import write_recipe
from tests.reliability.test_ray_processes import mock_recipe
from tests.support.ray_cluster import wait_until_gone

pytest.importorskip("ray")

#: what a process needs to attach to the test cluster (Ray's token authentication, when it is on)
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _start_gpu_run(start_run, tmp_path, cluster, *overrides: str):
    recipe = mock_recipe(tmp_path / "run")
    recipe["ray"] = {"address": cluster.address, "resources": {"trainer": {"num_gpus": 1}}}
    env = {k: os.environ[k] for k in _AUTH_VARS if k in os.environ}
    return start_run(write_recipe(recipe, tmp_path / "recipe.yaml"), *overrides, env=env)


def _run_json(tmp_path) -> dict:
    return json.loads((tmp_path / "run" / "run.json").read_text())


def _run_actors() -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("nexrl-")]


def test_sigterm_while_an_actor_waits_for_a_node_stops_the_run(ray_cluster, start_run, tmp_path):
    run = _start_gpu_run(start_run, tmp_path, ray_cluster)
    run.wait_for(lambda: "waiting up to 300s (ray.placement_timeout) for one to join" in run.output(), timeout=120,
                 poll=0.1)
    signalled = time.monotonic()
    run.signal(signal.SIGTERM)
    code = run.wait(60)
    assert time.monotonic() - signalled < 30, run.output()[-3000:]
    out = run.output()
    assert code == 130, out[-3000:]
    assert "SIGTERM received" in out and "Traceback" not in out, out[-3000:]
    info = _run_json(tmp_path)
    assert info["exit_status"] == "interrupted" and info["exit_code"] == 130, info
    assert not wait_until_gone(_run_actors, 30)  # none of the run's actors (placed or waiting) is left


def test_an_actor_no_node_takes_fails_the_run_after_the_placement_timeout(ray_cluster, start_run, tmp_path):
    started = time.monotonic()
    run = _start_gpu_run(start_run, tmp_path, ray_cluster, "ray.placement_timeout=2")
    code = run.wait(120)
    out = run.output()
    assert code == 1, out[-3000:]
    assert time.monotonic() - started < 60
    line = ("error: ray: not placed on any node within 2s (ray.placement_timeout): the actor of trainer, "
            "inference_service asks for GPU 1; nodes of the cluster: ")
    errors = [text for text in out.splitlines() if text.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(line), out[-3000:]
    assert re.fullmatch(r"[^:;]+: CPU 2 \([\d.]+ free\), GPU 0", errors[0][len(line):]), errors[0]
    assert "Traceback" not in out
    info = _run_json(tmp_path)
    assert info["exit_status"] == "error" and info["exit_code"] == 1, info
    assert info["error"] == errors[0][len("error: "):]
    assert not wait_until_gone(_run_actors, 30)


def test_actors_that_fit_a_node_alone_but_not_together_fail_after_the_placement_timeout(ray_cluster, core_pm,
                                                                                         tmp_path, reset_loguru):
    """Each fits the test cluster's node (2 CPUs), so nothing is refused up front; together they
    do not, and the second would wait for ever."""
    from nexrl_core import NexRLError
    from nexrl_core.controller import NexRLController
    from nexrl_core.launch.recipe import load_recipe

    recipe = mock_recipe(tmp_path / "run")
    recipe["ray"] = {"placement_timeout": 2, "resources": {"trainer": {"num_cpus": 2},
                                                           "rollout_worker": {"num_cpus": 2}}}
    path = write_recipe(recipe, tmp_path / "recipe.yaml")
    with pytest.raises(NexRLError) as failed:
        NexRLController(load_recipe(path), plugin_manager=core_pm)
    message = str(failed.value)
    # the other one too where its process, placed, had not come up yet (a loaded machine)
    actor = r"the actor of (rollout_worker|trainer, inference_service) asks for CPU 2; "
    assert re.fullmatch(rf"ray: not placed on any node within 2s \(ray.placement_timeout\): ({actor}){{1,2}}"
                        r"nodes of the cluster: [^:;]+: CPU 2 \(0 free\), GPU 0", message), message
    assert not wait_until_gone(_run_actors, 30)


def test_a_sigterm_while_ray_init_runs_reaches_the_processs_own_handler():
    """ray.init installs its own SIGTERM handler (``sys.exit(15)``); nexrl run's is put back after
    it, and a SIGTERM that Ray's handler caught during it reaches nexrl run's."""
    from nexrl_core.launch.ray.cluster import _own_sigterm_handler

    seen: list[int] = []

    def own(signum, _frame):
        seen.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with _own_sigterm_handler():
            signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(signum))  # as ray.init does
        assert signal.getsignal(signal.SIGTERM) is own
        with pytest.raises(KeyboardInterrupt), _own_sigterm_handler():
            signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(signum))
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs before this ends
        assert seen == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)
