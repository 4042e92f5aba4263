"""A real, deterministic OpenAI-compatible HTTP server for tests.

`FakeOpenAIServer` listens on 127.0.0.1 (an ephemeral port unless one is given)
and speaks the endpoints an RL rollout needs, with vLLM's extra fields:

- ``POST /v1/completions``      (``prompt`` is a string)
- ``POST /v1/chat/completions`` (``messages`` is a list of ``{role, content}``; with ``tools``,
  ``<tool_call>{json}</tool_call>`` blocks of the reply come back as ``message.tool_calls``, as
  from vLLM with the hermes tool parser, unless ``tool_parser = False``)
- ``GET  /v1/models``

Wire layout follows vLLM's OpenAI-compatible server
(``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``):

- completions: ``choices[i].text``, ``choices[i].finish_reason``,
  ``choices[i].logprobs.{tokens, token_logprobs, top_logprobs, text_offset}`` when the
  request has ``logprobs: <int>``, and ``choices[i].token_ids`` /
  ``choices[i].prompt_token_ids`` when it has ``return_token_ids: true``;
- chat: ``choices[i].message.content``, ``choices[i].logprobs.content[j].{token,
  logprob, bytes, top_logprobs}`` when the request has ``logprobs: true``,
  ``choices[i].token_ids`` and the top-level ``prompt_token_ids`` when it has
  ``return_token_ids: true``.

Generation is deterministic. The "tokenizer" is byte level (token id = byte value of
the UTF-8 text); a chat prompt is rendered with :func:`render_chat`. The response text
is ``responder(prompt_text)`` (default :func:`default_responder`: ``"What is A + B?"``
is answered with the sum, anything else is echoed), cut at the first ``stop`` string
(``finish_reason "stop"``, the stop string excluded, as vLLM does) or at
``max_tokens`` tokens (``finish_reason "length"``). Token ``j`` of a response has the
logprob :func:`token_logprob`\\ ``(j, token_id)``. :func:`expected_completion` computes
what the server will answer, for assertions.

Failure injection (generation endpoints only; ``/v1/models`` is never affected, so a
health check reflects only whether the server is up):

- ``fail_next(n, status=503)``: answer the next ``n`` generation requests with an HTTP
  error in OpenAI's error layout;
- ``delay`` (seconds, every generation request) and ``delay_next(n, seconds)``;
- ``malform_next(n, kind)``: ``"json"`` (a 200 whose body is not JSON),
  ``"no_choices"``, ``"length_mismatch"`` (one more token id than logprobs);
- ``abort_next(n)``: answer with ``finish_reason "abort"`` (vLLM's aborted request);
- ``plain_openai = True``: never return token ids or logprobs, like a server without
  vLLM's extensions; ``strict_params = True`` additionally rejects vLLM-only request
  fields with a 400, as api.openai.com does;
- a responder that raises :class:`RespondWithError` gets that request answered with its HTTP
  status (failures chosen by the prompt's content rather than by count);
- ``stop()`` then ``start()`` (or ``restart()``) serves again on the same port, for
  "the server died mid-run" tests; ``stop()`` closes open keep-alive connections and
  joins every handler thread.

Every request is recorded (``requests``; ``request_count`` counts generation requests,
``count(path)`` any path), with its JSON body and headers, so tests can assert what a
client sent.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "FakeOpenAIServer",
    "RecordedRequest",
    "RespondWithError",
    "decode",
    "default_responder",
    "encode",
    "expected_completion",
    "render_chat",
    "token_logprob",
]

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
GENERATION_PATHS = (COMPLETIONS_PATH, CHAT_PATH)

# Request fields vLLM accepts and api.openai.com rejects ("Unrecognized request argument").
VLLM_ONLY_FIELDS = ("return_token_ids", "return_tokens_as_token_ids", "top_k", "min_p", "repetition_penalty")

_SUM_RE = re.compile(r"What is\s+(-?\d+)\s*\+\s*(-?\d+)\s*\?")


# --------------------------------------------------------------------------- tokenizer


def encode(text: str) -> list[int]:
    """Byte-level tokenization: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def decode(token_ids: list[int]) -> str:
    return bytes(token_ids).decode("utf-8", errors="replace")


def render_chat(messages: list[dict[str, Any]]) -> str:
    """The fake chat template: ``<|role|>\\ncontent\\n`` per message, then the assistant cue. An
    assistant message's ``tool_calls`` follow its content as ``<tool_call>{json}</tool_call>``."""
    parts = [f"<|{m.get('role', 'user')}|>\n{_content_text(m.get('content'))}{_calls_text(m)}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


def _calls_text(message: dict[str, Any]) -> str:
    out = ""
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        args = json.loads(args) if isinstance(args, str) else args
        out += "<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}) + "</tool_call>"
    return out


_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """What a vLLM tool parser (hermes) makes of a reply: the text outside the blocks, the calls."""
    calls = []
    for i, match in enumerate(_CALL_RE.finditer(text)):
        obj = json.loads(match.group(1))
        calls.append({"id": f"chatcmpl-tool-{i}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))}})
    content = _CALL_RE.sub("", text).strip()
    return (content or None), calls


def token_logprob(position: int, token_id: int) -> float:
    """Deterministic logprob of the response token at `position` (0-based)."""
    return -round(((token_id * 31 + position * 7) % 97 + 1) / 100.0, 2)


def default_responder(prompt_text: str) -> str:
    """``What is A + B?`` -> ``"A+B"``; anything else is echoed back."""
    match = _SUM_RE.search(prompt_text)
    if match:
        return str(int(match.group(1)) + int(match.group(2)))
    return prompt_text


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


class RespondWithError(Exception):
    """Raised by a responder: the server answers this request with HTTP ``status``."""

    def __init__(self, status: int):
        super().__init__(f"HTTP {status}")
        self.status = status


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_token_ids: list[int]


def expected_completion(
    prompt: str | list[dict[str, Any]],
    max_tokens: int | None = None,
    stop: list[str] | str | None = None,
    responder: Callable[[str], str] = default_responder,
) -> Generation:
    """What the server answers for `prompt` (a string, or chat messages)."""
    if isinstance(prompt, str):
        rendered, question = prompt, prompt
    else:
        rendered = render_chat(prompt)
        users = [m for m in prompt if m.get("role") in ("user", "tool")]
        # the responder sees the last user message, or "tool: <result>" after a tool call
        question = ("tool: " if users and users[-1].get("role") == "tool" else "") + \
            (_content_text(users[-1].get("content")) if users else "")
    full = encode(responder(question))
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    limit = len(full) if max_tokens is None else max(0, int(max_tokens))

    # vLLM checks stop strings as tokens are generated: a stop string wins when it is
    # complete within max_tokens; the stop string itself is left out of the text.
    cut, finish = len(full), "stop"
    best = None
    for s in stops:
        s_ids = encode(s)
        if not s_ids:
            continue
        idx = _find(full, s_ids)
        if idx is not None and idx + len(s_ids) <= limit and (best is None or idx < best):
            best = idx
    if best is not None:
        cut, finish = best, "stop"
    elif len(full) > limit:
        cut, finish = limit, "length"
    ids = full[:cut]
    return Generation(
        text=decode(ids),
        token_ids=ids,
        logprobs=[token_logprob(j, t) for j, t in enumerate(ids)],
        finish_reason=finish,
        prompt_token_ids=encode(rendered),
    )


def _find(haystack: list[int], needle: list[int]) -> int | None:
    n = len(needle)
    for i in range(len(haystack) - n + 1):
        if haystack[i : i + n] == needle:
            return i
    return None


def _token_str(token_id: int) -> str:
    return bytes([token_id]).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- server


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any  # parsed JSON, or the raw text when it was not JSON, or None
    time: float = field(default_factory=time.monotonic)


class _Injection:
    def __init__(self, kind: str, remaining: int, **extra: Any):
        self.kind = kind
        self.remaining = remaining
        self.extra = extra


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type, owner: FakeOpenAIServer):
        self.owner = owner
        self._conn_lock = threading.Lock()
        self._conns: dict[threading.Thread, socket.socket] = {}
        super().__init__(address, handler)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        # Like ThreadingMixIn, but remember every connection so stop() can close
        # idle keep-alive sockets and join their threads.
        thread = threading.Thread(
            target=self._serve_connection,
            args=(request, client_address),
            name=f"fake-openai-conn-{client_address[1]}",
            daemon=True,
        )
        with self._conn_lock:
            self._conns[thread] = request
        thread.start()

    def _serve_connection(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # a client that went away mid-answer
            pass
        finally:
            self.shutdown_request(request)
            with self._conn_lock:
                self._conns.pop(threading.current_thread(), None)

    def handle_error(self, request: Any, client_address: Any) -> None:  # keep test output quiet
        pass

    def close_connections(self, join_timeout: float) -> list[threading.Thread]:
        with self._conn_lock:
            items = list(self._conns.items())
        for _, sock in items:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + join_timeout
        for thread, _ in items:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t for t, _ in items if t.is_alive()]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real servers do
    server: _HTTPServer
    timeout = 30  # an idle keep-alive connection is dropped after this long

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence stderr
        pass

    # -- plumbing
    def _read_body(self) -> tuple[Any, bool]:
        length = int(self.headers.get("Content-Length") or 0)
        return self._parse_body(self.rfile.read(length) if length else b"")

    @staticmethod
    def _parse_body(raw: bytes) -> tuple[Any, bool]:
        """The body as JSON (and True), or as text (and False) when it is not JSON."""
        if not raw:
            return None, True
        try:
            return json.loads(raw), True
        except ValueError:
            return raw.decode("utf-8", errors="replace"), False

    def _send(self, status: int, payload: Any = None, raw: bytes | None = None, headers: dict | None = None) -> None:
        data = raw if raw is not None else json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _error(self, status: int, message: str, err_type: str | None = None, param: str | None = None) -> None:
        if err_type is None:
            err_type = HTTPStatus(status).phrase.replace(" ", "") + "Error"
        self._send(status, {"error": {"message": message, "type": err_type, "param": param, "code": status}})

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    # -- verbs
    def do_GET(self) -> None:  # noqa: N802
        owner = self.server.owner
        path = self._path()
        owner._record(RecordedRequest("GET", path, dict(self.headers.items()), None))
        if not self._authorized():
            return
        if path == MODELS_PATH:
            self._send(
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": owner.model, "object": "model", "created": owner.created, "owned_by": "nexrl-tests"}
                    ],
                },
            )
        else:
            self._error(404, f"no route for GET {path}")

    def do_POST(self) -> None:  # noqa: N802
        owner = self.server.owner
        path = self._path()
        body, is_json = self._read_body()
        owner._record(RecordedRequest("POST", path, dict(self.headers.items()), body))
        if path not in GENERATION_PATHS:
            self._error(404, f"no route for POST {path}")
            return
        if not self._authorized():
            return

        injection = owner._take_injection()
        delay = owner.delay + (injection.extra.get("seconds", 0.0) if injection and injection.kind == "delay" else 0.0)
        held = owner._hold(delay)
        if held == "stop":
            self.close_connection = True  # server stopping: drop the request, as a dying server would
            return
        if injection and injection.kind == "fail":
            status = injection.extra["status"]
            headers = {"Retry-After": injection.extra["retry_after"]} if injection.extra.get("retry_after") else None
            self._send(
                status,
                {
                    "error": {
                        "message": f"injected failure (HTTP {status})",
                        "type": HTTPStatus(status).phrase.replace(" ", "") + "Error",
                        "param": None,
                        "code": status,
                    }
                },
                headers=headers,
            )
            return
        if injection and injection.kind == "json":
            self._send(200, raw=b"<html>502 Bad Gateway</html> {not json")
            return

        if not is_json or not isinstance(body, dict):
            self._error(400, "request body is not a JSON object")
            return
        if body.get("stream"):
            self._error(400, "streaming is not supported by the fake server")
            return
        model = body.get("model")
        if model != owner.model:
            self._error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
            return
        if owner.strict_params:
            for name in VLLM_ONLY_FIELDS:
                if name in body:
                    self._error(400, f"Unrecognized request argument supplied: {name}", "invalid_request_error")
                    return

        try:
            if path == COMPLETIONS_PATH:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    self._error(400, "`prompt` must be a string", param="prompt")
                    return
                payload = self._completions(owner, body, prompt)
            else:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                    self._error(400, "`messages` must be a non-empty list of objects", param="messages")
                    return
                payload = self._chat(owner, body, messages)
        except RespondWithError as exc:  # the responder chose to fail this prompt
            self._error(exc.status, f"responder failure (HTTP {exc.status})")
            return

        if injection and injection.kind == "no_choices":
            payload.pop("choices", None)
        elif injection and injection.kind == "length_mismatch":
            choice = payload["choices"][0]
            if choice.get("token_ids") is not None:
                choice["token_ids"].append(0)
        elif (injection and injection.kind == "abort") or held == "abort":
            payload["choices"][0]["finish_reason"] = "abort"
        self._send(200, payload)

    def _authorized(self) -> bool:
        key = self.server.owner.api_key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._error(401, "Incorrect API key provided.", "invalid_api_key")
        return False

    # -- generation
    def _generate(self, owner: FakeOpenAIServer, prompt: Any, body: dict, default_max: int | None) -> Generation:
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", default_max))
        return expected_completion(prompt, max_tokens=max_tokens, stop=body.get("stop"), responder=owner.responder)

    def _usage(self, gen: Generation) -> dict[str, int]:
        p, c = len(gen.prompt_token_ids), len(gen.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _completions(self, owner: FakeOpenAIServer, body: dict, prompt: str) -> dict:
        gen = self._generate(owner, prompt, body, default_max=16)  # vLLM's completions default
        want_ids = bool(body.get("return_token_ids")) and not owner.plain_openai
        n_logprobs = body.get("logprobs")
        choice: dict[str, Any] = {
            "index": 0,
            "text": gen.text,
            "logprobs": None,
            "finish_reason": gen.finish_reason,
            "stop_reason": None,
        }
        if n_logprobs is not None and not owner.plain_openai:
            tokens = [_token_str(t) for t in gen.token_ids]
            offsets, pos = [], len(prompt)
            for tok in tokens:
                offsets.append(pos)
                pos += len(tok)
            choice["logprobs"] = {
                "text_offset": offsets,
                "token_logprobs": list(gen.logprobs),
                "tokens": tokens,
                "top_logprobs": [{tok: lp} if n_logprobs > 0 else None for tok, lp in zip(tokens, gen.logprobs)],
            }
        if want_ids:
            choice["token_ids"] = list(gen.token_ids)
            choice["prompt_token_ids"] = list(gen.prompt_token_ids)
        return {
            "id": f"cmpl-{owner._next_id()}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": owner.model,
            "choices": [choice],
            "usage": self._usage(gen),
        }

    def _chat(self, owner: FakeOpenAIServer, body: dict, messages: list[dict]) -> dict:
        gen = self._generate(owner, messages, body, default_max=None)
        want_ids = bool(body.get("return_token_ids")) and not owner.plain_openai
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": gen.text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": gen.finish_reason,
            "stop_reason": None,
        }
        if body.get("tools") and owner.tool_parser:
            content, calls = split_tool_calls(gen.text)
            if calls:
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                choice["finish_reason"] = "tool_calls"
        if body.get("logprobs") and not owner.plain_openai:
            choice["logprobs"] = {
                "content": [
                    {"token": _token_str(t), "logprob": lp, "bytes": [t], "top_logprobs": []}
                    for t, lp in zip(gen.token_ids, gen.logprobs)
                ]
            }
        payload: dict[str, Any] = {
            "id": f"chatcmpl-{owner._next_id()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": owner.model,
            "choices": [choice],
            "usage": self._usage(gen),
        }
        if want_ids:
            choice["token_ids"] = list(gen.token_ids)
            payload["prompt_token_ids"] = list(gen.prompt_token_ids)
        return payload


class FakeOpenAIServer:
    """A deterministic OpenAI-compatible server on loopback. See the module docstring.

    Use as a context manager (``with FakeOpenAIServer() as server: ... server.url``) or
    call :meth:`start` / :meth:`stop`.
    """

    handler_class: type[BaseHTTPRequestHandler] = _Handler  # a subclass may serve more routes

    def __init__(
        self,
        model: str = "fake-model",
        responder: Callable[[str], str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
    ):
        self.model = model
        self.responder: Callable[[str], str] = responder or default_responder
        self.host = host
        self.port = port
        self.api_key = api_key
        self.created = int(time.time())
        # knobs
        self.delay: float = 0.0
        self.plain_openai: bool = False
        self.strict_params: bool = False
        self.tool_parser: bool = True  # requests with tools get tool_calls parsed out of the text (vLLM's hermes)
        # state
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._injections: list[_Injection] = []
        self._ids = 0
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- lifecycle
    @property
    def url(self) -> str:
        """Base URL for an OpenAI client, e.g. ``http://127.0.0.1:PORT/v1``."""
        if not self.port:
            raise RuntimeError("FakeOpenAIServer has no port yet: call start() first")
        return f"http://{self.host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._httpd is not None

    def start(self) -> FakeOpenAIServer:
        if self._httpd is not None:
            return self
        self._stopping.clear()
        httpd = _HTTPServer((self.host, self.port), self.handler_class, self)
        self.port = httpd.server_address[1]  # the same port on a restart
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, name="fake-openai-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, join_timeout: float = 5.0) -> None:
        """Stop serving, close every open connection and join all server threads."""
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        self._stopping.set()  # wakes delayed handlers
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(join_timeout)
        leftover = httpd.close_connections(join_timeout)
        self._httpd, self._thread = None, None
        if leftover or (thread is not None and thread.is_alive()):
            raise RuntimeError(f"FakeOpenAIServer threads still running after stop: {leftover or [thread]}")

    def restart(self) -> FakeOpenAIServer:
        """Stop, then serve again on the same port."""
        self.stop()
        return self.start()

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _hold(self, delay: float) -> str | None:
        """Before a generation request is answered: wait ``delay`` seconds. ``"stop"`` when the
        server is stopping (the request is dropped), ``"abort"`` to answer with vLLM's aborted
        request; a subclass may hold requests longer (a paused server)."""
        if delay > 0 and self._stopping.wait(delay):
            return "stop"
        return None

    # -- failure injection
    def fail_next(self, n: int = 1, status: int = 503, retry_after: float | None = None) -> None:
        """Answer the next `n` generation requests with HTTP `status`."""
        self._inject(_Injection("fail", n, status=status, retry_after=retry_after))

    def delay_next(self, n: int = 1, seconds: float = 1.0) -> None:
        """Hold the next `n` generation requests `seconds` before answering them."""
        self._inject(_Injection("delay", n, seconds=seconds))

    def malform_next(self, n: int = 1, kind: str = "json") -> None:
        """Break the next `n` answers: ``json``, ``no_choices`` or ``length_mismatch``."""
        if kind not in ("json", "no_choices", "length_mismatch"):
            raise ValueError(f"unknown malformation {kind!r}")
        self._inject(_Injection(kind, n))

    def abort_next(self, n: int = 1) -> None:
        """Answer the next `n` generation requests with vLLM's ``finish_reason: "abort"``."""
        self._inject(_Injection("abort", n))

    def reset(self) -> None:
        """Forget recorded requests and pending injections; clear the knobs."""
        with self._lock:
            self.requests.clear()
            self._injections.clear()
        self.delay = 0.0
        self.plain_openai = False
        self.strict_params = False

    def _inject(self, injection: _Injection) -> None:
        if injection.remaining > 0:
            with self._lock:
                self._injections.append(injection)

    def _take_injection(self) -> _Injection | None:
        with self._lock:
            if not self._injections:
                return None
            inj = self._injections[0]
            inj.remaining -= 1
            if inj.remaining <= 0:
                self._injections.pop(0)
            return inj

    # -- counters
    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def _next_id(self) -> int:
        with self._lock:
            self._ids += 1
            return self._ids

    @property
    def request_count(self) -> int:
        """Generation requests received (completions + chat), failed ones included."""
        with self._lock:
            return sum(1 for r in self.requests if r.path in GENERATION_PATHS)

    def count(self, path: str | None = None) -> int:
        """Requests received for `path` (``/v1/...``), or all of them."""
        with self._lock:
            return sum(1 for r in self.requests if path is None or r.path == path)

    def last_request(self, path: str | None = None) -> RecordedRequest:
        with self._lock:
            for r in reversed(self.requests):
                if path is None or r.path == path:
                    return r
        raise LookupError(f"no request received for {path or 'any path'}")
