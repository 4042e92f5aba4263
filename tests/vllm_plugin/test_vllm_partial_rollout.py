"""Partial rollout with vLLM (``weight.partial_rollout``), against a fake vLLM server that decodes
one token at a time: a weight push cuts a request in flight, the client keeps the tokens it has
(vLLM's aborted answer carries them) and continues it under the new weights as a completion of
the prompt's and those tokens' ids; ``token_versions`` says which weights sampled each token and
each log-prob is the one of those weights. The real-vLLM counterpart is in test_real_vllm.py."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from nexrl_core import ConfigError, SamplingParams
from nexrl_vllm import VLLMClient, VLLMDiskWeightSync
from tests.support.openai_server import (
    GENERATION_PATHS,
    RecordedRequest,
    decode,
    encode,
    expected_completion,
    render_chat,
    split_tool_calls,
    token_logprob,
)
from tests.support.vllm_server import LOGITS, FakeVLLMServer, _VLLMHandler, served_logprob

pytestmark = pytest.mark.timeout(120)

FAST = {"timeout": 5.0, "max_retries": 3, "retry_backoff": 0.05, "max_retry_time": 20.0}
STORY = "Tell me a long story about the sea and the ships on it."  # the fake echoes it: 55 tokens


class Trainer:
    """The fake's "model": the logits every token's log-prob is taken from once they are served."""

    def __init__(self, seed: int):
        self.state = {LOGITS: torch.randn(256, generator=torch.Generator().manual_seed(seed))}

    def export_weights(self):
        return self.state


class _DecodingHandler(_VLLMHandler):
    """Generation as vLLM runs it, one token per ``token_delay``: each token's log-prob is taken
    under the weights served when it is sampled, and a pause (abort) answers with the tokens
    sampled so far (``finish_reason "abort"``). A prompt of token ids that extends an earlier
    prompt by the start of its answer is continued from there (the fake "model" goes on with
    the same answer)."""

    def do_POST(self) -> None:  # noqa: N802
        owner: DecodingFakeVLLM = self.server.owner
        path = self._path()
        if path == "/detokenize":
            body, _ = self._read_body()
            owner._record(RecordedRequest("POST", path, dict(self.headers.items()), body))
            self._send(200, {"prompt": decode(body["tokens"])})
            return
        if path not in GENERATION_PATHS or (path == "/v1/completions" and self._scored()):
            super().do_POST()
            return
        body, _ = self._read_body()
        owner._record(RecordedRequest("POST", path, dict(self.headers.items()), body))
        chat = path != "/v1/completions"
        prompt_ids, answer = owner.answer(body["messages"] if chat else body["prompt"], body)
        try:
            ids, logprobs, finish = owner.decode_tokens(answer, body["max_tokens"])
        finally:
            owner._generation_done()
        if ids is None:
            self.close_connection = True  # the server stops
            return
        text = decode(ids)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": ids}
        if chat:
            content, calls = split_tool_calls(text) if body.get("tools") else (text, [])
            choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            choice["logprobs"] = {"content": [{"token": decode([t]), "logprob": lp} for t, lp in zip(ids, logprobs)]}
            self._send(200, {"choices": [choice], "prompt_token_ids": prompt_ids})
        else:
            choice.update(text=text, prompt_token_ids=prompt_ids, logprobs={"token_logprobs": logprobs})
            self._send(200, {"choices": [choice]})


class DecodingFakeVLLM(FakeVLLMServer):
    handler_class = _DecodingHandler

    def __init__(self, token_delay: float = 0.03, **kwargs: Any):
        super().__init__(**kwargs)
        self.token_delay = token_delay
        self.sampled = 0  # tokens sampled so far, all requests together
        self._answers: dict[tuple[int, ...], list[int]] = {}

    def answer(self, prompt: Any, body: dict) -> tuple[list[int], list[int]]:
        """The prompt's token ids and the tokens left to answer it with."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            for start, full in self._answers.items():
                done = len(prompt) - len(start)
                if tuple(prompt[:len(start)]) == start and 0 < done and prompt[len(start):] == full[:done]:
                    return list(prompt), full[done:]
            raise AssertionError("a token-id prompt that continues no earlier request")
        rendered = render_chat(prompt) if isinstance(prompt, list) else prompt
        full = expected_completion(prompt, stop=body.get("stop"), responder=self.responder).token_ids
        self._answers[tuple(encode(rendered))] = full
        return encode(rendered), full

    def decode_tokens(self, answer: list[int], max_tokens: int) -> tuple[list[int] | None, list[float], str]:
        ids: list[int] = []
        logprobs: list[float] = []
        with self._cond:
            self._cond.wait_for(lambda: not self.paused or self._stopping.is_set())
            self._in_flight += 1
            epoch = self._abort_epoch
            while len(ids) < min(len(answer), max_tokens):
                deadline = time.monotonic() + self.token_delay
                while time.monotonic() < deadline and self._abort_epoch == epoch and not self._stopping.is_set():
                    self._cond.wait(deadline - time.monotonic())
                if self._stopping.is_set():
                    return None, [], ""
                if self._abort_epoch != epoch:
                    return ids, logprobs, "abort"
                token = answer[len(ids)]
                logits = self.weights.get(LOGITS)
                logprobs.append(served_logprob(logits, token) if logits else token_logprob(len(ids), token))
                ids.append(token)
                self.sampled += 1
                self._cond.notify_all()
        return ids, logprobs, "length" if len(ids) < len(answer) else "stop"

    def wait_sampled(self, count: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.sampled >= count, 10), f"{self.sampled} tokens sampled"


@pytest.fixture
def fake():
    with DecodingFakeVLLM(model="fake-model") as server:
        yield server


@pytest.fixture
def client(fake):
    c = VLLMClient({"url": fake.url, **FAST})
    yield c
    c.close()


def _in_background(call) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", call()))
    thread.start()
    return thread, out


def _version_runs(versions: list[int]) -> list[tuple[int, int]]:
    """``[(version, tokens)]`` in order: the parts of a reply each weight version sampled."""
    runs: list[tuple[int, int]] = []
    for v in versions:
        runs = runs[:-1] + [(v, runs[-1][1] + 1)] if runs and runs[-1][0] == v else runs + [(v, 1)]
    return runs


def test_a_request_cut_by_two_pushes_keeps_its_tokens_and_records_who_sampled_each(fake, client, tmp_path):
    sync = VLLMDiskWeightSync({"sync_dir": str(tmp_path), "partial_rollout": True})
    first, second = Trainer(1), Trainer(2)
    params = SamplingParams(max_tokens=50, temperature=1.0, seed=7)
    thread, out = _in_background(lambda: client.complete(STORY, params))
    fake.wait_sampled(5)
    sync.sync(first, client, 1)
    fake.wait_sampled(fake.sampled + 5)
    sync.sync(second, client, 2)
    thread.join(30)
    result = out["result"]

    expected = encode(STORY)[:50]  # the whole answer, cut at max_tokens: no token lost or repeated
    assert result.response_token_ids == expected and result.text == decode(expected)
    assert result.prompt_token_ids == encode(STORY) and result.finish_reason == "length"
    runs = _version_runs(result.token_versions)
    assert [v for v, _ in runs] == [0, 1, 2] and all(n >= 5 for _, n in runs), runs
    assert result.model_version == 0  # the oldest weights in it, which staleness counts
    # each token's log-prob is the one of the weights that sampled it
    logits = {1: first.state[LOGITS].tolist(), 2: second.state[LOGITS].tolist()}
    for j, (token, version, logprob) in enumerate(zip(expected, result.token_versions, result.response_logprobs)):
        want = token_logprob(j, token) if version == 0 else served_logprob(logits[version], token)
        assert logprob == pytest.approx(want, abs=1e-9), (j, version)

    # two continuations: the prompt's and the kept tokens' ids, for the tokens left, with a seed of their own
    sent = [r.body for r in fake.requests if r.path == "/v1/completions"]
    assert len(sent) == 3 and sent[0]["prompt"] == STORY
    kept = [runs[0][1], runs[0][1] + runs[1][1]]
    for body, done in zip(sent[1:], kept):
        assert body["prompt"] == encode(STORY) + expected[:done] and body["max_tokens"] == 50 - done
        assert body["seed"] not in (None, 7) and body["return_token_ids"] is True
    assert sent[1]["seed"] != sent[2]["seed"]


def test_a_chat_reply_offered_tools_is_continued_and_its_calls_read_from_the_whole_text(tmp_path):
    call = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
    with DecodingFakeVLLM(model="fake-model", responder=lambda _q: call) as fake:
        client = VLLMClient({"url": fake.url, **FAST})
        try:
            tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
            messages = [{"role": "user", "content": "add 12 and 30"}]
            thread, out = _in_background(lambda: client.chat(messages, SamplingParams(max_tokens=200), tools))
            fake.wait_sampled(20)  # cut inside the call's JSON: the server's parser sees no call yet
            VLLMDiskWeightSync({"sync_dir": str(tmp_path), "partial_rollout": True}).sync(Trainer(3), client, 1)
            thread.join(30)
        finally:
            client.close()
    result = out["result"]
    assert result.text == call and result.response_token_ids == encode(call)
    assert result.prompt_token_ids == encode(render_chat(messages))
    assert [v for v, _ in _version_runs(result.token_versions)] == [0, 1]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in result.tool_calls] == \
        [("add", '{"a": 12, "b": 30}')]
    assert [r.path for r in fake.requests if r.method == "POST"] == ["/v1/chat/completions", "/detokenize",
                                                                     "/v1/completions"]


def test_a_request_cut_before_its_first_token_is_sent_again_whole(fake, client, tmp_path):
    fake.token_delay = 5.0  # nothing sampled when the push comes
    thread, out = _in_background(lambda: client.complete("What is 20 + 22?", SamplingParams(max_tokens=8)))
    deadline = time.monotonic() + 5
    while fake._in_flight == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    fake.token_delay = 0.001
    trainer = Trainer(4)
    VLLMDiskWeightSync({"sync_dir": str(tmp_path), "partial_rollout": True}).sync(trainer, client, 1)
    thread.join(30)
    result = out["result"]
    assert result.text == "42" and result.model_version == 1 and result.token_versions is None
    assert [r.body["prompt"] for r in fake.requests if r.path == "/v1/completions"] == ["What is 20 + 22?"] * 2
    assert result.response_logprobs == pytest.approx([served_logprob(trainer.state[LOGITS].tolist(), t)
                                                      for t in b"42"], abs=1e-9)


def test_without_partial_rollout_a_cut_request_is_generated_again_under_the_new_weights(fake, client, tmp_path):
    thread, out = _in_background(lambda: client.complete(STORY, SamplingParams(max_tokens=20)))
    fake.wait_sampled(5)
    VLLMDiskWeightSync({"sync_dir": str(tmp_path)}).sync(Trainer(5), client, 1)
    thread.join(30)
    result = out["result"]
    assert result.response_token_ids == encode(STORY)[:20] and result.model_version == 1
    assert result.token_versions is None
    assert [r.body["prompt"] for r in fake.requests if r.path == "/v1/completions"] == [STORY, STORY]


def test_partial_rollout_needs_the_abort_pause(client):
    for mode in ("wait", "keep"):
        problems = VLLMDiskWeightSync.check_config({"partial_rollout": True, "pause_mode": mode}, "weight")
        assert problems == [f"weight.pause_mode: '{mode}' with weight.partial_rollout: true: a partial rollout "
                            "aborts the requests in flight and continues them from their tokens; leave pause_mode "
                            "at abort"]
        with pytest.raises(ConfigError, match=f"weight.pause_mode: '{mode}' with weight.partial_rollout"):
            VLLMDiskWeightSync({"partial_rollout": True, "pause_mode": mode})
    with pytest.raises(ValueError, match="partial_rollout: needs pause_mode abort"):
        with client.weight_update(1, "keep", partial_rollout=True):
            pass
