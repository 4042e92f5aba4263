"""vllm_disk and vllm_nccl against the fake vLLM server: the phases in vLLM's order, the weights
the server serves afterwards, version labels under live traffic, and a failed or hung phase
that is an error naming it (never a hang)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from nexrl_core import ConfigError, InferenceError, SamplingParams
from nexrl_vllm import SyncPhaseError, VLLMClient, VLLMDiskWeightSync, VLLMNcclWeightSync
from tests.support.openai_server import token_logprob
from tests.support.vllm_server import LOGITS, FakeVLLMServer, LoopbackTransport, served_logprob

pytestmark = pytest.mark.timeout(120)

FAST = {"timeout": 5.0, "max_retries": 3, "retry_backoff": 0.05, "max_retry_time": 20.0}
DISK_SEQUENCE = ["pause:abort", "reload_weights", "reset_prefix_cache", "resume"]


class Trainer:
    """What a weight-sync backend sees of a self-hosted trainer: ``export_weights()``."""

    def __init__(self, seed: int = 0):
        self.set(seed)

    def set(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        embed = torch.randn(8, 4, generator=gen)
        self.state = {LOGITS: torch.randn(256, generator=gen), "model.embed_tokens.weight": embed,
                      "model.norm.weight": torch.ones(4), "lm_head.weight": embed}  # tied, as in SmolLM2

    def export_weights(self):
        return self.state


class NcclOverLoopback(VLLMNcclWeightSync):
    """vllm_nccl with the fake's CPU transport in place of NCCL: every HTTP phase is the real one."""

    transport_factory = LoopbackTransport


@pytest.fixture
def client(fake_vllm):
    c = VLLMClient({"url": fake_vllm.url, **FAST})
    yield c
    c.close()


def served(client, prompt: str = "What is 20 + 22?"):
    return client.complete(prompt, SamplingParams(max_tokens=8))


def assert_serves(client, trainer: Trainer, version: int) -> None:
    result = served(client)
    logits = trainer.state[LOGITS].tolist()
    assert result.model_version == version
    assert result.response_logprobs == pytest.approx([served_logprob(logits, t) for t in result.response_token_ids],
                                                     abs=1e-9)


# ----------------------------------------------------------------------------- vllm_disk


def test_disk_sync_writes_safetensors_the_server_reloads_and_serves(fake_vllm, client, tmp_path):
    backend = VLLMDiskWeightSync({"sync_dir": str(tmp_path / "sync")})
    trainer = Trainer(1)
    before = served(client)
    assert before.model_version == 0 and before.response_logprobs == [token_logprob(0, ord("4")),
                                                                       token_logprob(1, ord("2"))]
    backend.sync(trainer, client, 1)

    folder = tmp_path / "sync" / "v000001"
    assert fake_vllm.loaded_paths == [str(folder)]
    assert fake_vllm.control_log == DISK_SEQUENCE
    assert fake_vllm.control_requests[0][3]["mode"] == "abort"
    written = load_file(str(folder / "model.safetensors"))
    assert set(written) == {LOGITS, "model.embed_tokens.weight", "model.norm.weight"}  # tied lm_head written once
    for name, tensor in written.items():
        assert torch.equal(tensor, trainer.state[name])
    assert client.model_version() == 1
    assert_serves(client, trainer, 1)

    trainer.set(2)
    backend.sync(trainer, client, 2)
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v000002"]  # keep_versions 1
    assert_serves(client, trainer, 2)
    assert fake_vllm.prefix_cache_resets == 2


def test_disk_sync_falls_back_to_collective_rpc_on_older_servers(fake_vllm, client, tmp_path):
    fake_vllm.legacy_reload = True  # no /reload_weights route
    trainer = Trainer(3)
    VLLMDiskWeightSync({"sync_dir": str(tmp_path), "keep_versions": 3}).sync(trainer, client, 1)
    rpc = [r for r in fake_vllm.control_requests if r[1] == "/collective_rpc"]
    assert rpc and rpc[0][2] == {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "v000001")}}
    assert_serves(client, trainer, 1)


@pytest.mark.parametrize(("route", "phase"), [("/pause", "pause"), ("/reload_weights", "reload_weights"),
                                              ("/reset_prefix_cache", "reset_prefix_cache"), ("/resume", "resume")])
def test_a_failed_phase_is_an_error_naming_it_and_generation_stops(fake_vllm, client, tmp_path, route, phase):
    fake_vllm.fail_route(route, status=500)
    with pytest.raises(SyncPhaseError) as info:
        VLLMDiskWeightSync({"sync_dir": str(tmp_path)}).sync(Trainer(), client, 1)
    assert info.value.phase == phase
    assert str(info.value).startswith(f"vLLM weight sync to version 1 failed in phase '{phase}': POST ")
    assert "HTTP 500" in str(info.value)
    start = time.monotonic()
    with pytest.raises(InferenceError, match="not serving: the weight sync to version 1 failed"):
        served(client)  # refused at once: the served weights are unknown now
    assert time.monotonic() - start < 1


def test_a_hung_reload_times_out_naming_the_phase(fake_vllm, client, tmp_path):
    fake_vllm.hang_route("/reload_weights", 30)
    start = time.monotonic()
    with pytest.raises(SyncPhaseError, match=r"phase 'reload_weights': POST .*/reload_weights got no answer "
                                             r"within 0.5s"):
        VLLMDiskWeightSync({"sync_dir": str(tmp_path), "transfer_timeout": 0.5}).sync(Trainer(), client, 1)
    assert time.monotonic() - start < 5


def test_a_server_without_development_routes_is_told_how_to_enable_them(tmp_path):
    with FakeVLLMServer(dev_mode=False) as server:
        c = VLLMClient({"url": server.url, **FAST})
        try:
            with pytest.raises(SyncPhaseError, match=r"phase 'pause'.*HTTP 404.*VLLM_SERVER_DEV_MODE=1"):
                VLLMDiskWeightSync({"sync_dir": str(tmp_path)}).sync(Trainer(), c, 1)
        finally:
            c.close()


def test_vllm_weight_sync_needs_the_vllm_backend():
    from nexrl_core.builtins.mock import MockInferenceClient

    with pytest.raises(ConfigError, match="weight.backend: 'vllm_disk' .* needs service.inference_service.backend"):
        VLLMDiskWeightSync({}).sync(Trainer(), MockInferenceClient({}), 1)


# ----------------------------------------------------------------------------- live traffic


def _in_flight(fake_vllm, client, prompt: str, delay: float):
    fake_vllm.delay_next(1, seconds=delay)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", served(client, prompt)))
    thread.start()
    deadline = time.monotonic() + 5
    while fake_vllm._in_flight == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return thread, out


def test_abort_mode_retries_the_interrupted_request_under_the_new_version(fake_vllm, client, tmp_path):
    trainer = Trainer(4)
    thread, out = _in_flight(fake_vllm, client, "What is 5 + 6?", delay=10)
    VLLMDiskWeightSync({"sync_dir": str(tmp_path)}).sync(trainer, client, 1)
    thread.join(10)
    result = out["result"]
    assert fake_vllm.request_count == 2  # aborted by the pause, then retried after the update
    assert result.text == "11" and result.model_version == 1
    logits = trainer.state[LOGITS].tolist()
    assert result.response_logprobs == pytest.approx([served_logprob(logits, t) for t in b"11"], abs=1e-9)


def test_wait_mode_lets_the_request_finish_under_the_old_version(fake_vllm, client, tmp_path):
    thread, out = _in_flight(fake_vllm, client, "What is 5 + 6?", delay=0.5)
    start = time.monotonic()
    VLLMDiskWeightSync({"sync_dir": str(tmp_path), "pause_mode": "wait"}).sync(Trainer(5), client, 1)
    thread.join(10)
    assert time.monotonic() - start >= 0.3  # the pause waited for it
    result = out["result"]
    assert fake_vllm.request_count == 1 and result.model_version == 0
    assert result.response_logprobs == [token_logprob(0, ord("1")), token_logprob(1, ord("1"))]
    assert fake_vllm.control_log[0] == "pause:wait"


def test_requests_sent_during_an_update_wait_and_carry_the_new_version(fake_vllm, client, tmp_path):
    trainer = Trainer(6)
    backend = VLLMDiskWeightSync({"sync_dir": str(tmp_path)})
    results = []
    with client.weight_update(1) as control:  # generation held, as during a sync
        sender = threading.Thread(target=lambda: results.append(served(client)))
        sender.start()
        time.sleep(0.3)
        assert not results and fake_vllm.request_count == 0  # held at the client
        control.reload_weights(backend.write(trainer.export_weights(), 1), timeout=5)
    sender.join(10)
    assert results[0].model_version == 1
    assert_serves(client, trainer, 1)


def test_a_request_the_server_held_across_the_update_carries_the_new_version(fake_vllm, client, tmp_path):
    # The race: a request passed the client before the update began but reached the server after
    # its pause; vLLM holds it and generates it after the resume, with the new weights.
    fake_vllm._pause("abort")
    out: dict = {}
    sender = threading.Thread(target=lambda: out.setdefault("result", served(client, "What is 2 + 5?")))
    sender.start()
    deadline = time.monotonic() + 5
    while fake_vllm.request_count == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    trainer = Trainer(9)
    VLLMDiskWeightSync({"sync_dir": str(tmp_path)}).sync(trainer, client, 1)
    sender.join(10)
    result = out["result"]
    assert fake_vllm.request_count == 1 and result.text == "7" and result.model_version == 1
    assert result.response_logprobs == pytest.approx([served_logprob(trainer.state[LOGITS].tolist(), ord("7"))])


# ----------------------------------------------------------------------------- vllm_nccl


def test_nccl_sync_runs_vllms_phases_in_order_and_the_server_serves_the_tensors(fake_vllm, client):
    backend = NcclOverLoopback({"nccl_packed": False})
    trainer = Trainer(7)
    backend.sync(trainer, client, 1)
    assert fake_vllm.control_log == ["init_weight_transfer_engine", "pause:abort", "start_weight_update",
                                     "update_weights", "finish_weight_update", "reset_prefix_cache", "resume"]
    init = next(r for r in fake_vllm.control_requests if r[1] == "/init_weight_transfer_engine")[2]["init_info"]
    assert init["master_address"] == "127.0.0.1" and init["rank_offset"] == 1 and init["world_size"] == 2
    start = next(r for r in fake_vllm.control_requests if r[1] == "/start_weight_update")[2]
    assert start == {"is_checkpoint_format": True}
    info = fake_vllm.received[0]
    assert info["names"] == [LOGITS, "model.embed_tokens.weight", "model.norm.weight"]  # tied lm_head sent once
    assert info["dtype_names"] == ["float32"] * 3 and info["shapes"] == [[256], [8, 4], [4]]
    assert info["packed"] is False
    for name in info["names"]:
        assert fake_vllm.weights[name] == trainer.state[name].reshape(-1).tolist()
    assert fake_vllm.weight_version == "1"
    assert_serves(client, trainer, 1)

    trainer.set(8)
    backend.sync(trainer, client, 2)
    assert fake_vllm.control_log.count("init_weight_transfer_engine") == 1  # the group is made once
    assert_serves(client, trainer, 2)
    backend.transport.close()


@pytest.mark.parametrize(("route", "phase"), [("/init_weight_transfer_engine", "init_weight_transfer_engine"),
                                              ("/start_weight_update", "start_weight_update"),
                                              ("/update_weights", "update_weights"),
                                              ("/finish_weight_update", "finish_weight_update")])
def test_nccl_failed_phase_is_named(fake_vllm, client, route, phase):
    fake_vllm.fail_route(route, status=500)
    backend = NcclOverLoopback({"transfer_timeout": 5.0})
    start = time.monotonic()
    with pytest.raises(SyncPhaseError) as info:
        backend.sync(Trainer(), client, 1)
    assert info.value.phase == phase and f"failed in phase '{phase}'" in str(info.value)
    assert time.monotonic() - start < 5
    if backend.transport is not None:
        backend.transport.close()


def test_nccl_stalled_broadcast_times_out_naming_the_transport(fake_vllm, client):
    backend = NcclOverLoopback({"transfer_timeout": 0.5})
    backend._prepare(Trainer(), client, 1)  # the group forms normally
    backend.transport.stall_send = True
    start = time.monotonic()
    with pytest.raises(SyncPhaseError, match=r"phase 'update_weights': .*the trainer's tensor transport did not "
                                             r"finish within 0.5s"):
        backend.sync(Trainer(), client, 1)
    assert time.monotonic() - start < 5
    backend.transport.close()


def test_nccl_server_that_never_confirms_times_out(fake_vllm, client):
    fake_vllm.hang_route("/update_weights", 30)
    backend = NcclOverLoopback({"transfer_timeout": 0.5})
    with pytest.raises(SyncPhaseError, match=r"phase 'update_weights': .*(/update_weights got no answer|the server "
                                             r"did not confirm) within 0.5s"):
        backend.sync(Trainer(), client, 1)
    backend.transport.close()


def test_nccl_without_vllm_in_the_trainer_says_how_to_install():
    from nexrl_vllm.transport import NcclTransport

    with pytest.raises(ConfigError, match=r"pip install 'nexrl-vllm\[serve\]'"):
        NcclTransport()


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(("cls", "config", "wording"), [
    (VLLMDiskWeightSync, {"pause_mode": "later"}, "weight.pause_mode: 'later' is not one of abort, wait, keep"),
    (VLLMDiskWeightSync, {"control_timeout": 0}, "weight.control_timeout: expected a number >= 0.001"),
    (VLLMDiskWeightSync, {"keep_versions": 0}, "weight.keep_versions: expected a positive integer, got 0"),
    (VLLMNcclWeightSync, {"nccl_master_port": "x"}, "weight.nccl_master_port: expected an integer or null"),
    (VLLMNcclWeightSync, {"nccl_packed": "yes"}, "weight.nccl_packed: expected a boolean"),
])
def test_bad_weight_options(cls, config, wording):
    assert any(wording in p for p in cls.check_config(config, "weight")), cls.check_config(config, "weight")
    with pytest.raises(ConfigError, match="weight."):
        cls(config)
