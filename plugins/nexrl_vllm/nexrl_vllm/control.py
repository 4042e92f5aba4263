"""vLLM's control plane over HTTP: the development and RL endpoints a weight sync drives.

Routes and bodies as vLLM's server defines them (enabled by ``VLLM_SERVER_DEV_MODE=1``):

- ``POST /pause?mode=abort|wait|keep`` and ``POST /resume``: hold generation around an update
  (``abort``: in-flight requests end with ``finish_reason "abort"``; ``wait``: they finish
  first; ``keep``: they are frozen and continue with the new weights);
- ``POST /reset_prefix_cache``: drop KV blocks computed with the old weights;
- ``POST /reload_weights`` ``{"weights_path": DIR}``: reload the weights from a folder of
  safetensors; servers without that route take ``POST /collective_rpc``
  ``{"method": "reload_weights", "kwargs": {"weights_path": DIR}}``;
- weight transfer (``--weight-transfer-config '{"backend": "nccl"}'``): ``GET /get_world_size``,
  ``POST /init_weight_transfer_engine`` ``{"init_info": {...}}`` once, then per update
  ``POST /start_weight_update`` ``{"is_checkpoint_format": true}``, ``POST /update_weights``
  ``{"update_info": {...}}`` (answers once the tensors arrived) and ``POST /finish_weight_update``.

Every call has a timeout; a failure is a :class:`SyncPhaseError` naming the phase and the route.
"""

from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlparse

from nexrl_core import InferenceError, NexRLError

PAUSE_MODES = ("abort", "wait", "keep")


class SyncPhaseError(NexRLError, InferenceError):
    """One phase of a weight sync failed or timed out (the message names the phase and the route)."""

    def __init__(self, phase: str, message: str):
        super().__init__(message)
        self.phase = phase


@dataclass
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class HTTPFailure(Exception):
    def __init__(self, what: str, timed_out: bool = False):
        super().__init__(what)
        self.timed_out = timed_out


def request(base_url: str, method: str, path: str, *, body: Any = None, params: dict | None = None,
            headers: dict[str, str] | None = None, timeout: float = 60.0) -> Answer:
    """One HTTP request on a fresh connection (stdlib only; no proxy, whatever the environment says)."""
    url = urlparse(base_url)
    conn_cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(url.hostname or "", url.port, timeout=timeout)
    target = (url.path.rstrip("/") + path) + (f"?{urlencode(params)}" if params else "")
    data = json.dumps(body).encode() if body is not None else None
    all_headers = {"Content-Type": "application/json", **(headers or {})} if data is not None else dict(headers or {})
    try:
        conn.request(method, target, body=data, headers=all_headers)
        response = conn.getresponse()
        return Answer(response.status, response.read())
    except (socket.timeout, TimeoutError):
        raise HTTPFailure("timeout", timed_out=True) from None
    except (OSError, http.client.HTTPException) as exc:
        raise HTTPFailure(f"{type(exc).__name__}: {exc}") from None
    finally:
        conn.close()


class VLLMControl:
    """HTTP calls to one vLLM server's control routes (thread-safe: one connection per call)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key and api_key != "EMPTY" else {}

    def close(self) -> None:
        pass

    def call(self, phase: str, method: str, path: str, *, body: Any = None, params: dict | None = None,
             timeout: float | None = None, missing_ok: bool = False) -> Any:
        """One request; its JSON answer (None when empty). ``missing_ok``: a 404 returns ``NotImplemented``."""
        limit = self.timeout if timeout is None else float(timeout)
        where = f"{method} {self.base_url}{path}"
        try:
            response = request(self.base_url, method, path, body=body, params=params, headers=self._headers,
                               timeout=limit)
        except HTTPFailure as exc:
            if exc.timed_out:
                raise SyncPhaseError(phase, f"phase '{phase}': {where} got no answer within {limit:g}s") from None
            raise SyncPhaseError(phase, f"phase '{phase}': {where} failed ({exc})") from None
        if response.status == 404 and missing_ok:
            return NotImplemented
        if response.status == 404:
            raise SyncPhaseError(phase, f"phase '{phase}': {where} answered HTTP 404: the server does not expose this "
                                        "route. vLLM enables it with VLLM_SERVER_DEV_MODE=1 (a managed server gets it "
                                        "on loopback or with service.inference_service.dev_endpoints: true); the "
                                        "weight-transfer routes also need --weight-transfer-config")
        if response.status >= 400:
            raise SyncPhaseError(phase, f"phase '{phase}': {where} answered HTTP {response.status}: "
                                        f"{_short(response.body.decode('utf-8', 'replace'))}")
        if not response.body:
            return None
        try:
            return response.json()
        except ValueError:
            return response.body.decode("utf-8", "replace")

    # -- generation ------------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        # `mode` is the current parameter; servers before it read wait_for_inflight_requests.
        params = {"mode": mode, "wait_for_inflight_requests": "true" if mode == "wait" else "false"}
        self.call("pause", "POST", "/pause", params=params)

    def resume(self) -> None:
        self.call("resume", "POST", "/resume")

    def reset_prefix_cache(self) -> None:
        self.call("reset_prefix_cache", "POST", "/reset_prefix_cache")

    # -- weights from disk -----------------------------------------------------------------
    def reload_weights(self, weights_path: str, timeout: float) -> None:
        answer = self.call("reload_weights", "POST", "/reload_weights", body={"weights_path": weights_path},
                           timeout=timeout, missing_ok=True)
        if answer is NotImplemented:
            self.call("reload_weights", "POST", "/collective_rpc", timeout=timeout,
                      body={"method": "reload_weights", "kwargs": {"weights_path": weights_path}})
        elif isinstance(answer, dict) and answer.get("status") not in (None, "ok"):
            raise SyncPhaseError("reload_weights", f"phase 'reload_weights': the server reported {answer}")

    # -- LoRA adapters (a server started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING) ---------
    def load_lora_adapter(self, name: str, path: str, timeout: float) -> None:
        self.call("load_lora_adapter", "POST", "/v1/load_lora_adapter", body={"lora_name": name, "lora_path": path},
                  timeout=timeout)

    def unload_lora_adapter(self, name: str) -> None:
        self.call("unload_lora_adapter", "POST", "/v1/unload_lora_adapter", body={"lora_name": name})

    def refresh_tied_output(self) -> int | None:
        """After a reload: re-pack a CPU server's output layer tied to the embedding (see
        :mod:`nexrl_vllm.worker_extension`). The number of layers re-packed, or None when the server
        runs without nexrl's worker extension (its answer to the unknown method is an error)."""
        try:
            answer = self.call("refresh_tied_output", "POST", "/collective_rpc",
                               body={"method": "nexrl_refresh_tied_output"})
        except SyncPhaseError:
            return None
        results = answer.get("results") if isinstance(answer, dict) else None
        return sum(int(r) for r in results) if isinstance(results, list) else None

    # -- weight transfer engine --------------------------------------------------------------
    def world_size(self) -> int:
        answer = self.call("get_world_size", "GET", "/get_world_size")
        size = answer.get("world_size") if isinstance(answer, dict) else None
        if not isinstance(size, int) or size < 1:
            raise SyncPhaseError("get_world_size", f"phase 'get_world_size': unexpected answer {answer!r}")
        return size

    def init_weight_transfer(self, init_info: dict[str, Any], timeout: float) -> None:
        self.call("init_weight_transfer_engine", "POST", "/init_weight_transfer_engine",
                  body={"init_info": init_info}, timeout=timeout)

    def start_weight_update(self) -> None:
        self.call("start_weight_update", "POST", "/start_weight_update", body={"is_checkpoint_format": True})

    def update_weights(self, update_info: dict[str, Any], timeout: float) -> None:
        self.call("update_weights", "POST", "/update_weights", body={"update_info": update_info}, timeout=timeout)

    def finish_weight_update(self, version: int) -> None:
        self.call("finish_weight_update", "POST", "/finish_weight_update", body={"weight_version": str(version)})


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
