"""OpenAICompatibleClient against a real HTTP server on loopback (tests/support/openai_server.py)."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:  # when run without the repo root on sys.path
    sys.path.insert(0, str(_ROOT))

from nexrl_core.builtins.openai_client import OpenAICompatibleClient  # noqa: E402
from nexrl_core.runtime.inference import InferenceError, SamplingParams  # noqa: E402
from tests.support.openai_server import (  # noqa: E402
    CHAT_PATH,
    COMPLETIONS_PATH,
    MODELS_PATH,
    FakeOpenAIServer,
    expected_completion,
)

FAST = {"retry_backoff": 0.01, "timeout": 5, "max_retry_time": 10}


@pytest.fixture
def server():
    with FakeOpenAIServer(model="fake-model") as srv:
        yield srv


def make_client(srv: FakeOpenAIServer, **overrides) -> OpenAICompatibleClient:
    config = {"url": srv.url, "model": srv.model, "model_tag": "policy", **FAST, **overrides}
    client = OpenAICompatibleClient(config)
    return client


@pytest.fixture
def client(server):
    c = make_client(server)
    yield c
    c.close()


# ----------------------------------------------------------------------------- happy paths


def test_completions_returns_text_token_ids_and_logprobs_as_served(server, client):
    params = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=1234, stop=["\n\n"])
    result = client.complete("What is 19 + 23?", params)

    want = expected_completion("What is 19 + 23?", max_tokens=32, stop=["\n\n"])
    assert result.text == "42" == want.text
    assert result.finish_reason == "stop"
    assert result.prompt_token_ids == want.prompt_token_ids == list(b"What is 19 + 23?")
    assert result.response_token_ids == want.token_ids == list(b"42")
    assert result.response_logprobs == want.logprobs
    assert client.model_tag == "policy"

    request = server.last_request(COMPLETIONS_PATH)
    body = request.body
    assert body["model"] == "fake-model"
    assert body["prompt"] == "What is 19 + 23?"
    assert body["max_tokens"] == 32
    assert body["temperature"] == 0.7
    assert body["top_p"] == 0.9
    assert body["seed"] == 1234
    assert body["stop"] == ["\n\n"]
    assert body["logprobs"] == 1
    assert body["return_token_ids"] is True
    assert "stream" not in body or body["stream"] is False
    assert request.headers.get("authorization") == "Bearer EMPTY"


def test_completions_length_and_stop_strings(server, client):
    text = "the quick brown fox jumps"
    result = client.complete(text, SamplingParams(max_tokens=9))
    assert (result.text, result.finish_reason) == ("the quick", "length")
    assert result.response_token_ids == list(b"the quick")
    assert len(result.response_logprobs) == 9

    result = client.complete(text, SamplingParams(max_tokens=64, stop=[" brown", "jumps"]))
    assert (result.text, result.finish_reason) == ("the quick", "stop")
    assert result.response_token_ids == list(b"the quick")


def test_chat_returns_text_token_ids_and_logprobs_as_served(server, client):
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 100 + 23?"},
    ]
    result = client.complete(messages, SamplingParams(max_tokens=16, seed=7))

    want = expected_completion(messages, max_tokens=16)
    assert result.text == "123"
    assert result.finish_reason == "stop"
    assert result.response_token_ids == want.token_ids == list(b"123")
    assert result.response_logprobs == want.logprobs
    assert result.prompt_token_ids == want.prompt_token_ids

    body = server.last_request(CHAT_PATH).body
    assert body["messages"] == messages
    assert body["logprobs"] is True
    assert body["return_token_ids"] is True
    assert body["seed"] == 7 and body["max_tokens"] == 16


def test_result_carries_the_client_model_version(client):
    client.set_model_version(7)
    assert client.complete("What is 1 + 1?", SamplingParams()).model_version == 7


def test_model_is_discovered_from_models_endpoint_when_unset(server):
    client = OpenAICompatibleClient({"url": server.url, **FAST})
    assert client.complete("What is 2 + 2?", SamplingParams()).text == "4"
    assert client.model == "fake-model"
    assert server.count(MODELS_PATH) == 1
    client.complete("What is 2 + 2?", SamplingParams())
    assert server.count(MODELS_PATH) == 1  # looked up once


def test_request_logprobs_false_asks_for_none(server):
    client = make_client(server, request_logprobs=False)
    result = client.complete("What is 3 + 4?", SamplingParams())
    assert result.text == "7" and result.response_logprobs is None
    assert result.response_token_ids == list(b"7")
    assert "logprobs" not in server.last_request(COMPLETIONS_PATH).body


def test_plain_openai_server_gives_none_for_ids_and_logprobs(server, client):
    server.plain_openai = True
    for prompt in ("What is 5 + 6?", [{"role": "user", "content": "What is 5 + 6?"}]):
        result = client.complete(prompt, SamplingParams())
        assert result.text == "11"
        assert result.prompt_token_ids is None
        assert result.response_token_ids is None
        assert result.response_logprobs is None


def test_server_rejecting_return_token_ids_is_asked_again_without_it(server, client):
    server.strict_params = True  # like api.openai.com: unknown request fields are a 400
    result = client.complete("What is 8 + 8?", SamplingParams())
    assert result.text == "16" and result.response_token_ids is None
    assert result.response_logprobs is not None  # logprobs are standard OpenAI
    assert server.request_count == 2
    client.complete("What is 8 + 8?", SamplingParams())
    assert server.request_count == 3  # no longer sends return_token_ids
    assert "return_token_ids" not in server.last_request(COMPLETIONS_PATH).body


def test_top_k_reaches_the_server_as_vllm_field(server, client):
    client.complete("What is 2 + 2?", SamplingParams(top_k=5))
    assert server.last_request(COMPLETIONS_PATH).body["top_k"] == 5
    client.complete([{"role": "user", "content": "What is 2 + 2?"}], SamplingParams(top_k=3))
    assert server.last_request(CHAT_PATH).body["top_k"] == 3
    client.complete("What is 2 + 2?", SamplingParams(top_k=0))  # 0: no limit, nothing to send
    assert "top_k" not in server.last_request(COMPLETIONS_PATH).body


def test_server_rejecting_top_k_fails_instead_of_dropping_it(server, client):
    server.strict_params = True
    with pytest.raises(InferenceError, match="top_k"):
        client.complete("What is 2 + 2?", SamplingParams(top_k=5))
    # The second attempt (without return_token_ids) still carried top_k.
    assert server.request_count == 2 and server.last_request(COMPLETIONS_PATH).body["top_k"] == 5


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    with FakeOpenAIServer(api_key="sk-secret") as srv:
        client = OpenAICompatibleClient({"url": srv.url, "model": srv.model, **FAST})
        assert client.complete("What is 1 + 2?", SamplingParams()).text == "3"
        wrong = OpenAICompatibleClient({"url": srv.url, "model": srv.model, "api_key": "not-the-servers-key", **FAST})
        with pytest.raises(InferenceError, match=r"HTTP 401.*api_key"):
            wrong.complete("What is 1 + 2?", SamplingParams())
        assert srv.request_count == 2  # 401 is not retried


# ----------------------------------------------------------------------------- retries


def test_retry_succeeds_after_two_503s(server, client):
    server.fail_next(2, status=503)
    result = client.complete("What is 20 + 22?", SamplingParams())
    assert result.text == "42"
    assert server.request_count == 3


@pytest.mark.parametrize("status", [429, 500, 502])
def test_429_and_5xx_are_retried(server, client, status):
    server.fail_next(1, status=status)
    assert client.complete("What is 1 + 1?", SamplingParams()).text == "2"
    assert server.request_count == 2


def test_retry_after_header_is_honoured(server, client):
    server.fail_next(1, status=429, retry_after=0.3)
    start = time.monotonic()
    assert client.complete("What is 1 + 1?", SamplingParams()).text == "2"
    assert time.monotonic() - start >= 0.3


def test_400_fails_at_once(server, client):
    server.fail_next(1, status=400)
    with pytest.raises(InferenceError) as info:
        client.complete("What is 1 + 1?", SamplingParams())
    message = str(info.value)
    assert server.url in message and "HTTP 400" in message and "not retried" in message
    assert server.request_count == 1


def test_unknown_model_fails_at_once_with_hint(server):
    client = make_client(server, model="no-such-model")
    with pytest.raises(InferenceError, match=r"HTTP 404.*no-such-model"):
        client.complete("hi", SamplingParams())
    assert server.request_count == 1


def test_gives_up_after_max_retries(server):
    client = make_client(server, max_retries=2)
    server.fail_next(5, status=503)
    with pytest.raises(InferenceError) as info:
        client.complete("What is 1 + 1?", SamplingParams())
    message = str(info.value)
    assert "3 attempts" in message and "HTTP 503" in message and server.url in message
    assert server.request_count == 3


def test_timeout_then_retry(server):
    client = make_client(server, timeout=0.3)
    server.delay_next(1, seconds=2.0)
    start = time.monotonic()
    assert client.complete("What is 6 + 7?", SamplingParams()).text == "13"
    elapsed = time.monotonic() - start
    assert server.request_count == 2
    assert 0.3 <= elapsed < 1.5


def test_timeouts_exhaust_retries_with_clear_message(server):
    client = make_client(server, timeout=0.2, max_retries=1)
    server.delay = 1.0
    with pytest.raises(InferenceError, match=r"2 attempts.*timeout"):
        client.complete("What is 6 + 7?", SamplingParams())
    assert server.request_count == 2


def test_total_retry_time_is_bounded_when_server_is_down():
    srv = FakeOpenAIServer().start()
    url = srv.url
    srv.stop()  # nothing listens on that port any more
    client = OpenAICompatibleClient(
        {"url": url, "model": "m", "max_retries": 10_000, "retry_backoff": 0.05, "max_retry_time": 1.0, "timeout": 1}
    )
    start = time.monotonic()
    with pytest.raises(InferenceError) as info:
        client.complete("What is 1 + 1?", SamplingParams())
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < 1.5
    assert url in message and "connection failed" in message
    attempts = int(re.search(r"after (\d+) attempts over ([\d.]+)s", message).group(1))
    assert 3 <= attempts <= 10  # 0.05 s doubling inside 1 s


def test_server_restarting_mid_run_is_survived(server):
    client = make_client(server, max_retries=20, retry_backoff=0.05)
    assert client.complete("What is 1 + 1?", SamplingParams()).text == "2"  # keep-alive connection open
    port = server.port
    server.stop()
    restarter = threading.Timer(0.3, server.start)
    restarter.start()
    try:
        result = client.complete("What is 2 + 2?", SamplingParams())
    finally:
        restarter.join()
    assert result.text == "4"
    assert server.port == port


def test_aborted_request_is_retried(server, client):
    server.abort_next(1)
    assert client.complete("What is 9 + 9?", SamplingParams()).text == "18"
    assert server.request_count == 2


# ----------------------------------------------------------------------------- malformed answers


@pytest.mark.parametrize(
    ("kind", "wording"),
    [
        ("json", "not JSON"),
        ("no_choices", "no choices"),
        ("length_mismatch", "3 response token ids but 2 logprobs"),
    ],
)
def test_malformed_answer_raises_clear_inference_error(server, client, kind, wording):
    server.malform_next(1, kind)
    with pytest.raises(InferenceError) as info:
        client.complete("What is 40 + 2?", SamplingParams())
    message = str(info.value)
    assert server.url in message and "malformed answer" in message and wording in message
    assert "\n" not in message  # one paragraph
    assert server.request_count == 1  # not retried


def test_malformed_chat_answer(server, client):
    server.malform_next(1, "length_mismatch")
    with pytest.raises(InferenceError, match="3 response token ids but 2 logprobs"):
        client.complete([{"role": "user", "content": "What is 40 + 2?"}], SamplingParams())


# ----------------------------------------------------------------------------- concurrency, health


def test_sixteen_threads_share_one_client(server, client):
    def ask(i: int):
        a, b = i, 1000 - 3 * i
        prompt = f"What is {a} + {b}?"
        if i % 2:
            prompt = [{"role": "user", "content": prompt}]
        return i, a + b, client.complete(prompt, SamplingParams(seed=i))

    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(ask, range(64)))
    for i, total, result in results:
        assert result.text == str(total), i
        assert result.response_token_ids == list(str(total).encode())
        assert len(result.response_logprobs) == len(result.response_token_ids)
    assert server.request_count == 64


def test_health_check(server, client):
    assert client.health_check() is True
    server.stop()
    start = time.monotonic()
    assert client.health_check() is False
    assert time.monotonic() - start < 6
    server.start()
    assert client.health_check() is True


def test_fake_server_stops_cleanly(server, client):
    client.complete("What is 1 + 1?", SamplingParams())  # leaves a keep-alive connection open
    server.delay_next(1, seconds=30)
    worker = threading.Thread(target=lambda: _swallow(client.complete, "slow", SamplingParams()))
    worker.start()
    while server.request_count < 2:
        time.sleep(0.01)
    start = time.monotonic()
    server.stop()
    assert time.monotonic() - start < 2
    assert not [t for t in threading.enumerate() if t.name.startswith("fake-openai")]
    worker.join(5)
    assert not worker.is_alive()


def _swallow(fn, *args):
    try:
        fn(*args)
    except InferenceError:
        pass


def test_config_reads_dictconfig_and_requires_url(server):
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"url": server.url, "model": "fake-model", "timeout": 7, "max_retries": 1})
    client = OpenAICompatibleClient(cfg)
    assert (client.timeout, client.max_retries, client.max_retry_time) == (7.0, 1, 120.0)
    assert client.complete("What is 1 + 1?", SamplingParams()).text == "2"
    with pytest.raises(ValueError, match="url"):
        OpenAICompatibleClient({"model": "m"})


def test_module_does_not_import_torch():
    code = "import sys, nexrl_core.builtins.openai_client; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=_ROOT).returncode == 0


def test_a_retry_names_the_model_an_update_switched_to(server):
    """A weight update between two attempts may switch the served model (vllm_lora names each
    adapter it loads, and the old name may be gone): the retry asks for the new name, under
    the version the update set."""

    class Updated(OpenAICompatibleClient):
        attempts = 0

        @contextlib.contextmanager
        def generation_attempt(self):
            Updated.attempts += 1
            if Updated.attempts == 2:  # the update lands while the first attempt's failure is retried
                server.model = self.model = "policy-lora-v1"
                self.set_model_version(1)
            with super().generation_attempt() as served:
                yield served

    client = Updated({"url": server.url, "model": server.model, "model_tag": "policy", **FAST})
    server.fail_next(1, status=503)
    try:
        result = client.complete("What is 1 + 1?", SamplingParams())
    finally:
        client.close()
    assert result.text == "2" and result.model_version == 1
    assert [r.body["model"] for r in server.requests if r.method == "POST"][-1] == "policy-lora-v1"
