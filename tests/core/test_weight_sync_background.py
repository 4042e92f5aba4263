"""The weight-sync controller's background pushes (issue #47): in the async modes, with a backend
that can (``WeightSyncBackend.sync_in_background``), the trainer's push returns once the service
holds the weights; the served version moves when the service says they are in; the served-version
probe is judged on the service's side before anything is sampled under them, and a push that fails
stops the trainer at its next step. Sync mode and a push before validation stay in the foreground."""

from __future__ import annotations

import threading

import pytest

from nexrl_core import NexRLError, WeightSyncBackend
from nexrl_core.weight_sync import PROBE, WeightSyncController


class Scorer:
    """Scores the probe by one number (its weights): a trainer or a served model."""

    def __init__(self, value: float = 0.0):
        self.value = value
        self.version = 0
        self.scored = 0

    def score(self, requests):
        assert requests == PROBE
        self.scored += 1
        return [[-self.value] * len(response) for _, response, _ in requests]

    def set_model_version(self, version):
        self.version = version


class Backend(WeightSyncBackend):
    """Pushes in the foreground (``sync``) or hands over (``sync_in_background``), kept in ``handed``
    until the test plays the service's part (:meth:`serve`)."""

    def __init__(self, config, lose: bool = False, decline: bool = False):
        super().__init__(config)
        self.lose = lose  # the weights never arrive, the version number does
        self.decline = decline  # cannot push in the background
        self.handed: list = []
        self.foreground: list[int] = []

    def sync(self, trainer, inference_client, version):
        self.foreground.append(version)
        inference_client.value = inference_client.value if self.lose else trainer.value
        inference_client.set_model_version(version)

    def sync_in_background(self, trainer, inference_client, version, after_apply, on_done):
        if self.decline:
            return False
        self.handed.append((trainer.value, inference_client, version, after_apply, on_done))
        return True

    def serve(self):
        """The service takes the oldest push handed over: weights in, then the check, then done."""
        value, client, version, after_apply, on_done = self.handed.pop(0)
        error = None
        try:
            if not self.lose:
                client.value = value
            client.set_model_version(version)
            after_apply()
        except BaseException as exc:
            error = exc
        on_done(error)
        return error


def _controller(mode="fully-async", lose=False, decline=False, **weight):
    config = {"sync_mode": mode, "staleness_threshold": 0 if mode == "sync" else 1, **weight}
    backend = Backend(config, lose, decline)
    wsc = WeightSyncController(config, backend)
    trainer, served = Scorer(), Scorer()
    wsc.set_module_references(None, None, trainer, served)
    wsc.sync_weight_to_rollout_service()  # the run's first push (v0), in the foreground
    return wsc, backend, trainer, served


def _step(wsc, trainer):
    wsc.train_worker_notify_step_start("trainer")
    trainer.value += 1.0  # its weights moved beyond the probe's tolerance
    wsc.train_worker_notify_weight_update("trainer")


def test_an_async_push_returns_before_the_service_has_the_weights():
    wsc, backend, trainer, served = _controller()
    assert backend.foreground == [0]
    _step(wsc, trainer)
    assert len(backend.handed) == 1 and served.version == 0  # handed over; not in yet
    assert wsc.get_rollout_model_version() == 0 and wsc.get_sync_stats()["sync_count"] == 1
    assert backend.serve() is None
    stats = wsc.get_sync_stats()
    assert wsc.get_rollout_model_version() == 1 and stats["sync_count"] == 2 and served.version == 1
    assert stats["weight/served_probe_gap"] == 0.0 and stats["weight/served_version_ok"] == 1.0
    assert stats["weight/apply_s"] > 0
    assert wsc.health_check() and trainer.scored == 2  # once a push


def test_a_backend_that_cannot_pushes_in_the_foreground_scoring_the_trainer_once():
    wsc, backend, trainer, served = _controller(decline=True)
    _step(wsc, trainer)
    assert backend.foreground == [0, 1] and served.version == 1 and wsc.get_rollout_model_version() == 1
    assert trainer.scored == 2 and "weight/apply_s" not in wsc.get_sync_stats()


def test_a_push_waits_for_the_one_before_it():
    wsc, backend, trainer, served = _controller()
    _step(wsc, trainer)
    second = threading.Thread(target=_step, args=(wsc, trainer))
    second.start()
    second.join(0.2)
    assert second.is_alive() and len(backend.handed) == 1  # v2 waits for v1 to be in
    backend.serve()
    second.join(10)
    assert not second.is_alive() and [h[2] for h in backend.handed] == [2]
    backend.serve()
    assert wsc.get_rollout_model_version() == 2 and served.value == trainer.value


def test_weights_that_never_arrive_stop_the_trainer_before_its_next_step():
    wsc, backend, trainer, served = _controller(lose=True)
    _step(wsc, trainer)  # returns: the check runs on the service's side
    error = backend.serve()
    # the service heard it before sampling under the new version: nothing is
    assert isinstance(error, NexRLError) and "the new weights did not reach it" in str(error)
    assert not wsc.health_check() and "did not reach it" in wsc.health_problem()
    assert wsc.get_rollout_model_version() == 0  # never counted as served
    with pytest.raises(NexRLError, match="pushing weights v1 to the inference service failed.*did not reach it"):
        wsc.train_worker_notify_step_start("trainer")
    with pytest.raises(NexRLError, match="did not reach it"):
        wsc.sync_weight_to_rollout_service()


def test_sync_mode_and_a_push_before_validation_stay_in_the_foreground():
    wsc, backend, trainer, served = _controller(mode="sync")
    _step(wsc, trainer)
    assert backend.foreground == [0, 1] and not backend.handed and served.value == trainer.value
    wsc, backend, trainer, served = _controller(validate_freq=2)
    _step(wsc, trainer)
    assert backend.foreground == [0] and len(backend.handed) == 1
    backend.serve()
    _step(wsc, trainer)  # step 2 validates: it must see v2 served when the push returns
    assert backend.foreground == [0, 2] and served.version == 2 and wsc.is_waiting_for_validation()


def test_stop_lets_a_push_under_way_land():
    wsc, backend, trainer, served = _controller()
    _step(wsc, trainer)
    server = threading.Timer(0.2, backend.serve)
    server.start()
    wsc.stop()  # waits for it (bounded): the service serves the trainer's last weights
    server.join()
    assert wsc.get_rollout_model_version() == 1
