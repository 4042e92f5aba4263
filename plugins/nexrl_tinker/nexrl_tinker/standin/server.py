"""An HTTP server on loopback that the unmodified ``tinker`` SDK talks to, backed by :mod:`.engine`.

The wire protocol is the SDK's (0.38): JSON request bodies validated with the SDK's own request
types; ``forward_backward`` bodies in protobuf (optionally zstd-compressed, which this server asks
for through ``/api/v1/client/config``); training, weight and sampling calls answer a future
(``{"request_id": ...}``) whose result the SDK polls with ``/api/v1/retrieve_future``: a
``try_again`` answer while it is not ready (and to the first ``try_again_polls`` polls of every
future whatever its state, so the SDK's polling path runs), then the JSON result, the protobuf result
(``ForwardBackwardOutput``, ``SampleResponse``) or ``{"error", "category"}`` for a request that
failed. (The SDK logs a warning for every ``try_again``; the default of 0 forced polls keeps a
run quiet, while anything slower than ``poll_wait_s`` still gets one.) Authentication is the
``X-API-Key`` header (any ``tml-`` key, or exactly ``api_key`` when one is configured). Training
requests of a model run in ``seq_id`` order whatever order they arrive in, and a request re-sent
with a ``seq_id`` already seen gets the first one's future.

Checkpoints: ``tinker://<run>/weights/<name>`` (``save_state``: weights + AdamW state) and
``tinker://<run>/sampler_weights/<name>`` map to folders under ``state_dir``, safetensors + JSON.

Faults (:class:`Fault`) make chosen requests answer an HTTP error, hang, or fail as a request.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import queue
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import zstandard
from loguru import logger
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from .engine import BaseModel, Example, TrainingRun, UserError
from .faults import Fault

_PROTO = "application/x-protobuf"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]+$")
_GATHER_MAX_S = 0.05  # the longest a sampling batch waits for more requests
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class _HTTPError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass
class _Future:
    request_id: str
    done: threading.Event = field(default_factory=threading.Event)
    content_type: str = "application/json"
    body: bytes = b""
    polls: int = 0


@dataclass
class _Sampler:
    base: BaseModel
    params: dict[str, Any]
    model_path: str | None


class StandinServer:
    """A local Tinker service: ``with StandinServer({"tiny": BaseModel(...)}) as server: server.url``.

    :param models: served base models by name (what ``base_model`` names in requests).
    :param state_dir: where ``tinker://`` checkpoints live (a temporary folder, removed on stop,
        when None).
    :param api_key: the only key accepted; None accepts any key starting with ``tml-``.
    :param faults: :class:`Fault` rules, checked in order on every request.
    :param try_again_polls: polls of each future answered ``try_again`` before its result.
    :param poll_wait_s: how long a poll waits for a pending result before ``try_again``.
    :param fwdbwd_chunk_len: datums per ``forward_backward`` request the SDK should send
        (smaller values make it split a call into parallel chunks).
    :param sample_batch_rows: most samples decoded in one batch: queued ``asample`` requests of
        the same sampler are decoded together up to this many rows.
    :param sample_batch_wait_s: how long a sampling batch waits for one more request (after each
        arrival, 50 ms in all unless this is longer).
    """

    def __init__(self, models: dict[str, BaseModel], *, state_dir: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, api_key: str | None = None, faults: Iterable[Fault] = (), try_again_polls: int = 0,
                 poll_wait_s: float = 0.2, fwdbwd_chunk_len: int = 1024, sample_batch_rows: int = 64,
                 sample_batch_wait_s: float = 0.005):
        if not models:
            raise ValueError("StandinServer needs at least one model")
        self.models = dict(models)
        self._own_state_dir = state_dir is None
        self.state_dir = Path(state_dir or tempfile.mkdtemp(prefix="tinker-standin-"))
        self.api_key = api_key
        self.faults = list(faults)
        self.try_again_polls = int(try_again_polls)
        self.poll_wait_s = float(poll_wait_s)
        self.fwdbwd_chunk_len = int(fwdbwd_chunk_len)
        self.sample_batch_rows = int(sample_batch_rows)
        self.sample_batch_wait_s = float(sample_batch_wait_s)
        self.stats: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._ids = itertools.count(1)
        self._sessions: dict[str, dict[str, int]] = {}
        self._futures: dict[str, _Future] = {}
        self._seen_seq: dict[tuple[str, int], str] = {}  # (model or sampler id, seq_id) -> request_id
        self._pending: dict[str, dict[int, Callable[[], None]]] = {}
        self._next_seq: dict[str, int] = {}
        self._runs: dict[str, TrainingRun] = {}
        self._samplers: dict[str, _Sampler] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._connections: set[socket.socket] = set()
        self._worker = threading.Thread(target=self._work, name="tinker-standin-worker", daemon=True)
        self._httpd = ThreadingHTTPServer((host, port), _handler_class(self))
        self._httpd.daemon_threads = True
        self._http_thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                             name="tinker-standin-http", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host if isinstance(host, str) else host.decode()}:{port}"

    def start(self) -> StandinServer:
        self._worker.start()
        self._http_thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: no new connection, and the open keep-alive ones are closed (a client still
        retrying then sees a refused connection, as from a server that went away)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._jobs.put(None)
        self._worker.join(timeout=30)
        if self._own_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> StandinServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def count(self, key: str) -> int:
        with self._lock:
            return self.stats.get(key, 0)

    def checkpoint_weights(self, tinker_path: str) -> tuple[str, dict[str, Any]]:
        """The base model a ``tinker://`` checkpoint (weights or sampler) trains and the tensors it
        holds: what a test compares with a model of its own."""
        meta, tensors = TrainingRun.read(self._folder_of(tinker_path))
        return meta["base_model"], tensors

    def _bump(self, key: str) -> None:
        with self._lock:
            self.stats[key] = self.stats.get(key, 0) + 1

    # ------------------------------------------------------------------ dispatch

    def handle(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, str, bytes, dict[str, str]]:
        """One HTTP request -> (status, content type, body, extra headers)."""
        self._bump(f"{method} {path}")
        with self._lock:
            fault = next((f for f in self.faults if f.matches(path)), None)
        try:
            if fault is not None and fault.action == "hang":
                self._bump("fault:hang")
                self._stopping.wait(fault.hang_s)
                raise ConnectionAbortedError  # dropped unanswered
            if fault is not None and isinstance(fault.action, int):
                self._bump(f"fault:{fault.action}")
                raise _HTTPError(fault.action, f"injected HTTP {fault.action} (stand-in fault)")
            if path != "/api/v1/healthz":
                self._authenticate(headers)
            if method == "GET":
                return self._respond(self._get(path))
            if headers.get("Content-Encoding", "") == "zstd":
                body = zstandard.ZstdDecompressor().decompress(body)
            if path == "/api/v1/forward_backward":
                return self._respond(self._forward_backward(pb_parse(body), fault))
            try:
                payload = json.loads(body or b"{}")
            except ValueError:
                raise _HTTPError(422, "request body is not JSON") from None
            if not isinstance(payload, dict):
                raise _HTTPError(422, "request body must be a JSON object")
            return self._respond(self._post(path, payload, fault))
        except _HTTPError as exc:
            return self._respond({"detail": exc.detail}, exc.status)
        except pydantic.ValidationError as exc:
            return self._respond({"detail": _validation_message(exc)}, 422)
        except UserError as exc:
            return self._respond({"detail": str(exc)}, 400)
        except ConnectionAbortedError:
            raise
        except Exception as exc:  # a bug here must not kill the connection thread silently
            logger.exception(f"stand-in: {method} {path} failed")
            return self._respond({"detail": f"internal error: {type(exc).__name__}: {exc}"}, 500)

    def _authenticate(self, headers: Any) -> None:
        key = headers.get("X-API-Key")
        if not key:
            raise _HTTPError(401, "missing X-API-Key header")
        if (self.api_key is not None and key != self.api_key) or not key.startswith("tml-"):
            raise _HTTPError(401, "invalid API key")

    @staticmethod
    def _respond(data: Any, status: int = 200) -> tuple[int, str, bytes, dict[str, str]]:
        if isinstance(data, _Proto):
            return status, _PROTO, data.body, {}
        return status, "application/json", json.dumps(data).encode(), {}

    def _get(self, path: str) -> Any:
        if path == "/api/v1/healthz":
            return {"status": "ok"}
        if path == "/api/v1/get_server_capabilities":
            return {"supported_models": [{"model_name": name, "max_context_length": base.max_length,
                                          "trainable": True, "sampleable": True}
                                         for name, base in self.models.items()]}
        match = re.fullmatch(r"/api/v1/samplers/(.+)", path)
        if match:
            sampler = self._sampler(match.group(1))
            return {"sampler_id": match.group(1), "base_model": sampler.base.name, "model_path": sampler.model_path}
        raise _HTTPError(404, f"no such endpoint: GET {path}")

    def _post(self, path: str, body: dict[str, Any], fault: Fault | None) -> Any:
        simple = {
            "/api/v1/client/config": self._client_config,
            "/api/v1/client/dynamic_config": lambda b: {"refresh_interval_sec": 300},
            "/api/v1/create_session": self._create_session,
            "/api/v1/session_heartbeat": self._heartbeat,
            "/api/v1/telemetry": lambda b: {"status": "accepted"},
            "/api/v1/get_info": self._get_info,
            "/api/v1/create_sampling_session": self._create_sampling_session,
            "/api/v1/join_sampling_session": self._join_sampling_session,
            "/api/v1/retrieve_future": self._retrieve,
            "/api/v1/cancel_future": lambda b: {},
        }
        if path in simple:
            return simple[path](body)
        submit = {
            "/api/v1/create_model": self._create_model,
            "/api/v1/optim_step": self._optim_step,
            "/api/v1/save_weights": self._save_weights,
            "/api/v1/save_weights_for_sampler": self._save_for_sampler,
            "/api/v1/load_weights": self._load_weights,
            "/api/v1/asample": self._asample,
        }
        if path in submit:
            return submit[path](body, fault)
        match = re.fullmatch(r"/api/v1/sessions/([^/]+)/finish", path)
        if match:
            with self._lock:
                self._sessions.setdefault(match.group(1), {})["finished"] = 1
            return {}
        raise _HTTPError(404, f"no such endpoint: POST {path}")

    # ------------------------------------------------------------------ sessions and config

    def _client_config(self, body: dict[str, Any]) -> dict[str, Any]:
        types.ClientConfigRequest.model_validate(body)
        # API keys only (no JWT exchange); zstd fwd/bwd bodies; chunking as configured.
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": True,
                "fwdbwd_max_chunk_len": self.fwdbwd_chunk_len, "parallel_fwdbwd_chunks": True}

    def _create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        types.CreateSessionRequest.model_validate(body)
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._sessions[session_id] = {}
        return {"type": "create_session", "session_id": session_id}

    def _heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        request = types.SessionHeartbeatRequest.model_validate(body)
        with self._lock:
            session = self._sessions.get(request.session_id)
        if session is None:
            raise _HTTPError(404, f"unknown session {request.session_id}")
        if session.get("finished"):
            raise _HTTPError(410, f"session {request.session_id} has finished")
        return {"type": "session_heartbeat"}

    def _base(self, name: str | None) -> BaseModel:
        if name not in self.models:
            raise UserError(f"unknown base model '{name}'; this server serves: {', '.join(self.models)}")
        return self.models[name]

    def _run(self, model_id: str) -> TrainingRun:
        with self._lock:
            run = self._runs.get(model_id)
        if run is None:
            raise _HTTPError(404, f"unknown model_id '{model_id}'")
        return run

    def _sampler(self, sampler_id: str) -> _Sampler:
        with self._lock:
            sampler = self._samplers.get(sampler_id)
        if sampler is None:
            raise _HTTPError(404, f"unknown sampling session '{sampler_id}'")
        return sampler

    def _get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        run = self._run(types.GetInfoRequest.model_validate(body).model_id)
        return {"type": "get_info", "model_id": run.model_id, "model_name": run.base.name,
                "model_data": {"arch": run.base.model.config.model_type, "model_name": run.base.name,
                               "tokenizer_id": run.base.name},
                "is_lora": run.lora is not None, "lora_rank": run.lora_rank}

    # ------------------------------------------------------------------ futures

    def _submit(self, job: Callable[[], Any], *, seq: tuple[str, int | None] | None = None, ordered: bool = True,
                fault: Fault | None = None, proto: bool = False, extra: dict[str, Any] | None = None) -> dict:
        """Register a future for ``job``, run on the worker thread. ``seq``: (owner id, seq_id): a re-sent
        request gets the first one's future and, when ``ordered``, the owner's requests run in seq_id order."""
        key = (seq[0], seq[1]) if seq is not None and seq[1] is not None else None
        with self._lock:
            if key is not None and key in self._seen_seq:  # a re-sent request: same future
                return {"request_id": self._seen_seq[key], **(extra or {})}
            future = _Future(f"req-{next(self._ids)}")
            self._futures[future.request_id] = future
            if key is not None:
                self._seen_seq[key] = future.request_id

        def run() -> None:
            try:
                if fault is not None and fault.action == "request_failed":
                    self._bump("fault:request_failed")
                    raise RuntimeError("injected request failure (stand-in fault)")
                result = job()
                future.content_type = _PROTO if proto else "application/json"
                future.body = result if proto else json.dumps(result).encode()
            except UserError as exc:
                future.body = json.dumps({"error": str(exc), "category": "user"}).encode()
            except Exception as exc:  # the request fails; the server keeps serving
                logger.warning(f"stand-in: {future.request_id} failed: {type(exc).__name__}: {exc}")
                future.body = json.dumps({"error": f"{type(exc).__name__}: {exc}", "category": "server"}).encode()
            future.done.set()

        run.job = job  # type: ignore[attr-defined]  # what the worker batches by
        if key is None or not ordered:
            self._jobs.put(run)
        else:
            owner, number = key
            with self._lock:
                self._pending.setdefault(owner, {})[number] = run
                expected = self._next_seq.setdefault(owner, 1)
                while expected in self._pending[owner]:
                    self._jobs.put(self._pending[owner].pop(expected))
                    expected += 1
                self._next_seq[owner] = expected
        return {"request_id": future.request_id, **(extra or {})}

    def _retrieve(self, body: dict[str, Any]) -> Any:
        request = types.FutureRetrieveRequest.model_validate(body)
        with self._lock:
            future = self._futures.get(request.request_id)
            if future is not None:
                future.polls += 1
        if future is None:
            raise _HTTPError(404, f"unknown request_id '{request.request_id}'")
        if future.polls <= self.try_again_polls or not future.done.wait(self.poll_wait_s):
            self._bump("try_again")
            return {"type": "try_again", "request_id": future.request_id, "queue_state": "active"}
        if future.content_type == _PROTO:
            return _Proto(future.body)
        return json.loads(future.body)

    def _work(self) -> None:
        backlog: collections.deque = collections.deque()  # taken from the queue, not run yet (in order)
        while True:
            task = backlog.popleft() if backlog else self._jobs.get()
            if task is None:
                return
            job = task.job
            if not isinstance(job, _SampleJob):
                task()
                continue
            # Sampling: every queued request of the same sampler joins this one's batch.
            self._gather(backlog)
            batch, rows = [task], job.num_samples
            for other in list(backlog):
                if other is not None and isinstance(other.job, _SampleJob) and other.job.sampler is job.sampler \
                        and rows + other.job.num_samples <= self.sample_batch_rows:
                    backlog.remove(other)
                    batch.append(other)
                    rows += other.job.num_samples
            _SampleJob.run_batch([t.job for t in batch])
            self._bump("sample_batches")
            for t in batch:
                t()

    def _gather(self, backlog: collections.deque) -> None:
        """Move queued tasks into ``backlog``, waiting up to ``sample_batch_wait_s`` after each arrival
        (a step's rollouts send their requests within a few milliseconds), ``_GATHER_MAX_S`` in all."""
        cap = time.monotonic() + max(_GATHER_MAX_S, self.sample_batch_wait_s)
        while True:
            wait = min(self.sample_batch_wait_s, cap - time.monotonic())
            try:
                backlog.append(self._jobs.get(timeout=wait) if wait > 0 else self._jobs.get_nowait())
            except queue.Empty:
                return

    # ------------------------------------------------------------------ training

    def _create_model(self, body: dict[str, Any], fault: Fault | None) -> dict:
        request = types.CreateModelRequest.model_validate(body)
        if request.optimizer_config.type != "adamw":
            raise UserError(f"optimizer '{request.optimizer_config.type}' is not supported by the stand-in")
        base = self._base(request.base_model)
        model_id = f"{request.session_id}:train:{request.model_seq_id}"
        lora = request.lora_config.model_dump() if request.lora_config is not None else None

        def job() -> dict:
            run = TrainingRun(model_id, base, lora)
            with self._lock:
                self._runs[model_id] = run
            return {"type": "create_model", "model_id": model_id}
        return self._submit(job, fault=fault)

    def _forward_backward(self, message: Any, fault: Fault | None) -> dict:
        run = self._run(message.model_id)
        examples = [_example(d, i) for i, d in enumerate(message.data)]
        config = {k: v.number for k, v in message.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"} \
            if message.loss_fn_config_v2 else dict(message.loss_fn_config)
        loss_fn, backward = message.loss_fn, not message.forward_only

        def job() -> bytes:
            outputs, metrics = run.forward_backward(examples, loss_fn, config, backward)
            return _forward_backward_output(outputs, metrics)
        return self._submit(job, seq=(run.model_id, message.seq_id), fault=fault, proto=True)

    def _optim_step(self, body: dict[str, Any], fault: Fault | None) -> dict:
        request = types.OptimStepRequest.model_validate(body)
        if not isinstance(request.optim_params, types.AdamParams):
            raise UserError("the stand-in only runs Adam steps (AdamParams)")
        run = self._run(request.model_id)
        return self._submit(lambda: {"metrics": run.optim_step(request.optim_params)},
                            seq=(run.model_id, request.seq_id), fault=fault)

    def _checkpoint_dir(self, run_id: str, kind: str, name: str) -> Path:
        if not all(_NAME_RE.match(part) and part.strip(".") for part in (run_id, name)):
            raise UserError(f"invalid checkpoint name '{name}'")
        return self.state_dir / run_id / kind / name

    def _folder_of(self, tinker_path: str) -> Path:
        try:
            parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        kind, _, name = parsed.checkpoint_id.partition("/")
        return self._checkpoint_dir(parsed.training_run_id, kind, name)

    def _save_weights(self, body: dict[str, Any], fault: Fault | None) -> dict:
        request = types.SaveWeightsRequest.model_validate(body)
        run = self._run(request.model_id)
        name = request.path or f"checkpoint-{request.seq_id}"
        folder = self._checkpoint_dir(run.model_id, "weights", name)

        def job() -> dict:
            if folder.exists() and not request.overwrite:
                raise UserError(f"checkpoint '{name}' already exists (pass overwrite=True to replace it)")
            run.save(folder, with_optimizer=True)
            return {"type": "save_weights", "path": f"tinker://{run.model_id}/weights/{name}"}
        return self._submit(job, seq=(run.model_id, request.seq_id), fault=fault)

    def _save_for_sampler(self, body: dict[str, Any], fault: Fault | None) -> dict:
        request = types.SaveWeightsForSamplerRequest.model_validate(body)
        run = self._run(request.model_id)
        session_id = run.model_id.split(":train:")[0]

        def job() -> dict:
            snapshot = run.snapshot()
            if request.path is not None:
                folder = self._checkpoint_dir(run.model_id, "sampler_weights", request.path)
                run.save(folder, with_optimizer=False)
                return {"type": "save_weights_for_sampler",
                        "path": f"tinker://{run.model_id}/sampler_weights/{request.path}"}
            sampler_id = f"{session_id}:sample:{request.sampling_session_seq_id}"
            with self._lock:
                self._samplers[sampler_id] = _Sampler(run.base, snapshot, None)
            return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}
        return self._submit(job, seq=(run.model_id, request.seq_id), fault=fault)

    def _load_weights(self, body: dict[str, Any], fault: Fault | None) -> dict:
        request = types.LoadWeightsRequest.model_validate(body)
        folder = self._folder_of(request.path)
        if request.model_id is not None:  # load into an existing run (TrainingClient.load_state*)
            run = self._run(request.model_id)

            def load_existing() -> dict:
                run.load(folder, with_optimizer=request.optimizer)
                return {"type": "load_weights", "path": request.path, "model_id": run.model_id}
            return self._submit(load_existing, seq=(run.model_id, request.seq_id), fault=fault)
        if request.session_id is None or request.model_seq_id is None:
            raise UserError("load_weights needs model_id, or session_id with model_seq_id")
        model_id = f"{request.session_id}:train:{request.model_seq_id}"

        def create_from_state() -> dict:
            meta, _ = TrainingRun.read(folder)
            run = TrainingRun(model_id, self._base(request.base_model or meta["base_model"]), meta["lora"])
            run.load(folder, with_optimizer=request.optimizer)
            with self._lock:
                self._runs[model_id] = run
            return {"type": "load_weights", "path": request.path, "model_id": model_id}
        return self._submit(create_from_state, fault=fault)

    # ------------------------------------------------------------------ sampling

    def _create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        request = types.CreateSamplingSessionRequest.model_validate(body)
        sampler_id = f"{request.session_id}:sample:{request.sampling_session_seq_id}"
        if request.model_path:
            meta, tensors = TrainingRun.read(self._folder_of(request.model_path))
            sampler = _Sampler(self._base(meta["base_model"]), tensors, request.model_path)
        else:
            sampler = _Sampler(self._base(request.base_model), {}, None)
        with self._lock:
            self._samplers[sampler_id] = sampler
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def _join_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        request = types.JoinSamplingSessionRequest.model_validate(body)
        self._sampler(request.sampling_session_id)
        return {"type": "join_sampling_session", "client_counter": next(self._ids)}

    def _asample(self, body: dict[str, Any], fault: Fault | None) -> dict:
        request = types.SampleRequest.model_validate(body)
        if request.sampling_session_id is None:
            raise UserError("asample needs a sampling_session_id")
        if request.topk_prompt_logprobs or request.topk_sample_logprobs or request.prompt_alt_tokens_k \
                or request.target_prompt_logprobs is not None:
            raise UserError("top-k logprobs, target_prompt_logprobs and prompt_alt_tokens are not supported by "
                            "the stand-in")
        sampler = self._sampler(request.sampling_session_id)
        prompt = request.prompt.to_ints()
        n = int(request.num_samples)

        last_n = request.prompt_logprobs_last_n
        if last_n is not None and not (request.prompt_logprobs and 1 <= last_n <= len(prompt) - 1):
            raise UserError(f"prompt_logprobs_last_n={last_n}: needs prompt_logprobs and 1 <= it <= "
                            f"len(prompt) - 1 ({len(prompt) - 1})")
        job = _SampleJob(sampler, prompt, n, request.sampling_params, bool(request.prompt_logprobs), last_n)
        sequence_ids = [f"{request.sampling_session_id}:{request.seq_id}:{i}" for i in range(n)]
        return self._submit(job, seq=(request.sampling_session_id, request.seq_id), ordered=False, fault=fault,
                            proto=True, extra={"sample_sequence_ids": sequence_ids})


class _SampleJob:
    """One ``asample`` request; the worker decodes the queued ones of a sampler together
    (:meth:`run_batch`), then each future takes its own result by calling the job."""

    def __init__(self, sampler: _Sampler, prompt: list[int], num_samples: int, sampling: Any, prompt_logprobs: bool,
                 prompt_logprobs_last_n: int | None = None):
        self.sampler = sampler
        self.num_samples = max(num_samples, 1)
        self._request = (prompt, num_samples, sampling, prompt_logprobs)
        self._last_n = prompt_logprobs_last_n  # only the prompt's last n tokens are scored (None before them)
        self._outcome: Any = None  # (sequences, prompt logprobs), or the UserError the request got

    @staticmethod
    def run_batch(jobs: list[_SampleJob]) -> None:
        inputs = []
        for job in jobs:
            try:
                inputs.append((job, job.sampler.base.sample_input(*job._request)))
            except UserError as exc:  # this request fails alone
                job._outcome = exc
        if inputs:
            sampler = inputs[0][0].sampler
            for (job, _), outcome in zip(inputs, sampler.base.sample_batch(sampler.params, [i for _, i in inputs])):
                job._outcome = outcome

    def __call__(self) -> bytes:
        if self._outcome is None:  # run alone
            _SampleJob.run_batch([self])
        if isinstance(self._outcome, Exception):
            raise self._outcome
        sequences, prompt_lps = self._outcome
        if prompt_lps is not None and self._last_n is not None:
            prompt_lps = [math.nan] * (len(prompt_lps) - self._last_n) + list(prompt_lps[-self._last_n:])
        return _sample_response(sequences, prompt_lps)


@dataclass
class _Proto:
    """A protobuf response body."""

    body: bytes


def pb_parse(body: bytes) -> Any:
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception:
        raise _HTTPError(422, "forward_backward body is not a ForwardBackwardRequest protobuf") from None
    return message


def _example(datum: Any, index: int) -> Example:
    tokens: list[int] = []
    for chunk in datum.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise UserError(f"datum {index}: only encoded_text chunks are supported by the stand-in")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    inputs = {}
    for key, tensor in datum.loss_fn_inputs.items():
        dtype = _DTYPES.get(tensor.dtype)
        if dtype is None:
            raise UserError(f"datum {index}: loss_fn_inputs['{key}'] has an unsupported dtype")
        shape = list(tensor.shape)
        if tensor.WhichOneof("encoding") == "sparse_csr":
            csr = tensor.sparse_csr
            dense = np.zeros(shape, dtype=dtype)
            crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
            cols = np.frombuffer(csr.col_indices, dtype=np.int64)
            values = np.frombuffer(csr.values, dtype=dtype)
            for row in range(len(crow) - 1):
                dense[row, cols[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
            inputs[key] = dense
        else:
            array = np.frombuffer(tensor.dense, dtype=dtype)
            inputs[key] = array.reshape(shape) if shape else array
    return Example(tokens, inputs)


def _forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in (outputs[0] if outputs else {}):
        arrays = [o[name].astype(np.float32) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        record.fields[name].CopyFrom(pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays),
                                                      offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32))
    return message.SerializeToString()


def _sample_response(sequences: list[tuple[list[int], list[float], str]], prompt_lps: list[float] | None) -> bytes:
    message = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        message.sequences.add(stop_reason=pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH,
                              tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
                              logprobs=np.asarray(logprobs, dtype=np.float32).tobytes())
    if prompt_lps is not None:
        message.prompt_logprobs = np.asarray(prompt_lps, dtype=np.float32).tobytes()
    return message.SerializeToString()


def _validation_message(exc: pydantic.ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"invalid request: {where}: {first.get('msg')}" + (f" ({exc.error_count()} errors)"
                                                               if exc.error_count() > 1 else "")


def _handler_class(server: StandinServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            with server._lock:
                server._connections.add(self.connection)

        def finish(self) -> None:
            with server._lock:
                server._connections.discard(self.connection)
            super().finish()

        def _serve(self, method: str) -> None:
            if server._stopping.is_set():
                self.close_connection = True
                return
            body = self._read_body() if method == "POST" else b""
            path = self.path.split("?", 1)[0]
            started = time.perf_counter()
            try:
                status, content_type, payload, extra = server.handle(method, path, self.headers, body)
            except ConnectionAbortedError:
                self.close_connection = True
                return
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            for key, value in extra.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(payload)
            logger.debug(f"stand-in: {method} {path} -> {status} ({(time.perf_counter() - started) * 1000:.1f} ms)")

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                parts: list[bytes] = []
                while True:
                    size = int(self.rfile.readline().strip().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:  # requests are logged by _serve, headers never
            pass

    return Handler
