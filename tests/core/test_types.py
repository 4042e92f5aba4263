"""The typed data path: the modules implement the protocols their neighbours are typed with, a
trajectory's keys are the ones ``Trajectory`` declares, and the launcher hands a module its parts."""

from __future__ import annotations

import inspect
import typing

import pytest
from omegaconf import OmegaConf

from nexrl_core import MetricsSink, NexRLError, Trajectory
from nexrl_core.builtins.sinks import ConsoleSink, TensorBoardSink, WandbSink
from nexrl_core.builtins.workers import SimpleRolloutWorker
from nexrl_core.dataloader import BaseDataLoader
from nexrl_core.launch.parts import build_module
from nexrl_core.protocols import TaskSource, TrajectoryPoolHandle, TrajectorySink, WeightSyncHandle
from nexrl_core.trajectory_pool import TrajectoryPool
from nexrl_core.validator import Validator
from nexrl_core.weight_sync import VersionOnlyWeightSync, WeightSyncController


def _members(protocol: type) -> list[str]:
    return sorted(n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_"))


def _parameters(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def protocol_gaps(protocol: type, cls: type) -> list[str]:
    """``Class.method: why`` for each method of ``protocol`` (and its bases) ``cls`` lacks or
    takes other parameters for (a neighbour's call would fail on it)."""
    gaps = []
    for base in [b for b in protocol.__mro__ if typing.Protocol in b.__bases__ or b is protocol]:
        for name in _members(base):
            impl = getattr(cls, name, None)
            if impl is None:
                gaps.append(f"{cls.__name__}.{name}: missing")
                continue
            wanted, given = _parameters(getattr(base, name)), _parameters(impl)
            if given[:len(wanted)] != wanted:
                gaps.append(f"{cls.__name__}.{name}: takes {given}, callers pass {wanted}")
    return gaps


@pytest.mark.parametrize("protocol, cls", [
    (TaskSource, BaseDataLoader), (TrajectorySink, TrajectoryPool), (TrajectorySink, Validator),
    (TrajectoryPoolHandle, TrajectoryPool), (WeightSyncHandle, WeightSyncController)])
def test_each_module_implements_the_protocol_its_neighbours_call(protocol, cls):
    assert protocol_gaps(protocol, cls) == []


def test_the_protocol_check_can_fail():
    class Pool:
        def put_trajectory(self, traj):  # renamed parameter: a keyword call would break
            return "ok"

    assert protocol_gaps(TrajectorySink, Pool) == [
        "Pool.put_trajectories: missing", "Pool.put_trajectory: takes ['traj'], callers pass ['trajectory']"]


class _Client:
    """Just enough of an inference client for one completion (the worker's real call path)."""

    def get_model_tag(self):
        return "default"

    def model_version(self):
        return 3

    def complete(self, prompt, params):
        from nexrl_core import CompletionResult

        return CompletionResult(text="4", prompt_token_ids=[1, 2], response_token_ids=[3],
                                response_logprobs=[-0.1], finish_reason="stop", model_version=3)


class _Collect:
    def __init__(self):
        self.items = []

    def put_trajectory(self, trajectory):
        self.items.append(trajectory)
        return "success"


def _worker(core_pm, **section):
    config = OmegaConf.create({"type": "simple", "evaluator": {"type": "exact_match"}, "seed": 0, **section})
    return build_module(SimpleRolloutWorker, config, pm=core_pm)


def test_every_key_a_builtin_worker_writes_is_a_declared_trajectory_key(core_pm):
    declared = set(typing.get_type_hints(Trajectory))
    worker = _worker(core_pm)
    pool = _Collect()
    worker.set_module_references(pool, None, None, None, _Collect(), _Client())
    assert worker._run_task({"uid": "u", "sample_index": 0, "seq": 0, "prompt": "2 + 2", "answer": "4"}, False)
    assert worker._run_task({"uid": "v", "sample_index": 0, "seq": 1, "prompt": "", "answer": "4"}, False)
    good, failed = pool.items
    assert good["reward"] == 1.0 and failed["failed"] is True
    assert set(good) - declared == set() and set(failed) - declared == set()


def test_the_launcher_hands_a_worker_its_evaluator_and_a_bare_one_has_none(core_pm):
    worker = _worker(core_pm)
    assert type(worker.evaluator_for({})).__name__ == "ExactMatchEvaluator"
    assert worker._evaluator_label == "evaluator 'exact_match' (nexrl-core)"
    bare = SimpleRolloutWorker(OmegaConf.create({"type": "simple", "evaluator": {"type": "exact_match"}}))
    assert bare.evaluator_for({}) is None  # built by hand: no plugin manager was asked
    with pytest.raises(NexRLError, match="no data loader: set_module_references"):
        bare._put_rollout_task({"uid": "u"})


def test_the_launcher_builds_the_weight_sync_backend_the_section_names(core_pm):
    wsc = build_module(WeightSyncController, OmegaConf.create({"sync_mode": "sync", "backend": "version_only"}),
                       pm=core_pm)
    assert type(wsc._backend) is VersionOnlyWeightSync
    from nexrl_core import ConfigError

    with pytest.raises(ConfigError, match="weight.backend"):
        build_module(WeightSyncController, OmegaConf.create({"sync_mode": "sync", "backend": "no_such"}), pm=core_pm)


def test_the_builtin_sinks_are_metrics_sinks():
    for cls in (ConsoleSink, WandbSink, TensorBoardSink):
        assert issubclass(cls, MetricsSink)
    with pytest.raises(TypeError):
        MetricsSink(None, None)  # log is abstract
