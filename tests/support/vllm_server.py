"""A fake vLLM server for tests: the OpenAI-compatible fake plus vLLM's own routes.

`FakeVLLMServer` extends :class:`tests.support.openai_server.FakeOpenAIServer` (generation with
``return_token_ids`` and logprobs, failure injection, request recording) with what vLLM's
server answers besides generation, in vLLM's shapes:

- ``GET /health`` (200 with an empty body; 503 when ``unhealthy``), ``GET /version``;
- development routes, only when ``dev_mode`` (``VLLM_SERVER_DEV_MODE=1``; otherwise 404 as in
  vLLM): ``POST /pause?mode=abort|wait|keep``, ``POST /resume``, ``GET /is_paused``,
  ``POST /reset_prefix_cache``, ``POST /reload_weights`` ``{"weights_path"}``,
  ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path"}}``;
- the weight-transfer routes: ``GET /get_world_size``, ``POST /init_weight_transfer_engine``
  ``{"init_info": {master_address, master_port, rank_offset, world_size}}``,
  ``POST /start_weight_update``, ``POST /update_weights`` ``{"update_info": {names,
  dtype_names, shapes, packed}}``, ``POST /finish_weight_update``.

The "model": when the served weights hold a tensor named :data:`LOGITS` (shape [256]), token
``t`` of every response has the log-prob ``log_softmax(LOGITS)[t]``; without it the base fake's
deterministic log-probs apply. So a test sees the weights a sync delivered in the log-probs the
server serves afterwards. Weights arrive from ``reload_weights`` (a folder with
``model.safetensors``, read with the safetensors library) or through the weight-transfer
engine, whose "NCCL group" here is a TCP connection to the trainer's rendezvous
(:class:`LoopbackTransport` is the trainer side): the fake's worker connects to
``master_address:master_port`` on init and reads each tensor's raw bytes in ``update_weights``.

Pausing behaves as vLLM does for the client: new generation requests wait until ``/resume``;
in-flight ones are aborted (``finish_reason "abort"``), finished first (``wait``) or frozen and
finished after the resume with the new weights (``keep``).

``fail_route(path, n, status)`` and ``hang_route(path, seconds)`` break control routes;
``control_log`` lists the control calls received in order, e.g. ``["pause:abort",
"reload_weights", "reset_prefix_cache", "resume"]``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import threading
import time
from typing import Any
from urllib.parse import parse_qs, urlparse

from tests.support.openai_server import GENERATION_PATHS, FakeOpenAIServer, Generation, _Handler

LOGITS = "fake.logits"
_DTYPES = {"float32": ("f", 4), "float64": ("d", 8), "float16": ("e", 2), "int64": ("q", 8), "int32": ("i", 4)}


def served_logprob(logits: list[float], token_id: int) -> float:
    """The log-prob the fake serves for ``token_id`` under ``logits`` (log-softmax, in float64)."""
    top = max(logits)
    norm = top + math.log(sum(math.exp(v - top) for v in logits))
    return logits[token_id] - norm


class _VLLMHandler(_Handler):
    server: Any

    def do_GET(self) -> None:  # noqa: N802
        owner: FakeVLLMServer = self.server.owner
        path = self._path()
        if path == "/health":
            if owner.unhealthy:
                self._send(503, raw=b"")
            else:
                self._send(200, raw=b"")
            return
        if path == "/version":
            self._send(200, {"version": "0.0.0-fake"})
            return
        if path in ("/is_paused", "/get_world_size"):
            if self._dev_route_ok(path):
                payload = {"is_paused": owner.paused} if path == "/is_paused" else {"world_size": owner.world_size}
                self._send(200, payload)
            return
        super().do_GET()

    def do_POST(self) -> None:  # noqa: N802
        owner: FakeVLLMServer = self.server.owner
        path = self._path()
        if path == "/v1/completions" and self._scored():
            return
        if path in GENERATION_PATHS:
            try:
                super().do_POST()
            finally:
                owner._generation_done()
            return
        params = {k: v[-1] for k, v in parse_qs(urlparse(self.path).query).items()}
        body, _ = self._read_body()
        owner._record_control("POST", path, body, params)
        if not self._dev_route_ok(path):
            return
        failure = owner._take_route_failure(path)
        if failure is not None:
            kind, value = failure
            if kind == "hang":
                owner._stopping.wait(value)
                self.close_connection = True
                return
            self._error(value, f"injected failure of {path}")
            return
        handler = _CONTROL_ROUTES.get(path)
        if handler is None:
            self._error(404, f"no route for POST {path}")
            return
        try:
            status, payload = handler(owner, body if isinstance(body, dict) else {}, params)
        except Exception as exc:  # an answer vLLM would give as a 500
            status, payload = 500, {"error": f"{type(exc).__name__}: {exc}"}
        if payload is None:
            self._send(status, raw=b"")
        else:
            self._send(status, payload)

    def _read_body(self) -> tuple[Any, bool]:
        raw = getattr(self, "_body_bytes", None)
        if raw is None:
            return super()._read_body()
        del self._body_bytes  # read once, by _scored: the JSON of it again
        return self._parse_body(raw)

    def _scored(self) -> bool:
        """vLLM's ``prompt_logprobs`` for token-id prompts (what VLLMClient.score sends): each given
        token's log-prob under the loaded logits, -1.0 each before any weights were loaded."""
        owner: FakeVLLMServer = self.server.owner
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        self._body_bytes = raw
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("prompt_logprobs") is None:
            return False
        prompts = body.get("prompt")
        if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
            self._error(400, "prompt_logprobs: the fake takes token-id prompts only", param="prompt")
            return True
        logits = owner.logits()

        def logprob(token: int) -> float:
            return served_logprob(logits, token % len(logits)) if logits else -1.0

        choices = [{"index": i, "text": "", "finish_reason": "length",
                    "prompt_logprobs": [None] + [{str(t): {"logprob": logprob(t), "rank": 1}} for t in p[1:]]}
                   for i, p in enumerate(prompts)]
        self._send(200, {"object": "text_completion", "model": body.get("model"), "choices": choices})
        return True

    def _dev_route_ok(self, path: str) -> bool:
        owner: FakeVLLMServer = self.server.owner
        if path in _CONTROL_ROUTES or path in ("/is_paused", "/get_world_size"):
            if not owner.dev_mode:
                self._error(404, "Not Found")
                return False
            if path in _TRANSFER_ROUTES and not owner.weight_transfer:
                self._error(500, "weight transfer is not configured (--weight-transfer-config)")
                return False
        return True

    def _generate(self, owner: Any, prompt: Any, body: dict, default_max: int | None) -> Generation:
        gen = super()._generate(owner, prompt, body, default_max)
        logits = owner.logits()
        if logits is not None:
            gen.logprobs = [served_logprob(logits, t) for t in gen.token_ids]
        return gen


# -- control routes: (owner, body, query) -> (status, payload) --------------------------------------


def _pause(owner: FakeVLLMServer, body: dict, params: dict) -> tuple[int, Any]:
    mode = params.get("mode", "abort")
    if params.get("wait_for_inflight_requests") == "true":
        mode = "wait"
    if mode not in ("abort", "wait", "keep"):
        return 400, {"error": f"bad mode {mode}"}
    owner._pause(mode)
    return 200, {"status": "paused"}


def _resume(owner: FakeVLLMServer, body: dict, params: dict) -> tuple[int, Any]:
    owner._resume()
    return 200, {"status": "resumed"}


def _reset_prefix_cache(owner: FakeVLLMServer, body: dict, params: dict) -> tuple[int, Any]:
    owner.prefix_cache_resets += 1
    owner.control_log.append("reset_prefix_cache")
    return 200, None


def _reload_weights(owner: FakeVLLMServer, body: dict, params: dict) -> tuple[int, Any]:
    if owner.legacy_reload:
        return 404, {"detail": "Not Found"}
    path = body.get("weights_path")
    owner._load_folder(path)
    return 200, {"status": "ok", "weights_path": path}


def _collective_rpc(owner: FakeVLLMServer, body: dict, params: dict) -> tuple[int, Any]:
    if body.get("method") != "reload_weights":
        return 400, {"error": f"unsupported method {body.get('method')!r}"}
    owner._load_folder((body.get("kwargs") or {}).get("weights_path"))
    return 200, {"results": [None]}


def _init_transfer(owner: FakeVLLMServer, body: dict, params: dict) -> tuple[int, Any]:
    info = body.get("init_info")
    if not isinstance(info, dict):
        return 400, {"detail": "Missing 'init_info' in request body"}
    owner._connect_worker(info)
    return 200, {"message": "Weight transfer initialized"}


def _start_update(owner: FakeVLLMServer, body: dict, params: dict) -> tuple[int, Any]:
    owner._staging = {}
    owner.control_log.append("start_weight_update")
    return 200, {"message": "Weight update started"}


def _update_weights(owner: FakeVLLMServer, body: dict, params: dict) -> tuple[int, Any]:
    info = body.get("update_info")
    if not isinstance(info, dict):
        return 400, {"detail": "Missing 'update_info' in request body"}
    owner._receive(info)
    return 200, {"message": "Weights updated"}


def _finish_update(owner: FakeVLLMServer, body: dict, params: dict) -> tuple[int, Any]:
    owner._commit(body.get("weight_version"))
    return 200, {"message": "Weight update finished"}


_TRANSFER_ROUTES = {"/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                    "/get_world_size"}
_CONTROL_ROUTES = {
    "/pause": _pause, "/resume": _resume, "/reset_prefix_cache": _reset_prefix_cache,
    "/reload_weights": _reload_weights, "/collective_rpc": _collective_rpc,
    "/init_weight_transfer_engine": _init_transfer, "/start_weight_update": _start_update,
    "/update_weights": _update_weights, "/finish_weight_update": _finish_update,
}


class FakeVLLMServer(FakeOpenAIServer):
    """See the module docstring."""

    handler_class = _VLLMHandler

    def __init__(self, *args: Any, dev_mode: bool = True, weight_transfer: bool = True, world_size: int = 1,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.dev_mode = dev_mode
        self.weight_transfer = weight_transfer
        self.world_size = world_size
        self.unhealthy = False
        self.legacy_reload = False  # no /reload_weights route: only /collective_rpc
        self.paused = False
        self.pause_mode: str | None = None
        self.weights: dict[str, list[float]] = {}
        self.weight_version: str | None = None
        self.loaded_paths: list[str] = []
        self.prefix_cache_resets = 0
        self.control_log: list[str] = []
        self.control_requests: list[tuple[str, str, Any, dict]] = []  # (method, path, JSON body, query)
        self.received: list[dict[str, Any]] = []  # update_info of every update_weights call
        self._cond = threading.Condition()
        self._in_flight = 0
        self._abort_epoch = 0
        self._route_failures: dict[str, list[tuple[str, float]]] = {}
        self._worker: socket.socket | None = None
        self._staging: dict[str, list[float]] = {}

    # -- knobs -----------------------------------------------------------------------------------
    def fail_route(self, path: str, n: int = 1, status: int = 500) -> None:
        self._route_failures.setdefault(path, []).extend([("fail", status)] * n)

    def hang_route(self, path: str, seconds: float = 30.0) -> None:
        self._route_failures.setdefault(path, []).append(("hang", seconds))

    def logits(self) -> list[float] | None:
        with self._cond:
            return self.weights.get(LOGITS)

    def stop(self, join_timeout: float = 5.0) -> None:
        self._stopping.set()  # wakes requests held by a pause
        with self._cond:
            self._cond.notify_all()
        if self._worker is not None:  # unblocks an update_weights still reading tensors
            try:
                self._worker.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._worker.close()
            self._worker = None
        super().stop(join_timeout)

    # -- generation under pauses -------------------------------------------------------------------
    def _hold(self, delay: float) -> str | None:
        with self._cond:
            # New requests wait while generation is paused.
            if not self._cond.wait_for(lambda: not self.paused or self._stopping.is_set(), 30):
                return "stop"
            if self._stopping.is_set():
                return "stop"
            self._in_flight += 1
            epoch = self._abort_epoch
            deadline = time.monotonic() + delay
            while delay > 0 and time.monotonic() < deadline:
                if self._stopping.is_set():
                    return "stop"
                if self._abort_epoch != epoch:
                    return "abort"
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            if self._abort_epoch != epoch:
                return "abort"
            # Frozen requests ("keep") finish after the resume, with whatever weights are then served.
            self._cond.wait_for(lambda: not (self.paused and self.pause_mode == "keep") or self._stopping.is_set())
            return "stop" if self._stopping.is_set() else None

    def _generation_done(self) -> None:
        with self._cond:
            self._in_flight = max(0, self._in_flight - 1)
            self._cond.notify_all()

    def _pause(self, mode: str) -> None:
        with self._cond:
            self.paused, self.pause_mode = True, mode
            if mode == "abort":
                self._abort_epoch += 1
            self._cond.notify_all()
            if mode == "wait":
                self._cond.wait_for(lambda: self._in_flight == 0 or self._stopping.is_set())
        self.control_log.append(f"pause:{mode}")

    def _resume(self) -> None:
        with self._cond:
            self.paused, self.pause_mode = False, None
            self._cond.notify_all()
        self.control_log.append("resume")

    # -- weights -----------------------------------------------------------------------------------
    def _load_folder(self, path: Any) -> None:
        from safetensors.numpy import load_file

        if not isinstance(path, str) or not os.path.isfile(os.path.join(path, "model.safetensors")):
            raise FileNotFoundError(f"no model.safetensors under {path!r}")
        tensors = load_file(os.path.join(path, "model.safetensors"))
        with self._cond:
            self.weights = {name: [float(v) for v in array.reshape(-1)] for name, array in tensors.items()}
            self.weight_version = os.path.basename(path)
            self.loaded_paths.append(path)
        self.control_log.append("reload_weights")

    def _connect_worker(self, info: dict) -> None:
        for key in ("master_address", "master_port", "rank_offset", "world_size"):
            if key not in info:
                raise ValueError(f"init_info lacks {key}")
        deadline = time.monotonic() + 10
        while True:  # the trainer may not listen yet: retry, as vLLM's rendezvous does
            try:
                sock = socket.create_connection((info["master_address"], int(info["master_port"])), timeout=10)
                break
            except ConnectionRefusedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)
        sock.sendall(struct.pack("!i", int(info["rank_offset"])))  # this worker's rank
        self._worker = sock
        self.control_log.append("init_weight_transfer_engine")

    def _receive(self, info: dict) -> None:
        if self._worker is None:
            raise RuntimeError("NCCL weight transfer not initialized. Call init_transfer_engine() first.")
        names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError("`dtype_names` and `shapes` should be of the same size as `names`")
        self._worker.settimeout(60)
        for name, dtype, shape in zip(names, dtypes, shapes):
            fmt, size = _DTYPES[dtype]
            count = math.prod(shape) if shape else 1
            raw = _read_exact(self._worker, count * size)
            self._staging[name] = list(struct.unpack(f"<{count}{fmt}", raw))
        self.received.append(dict(info))
        self.control_log.append("update_weights")

    def _commit(self, version: Any) -> None:
        with self._cond:
            self.weights = {**self.weights, **self._staging}
            self.weight_version = None if version is None else str(version)
        self._staging = {}
        self.control_log.append("finish_weight_update")

    def _record_control(self, method: str, path: str, body: Any, params: dict) -> None:
        with self._lock:
            self.control_requests.append((method, path, body, dict(params)))

    def _take_route_failure(self, path: str) -> tuple[str, float] | None:
        queue = self._route_failures.get(path)
        return queue.pop(0) if queue else None


def _read_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the trainer closed the weight-transfer connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class LoopbackTransport:
    """The trainer side of the fake's weight transfer: the rendezvous listens, the fake's worker
    connects, tensors go as raw little-endian bytes in ``update_info`` order (a CPU stand-in for
    vLLM's NCCL broadcast, used to drive the HTTP phases of ``vllm_nccl`` in tests)."""

    def __init__(self, device=None) -> None:
        self.device = device  # where the trainer's tensors were (None: the host, as in every CPU test)
        self.workers: list[socket.socket] = []
        self.sent: list[list[str]] = []
        self.stall_send = False  # a broadcast that never completes (as a hung NCCL call)

    def init(self, master_address: str, master_port: int, world_size: int) -> None:
        with socket.create_server((master_address, master_port)) as listener:
            listener.settimeout(30)
            for _ in range(world_size - 1):
                conn, _ = listener.accept()
                rank = struct.unpack("!i", _read_exact(conn, 4))[0]
                if rank < 1:
                    raise ValueError(f"a worker joined with rank {rank}")
                self.workers.append(conn)

    def send(self, named_tensors: Any, packed: bool) -> None:
        if self.stall_send:
            time.sleep(3600)
        for _name, tensor in named_tensors:
            data = tensor.detach().cpu().contiguous().numpy().tobytes()  # little-endian hosts
            for conn in self.workers:
                conn.sendall(data)
        self.sent.append([name for name, _ in named_tensors])

    def close(self) -> None:
        for conn in self.workers:
            conn.close()
        self.workers.clear()

