"""An OpenAI-compatible chat endpoint on loopback, in front of a rollout worker's inference client.

An agent framework that only speaks HTTP (NexAU) is pointed at a *session* URL
``http://127.0.0.1:<port>/s/<token>/v1``. Every ``POST .../chat/completions`` of that session is
answered by the session's ``chat(messages, tools, params)`` callable with the session's sampling
parameters (the worker's: one home for them; each call gets its own seed), and the answer carries
what training needs besides the OpenAI fields: ``nexrl_train`` (``prompt_tokens``,
``response_tokens``, ``response_logprobs``: NexRL's convention, which NexAU's tracer records),
vLLM's ``prompt_token_ids`` / ``choices[0].token_ids``, and ``model_version``.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
import time
import uuid
import zlib
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

ChatFn = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None", Any], Any]


@dataclasses.dataclass
class _Session:
    chat: ChatFn
    params: Any
    calls: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def next_params(self) -> Any:
        with self.lock:
            n, self.calls = self.calls, self.calls + 1
        seed = self.params.seed
        if seed is not None and n:
            seed = zlib.crc32(f"{seed}|{n}".encode())
        return dataclasses.replace(self.params, seed=seed)


class ChatGateway:
    """A threaded HTTP server on 127.0.0.1; :meth:`session` hands out a base URL per agent run."""

    def __init__(self, model_name: str = "nexrl-policy"):
        self.model_name = model_name
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # no stderr noise per request
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                session, rest = gateway._route(self.path)
                if session is None or rest != "/v1/models":
                    return self._send(404, {"error": {"message": f"unknown path {self.path}"}})
                self._send(200, {"object": "list", "data": [{"id": gateway.model_name, "object": "model"}]})

            def do_POST(self) -> None:  # noqa: N802
                session, rest = gateway._route(self.path)
                if session is None or rest != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"unknown path {self.path}"}})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                    messages, tools = body["messages"], body.get("tools") or None
                    if not isinstance(messages, list):
                        raise ValueError("messages must be a list")
                except (ValueError, KeyError, TypeError) as exc:
                    return self._send(400, {"error": {"message": f"bad request: {exc}", "type": "invalid_request"}})
                try:
                    reply = session.chat(messages, tools, session.next_params())
                except Exception as exc:  # noqa: BLE001 - the agent sees a server error, as from any server
                    return self._send(500, {"error": {"message": f"{type(exc).__name__}: {exc}"}})
                self._send(200, gateway.completion_body(reply))

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="nexau-gateway", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @contextmanager
    def session(self, chat: ChatFn, params: Any) -> Iterator[str]:
        """A base URL (``.../v1``) whose requests go to ``chat`` with ``params``; closed on exit."""
        token = secrets.token_hex(8)
        with self._lock:
            self._sessions[token] = _Session(chat, params)
        try:
            yield f"http://127.0.0.1:{self.port}/s/{token}/v1"
        finally:
            with self._lock:
                self._sessions.pop(token, None)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _route(self, path: str) -> tuple[_Session | None, str]:
        parts = path.split("?", 1)[0].split("/", 3)  # "", "s", token, rest
        if len(parts) < 4 or parts[1] != "s":
            return None, ""
        with self._lock:
            return self._sessions.get(parts[2]), "/" + parts[3]

    def completion_body(self, reply: Any) -> dict[str, Any]:
        """An OpenAI chat completion for ``reply`` (a :class:`nexrl_core.CompletionResult`)."""
        calls = list(getattr(reply, "tool_calls", None) or [])
        message: dict[str, Any] = {"role": "assistant", "content": reply.text}
        if calls:
            message["tool_calls"] = calls
        prompt, response = reply.prompt_token_ids, reply.response_token_ids
        logprobs = reply.response_logprobs
        choice: dict[str, Any] = {"index": 0, "message": message,
                                  "finish_reason": "length" if reply.finish_reason == "length" else
                                  "tool_calls" if calls else "stop",
                                  "token_ids": response}
        if logprobs is not None and response is not None:
            choice["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None,
                                               "top_logprobs": []} for t, lp in zip(response, logprobs)]}
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt or []), "completion_tokens": len(response or []),
                          "total_tokens": len(prompt or []) + len(response or [])},
                "prompt_token_ids": prompt,
                "nexrl_train": {"prompt_tokens": prompt, "response_tokens": response, "response_logprobs": logprobs},
                "model_version": reply.model_version}
