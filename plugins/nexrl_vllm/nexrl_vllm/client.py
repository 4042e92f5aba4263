"""The ``vllm`` inference backend: a vLLM OpenAI-compatible server, attached by URL or started here.

Generation goes through nexrl-core's OpenAI-compatible client (one implementation of the wire
format, the retries and the answer checks); this class adds what is vLLM's own:

- **managed serve**: with ``model_path`` (and no ``url``) it starts ``vllm serve`` as a
  subprocess with ``--logprobs-mode processed_logprobs`` (log-probs of the distribution it
  samples from, after temperature and top-p, which is what the trainer scores), waits until
  ``/health`` and ``/v1/models`` answer, writes the server's log to ``<run_dir>/vllm_server.log``
  and stops the server (its whole process group) on every exit path;
- **token ids, always**: every completion must carry the prompt and response token ids and the
  per-token log-probs (vLLM's ``return_token_ids``); an answer without them is an error, never a
  silent re-tokenisation;
- **weight updates under live traffic** (:meth:`VLLMClient.weight_update`, used by the
  ``vllm_disk`` and ``vllm_nccl`` weight-sync backends): new requests are held at the client,
  the server pauses generation, in-flight requests end (``pause_mode``), the new weights go in,
  the prefix cache is reset, the version is set and generation resumes. Every request is
  labelled with the version it was served under: a request aborted by the pause is retried
  after the update and carries the new version;
- **partial rollout** (``weight.partial_rollout``): a request the pause aborts keeps the tokens
  it has (ids and log-probs, as vLLM's aborted answer carries them) and goes on after the update
  as a completion of the prompt's and those tokens' ids for the tokens left; the reply records
  the version of each token (``token_versions``) and each token's log-prob is the one of the
  weights that sampled it.

Config (``service.inference_service`` with ``backend: vllm``): ``url`` to attach, or
``model_path`` to serve; the other keys are in :class:`VLLMServeSettings` and docs/vllm.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import types
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from loguru import logger
from omegaconf import DictConfig, OmegaConf

from nexrl_core import (
    Capabilities,
    CompletionResult,
    ConfigError,
    InferenceError,
    OpenAICompatibleClient,
    SamplingParams,
    Settings,
    check_options,
    parse_tool_calls,
    setting,
)

from .control import PAUSE_MODES, SyncPhaseError, VLLMControl
from .server import ManagedVLLMServer, ServeOptions, is_loopback, log_tail, parse_command
from .vllm_cli import vllm_version

EMBEDDED_MODEL = "smollm2-135m-instruct"  # nexrl's default model (a GGUF in a wheel), served from its HF folder
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")  # vLLM's modes that return log-probs (not logits)
WEIGHT_TRANSFER_BACKENDS = ("nccl",)
DRAIN_GRACE_S = 1.0  # after a pause, how long answers already on their way may take to arrive
CUT = "abort"  # finish_reason of a reply a partial-rollout pause cut: continued before it is returned
INSTALL_HINT = ("starting `vllm serve` needs vLLM: pip install 'nexrl-vllm[cpu]' (x86 CPUs) or 'nexrl-vllm[serve]' "
                "(Linux with a CUDA GPU; vLLM pins its own torch), or attach to a running server with `url`, or set "
                "`command` to your vllm executable")

# The core client's keys this backend passes through (declared in OpenAICompatibleClient.SETTINGS).
_CLIENT_KEYS = ("url", "api_key", "model", "timeout", "max_retries", "retry_backoff", "max_retry_time")
@dataclass(frozen=True, kw_only=True)
class VLLMServeSettings(Settings):
    """The keys of a server nexrl starts itself (``model_path``), next to the OpenAI client's own."""

    model_path: str | None = setting(None, "start `vllm serve MODEL_PATH` (excludes url): a model folder, a Hub id, "
                                           "or the embedded smollm2-135m-instruct (converted once, with nexrl-torch)")
    command: str | list[str] | None = setting(None, "the executable and subcommand, a string or a list (default: "
                                                    "vllm serve)")
    host: str = setting("127.0.0.1", "where a managed server listens")
    port: int | None = setting(None, "its port (default: a free one)", ge=1, le=65535)
    tensor_parallel_size: int = setting(1, "vLLM's --tensor-parallel-size", ge=1)
    gpu_memory_utilization: float = setting(0.9, "vLLM's --gpu-memory-utilization", ge=0.01, le=1.0)
    dtype: str = setting("auto", "vLLM's --dtype")
    max_model_len: int | None = setting(None, "vLLM's --max-model-len (default: vLLM's)", ge=1)
    logprobs_mode: str = setting("processed_logprobs", "--logprobs-mode: log-probs of the distribution sampled from "
                                                       "(processed_logprobs) or of the raw logits; training needs "
                                                       "log-probs, and processed_logprobs matches the trainer's "
                                                       "temperature", choices=LOGPROBS_MODES)
    weight_transfer: str | None = setting(None, "nccl: start with vLLM's NCCL weight-transfer engine (for "
                                                "weight.backend: vllm_nccl)", choices=WEIGHT_TRANSFER_BACKENDS)
    dev_endpoints: bool | None = setting(None, "vLLM's development routes (pause, reload, weight transfer); null: "
                                               "on only when host is a loopback address")
    enable_lora: bool = setting(False, "serve LoRA adapters (--enable-lora, runtime adapter loading): for "
                                       "weight.backend vllm_lora, which pushes only the adapter")
    max_lora_rank: int = setting(16, "vLLM's --max-lora-rank: the largest adapter rank it accepts (with "
                                     "enable_lora)", ge=1)
    extra_args: list[str | int | float] = setting([], "more `vllm serve` arguments")
    env: dict[str, str | int | float | bool] = setting({}, "environment variables of the server process")
    startup_timeout: float = setting(900.0, "seconds for the server to answer /health and /v1/models", ge=0.1)
    shutdown_grace: float = setting(15.0, "seconds between SIGTERM and SIGKILL at shutdown", ge=0)
    log_file: str | None = setting(None, "the server's output (default: <run_dir>/vllm_server.log)")


def _section(config: Mapping[str, Any] | None, section: str) -> Mapping[str, Any]:
    """``config`` as this backend reads it: the core's keys, the OpenAI client's and its own, each
    declared default filled (the values are never re-defaulted here)."""
    return VLLMClient.own_section(config, section)


def _value(cfg: Mapping[str, Any], key: str) -> Any:
    """A declared key's value, a nested mapping as a plain dict."""
    value = cfg[key]
    return dict(value) if isinstance(value, Mapping) else value


def _get(mapping: Any, *keys: str) -> Any:
    for key in keys:
        mapping = mapping.get(key) if isinstance(mapping, Mapping) else None
    return mapping


def _run_dir(config: Mapping[str, Any] | None, relative_key: str = "...run_dir") -> str | None:
    """The recipe's run_dir, when the section came from a recipe (a node of the whole config)."""
    if isinstance(config, DictConfig):
        found = OmegaConf.select(config, relative_key, default=None)
        return str(found) if found else None
    return None


def parse_serve_options(config: Mapping[str, Any] | None,
                        section: str = "service.inference_service") -> tuple[ServeOptions | None, list[str]]:
    """The managed-server options (None when attaching by ``url``) and every problem found."""
    run_dir = _run_dir(config)  # off the recipe's node, before reading makes the section a plain one
    config = _section(config, section)
    parsed, problems = VLLMServeSettings.parse(config, section, own=True)
    if parsed is None:
        return None, problems
    serve, defaults = parsed, VLLMServeSettings()
    url = _value(config, "url")
    if url and serve.model_path:
        problems.append(f"{section}: set either `url` (attach to a running vLLM server) or `model_path` (start "
                        "`vllm serve`), not both")
    if not url and not serve.model_path:
        problems.append(f"{section}: the vllm backend needs `url` (a running vLLM server, e.g. http://127.0.0.1:8000)"
                        " or `model_path` (a model folder or id to start `vllm serve` with)")
    if url and not str(url).startswith(("http://", "https://")):
        problems.append(f"{section}.url: expected an http(s) URL, got {url!r}")
    served = [key for key in VLLMServeSettings.options() if key != "model_path"
              and getattr(serve, key) not in (None, [], {})
              and getattr(serve, key) != getattr(defaults, key)]
    if url and served:
        problems.append(f"{section}: {', '.join(served)} only apply when nexrl starts the server (`model_path`); "
                        "with `url` set, configure the running server itself")
    if not serve.model_path or url:
        return None, problems

    command, ours = ["vllm", "serve"], False
    if serve.command is not None:
        try:
            command = parse_command(serve.command, f"{section}.command")
        except ValueError as exc:
            problems.append(str(exc))
    elif vllm_version() is not None:  # the vLLM next to nexrl, whichever distribution brought it
        command, ours = [sys.executable, "-m", "nexrl_vllm.vllm_cli", "serve"], True
    elif shutil.which("vllm") is None:
        problems.append(f"{section}: {INSTALL_HINT}")
    path = serve.model_path
    if path == EMBEDDED_MODEL:
        if importlib.util.find_spec("nexrl_torch") is None:
            problems.append(f"{section}.model_path: '{path}' is nexrl's embedded model, converted by nexrl-torch: "
                            "pip install nexrl-torch, or give a model folder or Hub id")
    elif (os.path.isabs(path) or path.startswith(".")) and not os.path.isdir(path):
        problems.append(f"{section}.model_path: '{path}' is not a folder")
    opts = ServeOptions(
        model_path=path, command=command, host=serve.host, port=serve.port,
        served_model_name=_value(config, "model"), tensor_parallel_size=serve.tensor_parallel_size,
        gpu_memory_utilization=serve.gpu_memory_utilization, dtype=serve.dtype,
        max_lora_rank=serve.max_lora_rank if serve.enable_lora else None,
        worker_extension=ours,  # the vLLM next to nexrl can import nexrl_vllm's worker extension
        max_model_len=serve.max_model_len, logprobs_mode=serve.logprobs_mode, weight_transfer=serve.weight_transfer,
        # Development routes (pause, reload, weight transfer) change the served weights: only on loopback
        # unless the recipe asks for them.
        dev_endpoints=is_loopback(serve.host) if serve.dev_endpoints is None else serve.dev_endpoints,
        extra_args=[str(a) for a in serve.extra_args], env={k: str(v) for k, v in serve.env.items()},
        api_key=_value(config, "api_key"), startup_timeout=serve.startup_timeout,
        shutdown_grace=serve.shutdown_grace,
        log_file=serve.log_file or os.path.join(run_dir or ".", "vllm_server.log"))
    return opts, problems


class VLLMClient(OpenAICompatibleClient):
    # Loads new weights through vLLM's weight-update routes (only a vLLM weight sync drives them);
    # a request cut by one goes on from its tokens (weight.partial_rollout).
    CAPABILITIES = Capabilities(provides=frozenset({"inference:vllm", "inference:in_flight_weights"}))
    """The ``vllm`` inference backend. See the module docstring."""

    SETTINGS = VLLMServeSettings  # next to the OpenAI client's (url, api_key, model, timeout, retries)
    # Compatibility declaration: the weight transports this service can receive (weight-sync
    # backends declare WEIGHT_TRANSPORT; `vllm_disk` and `vllm_nccl` say "vllm").
    ACCEPTS_WEIGHT_TRANSPORTS = ("vllm",)

    @classmethod
    def check_config(cls, section: Mapping[str, Any], key: str) -> list[str]:
        problems = parse_serve_options(section, key)[1]
        cfg = _section(section, key)
        client = {name: OpenAICompatibleClient.SETTINGS.options()[name] for name in _CLIENT_KEYS}
        return problems + check_options({name: _value(cfg, name) for name in _CLIENT_KEYS}, client, key)

    @classmethod
    def check_recipe(cls, recipe: Any) -> list[str]:
        """Sampling whose log-probs vLLM does not report as the trainer scores them (nexrl's convention:
        the full vocabulary at the sampling temperature). Measured with vLLM 0.32 against the
        transformers forward (within 2e-5): ``processed_logprobs`` gives the distribution sampled
        from, after temperature *and* after top_k/top_p cut it and renormalised; ``raw_logprobs``
        gives the full vocabulary at temperature 1. A server nexrl attaches to by ``url`` is taken to
        run with ``processed_logprobs``, as a managed one does."""
        sampling = _get(recipe, "rollout_worker", "sampling")
        try:
            params = SamplingParams.from_config(sampling if isinstance(sampling, Mapping) else None)
        except ConfigError:
            return []  # the key checks report these
        temperature, top_p, top_k = params.temperature, params.top_p, params.top_k
        service = _get(recipe, "service", "inference_service")
        serve = VLLMServeSettings.parse(service if isinstance(service, Mapping) else None, "service.inference_service",
                                        own=True)[0]
        if serve is None:
            return []  # the key checks report these
        mode = serve.logprobs_mode
        if mode == "raw_logprobs" and temperature not in (0, 1):
            return [f"rollout_worker.sampling.temperature: {temperature} with service.inference_service.logprobs_mode "
                    f"raw_logprobs: vLLM then reports log-probs at temperature 1, not at the temperature the "
                    f"trainer scores; use logprobs_mode processed_logprobs (the default)"]
        if mode != "raw_logprobs" and temperature != 0 and (top_p < 1 or top_k > 0):
            which, value = ("top_p", top_p) if top_p < 1 else ("top_k", top_k)
            return [f"rollout_worker.sampling.{which}: {value}: vLLM's processed log-probs are those of "
                    f"the distribution that {which} cut and renormalised, while the trainer and the rollout correction "
                    f"score the full vocabulary at the temperature; with vLLM sample with temperature alone "
                    f"(top_p 1, top_k 0), or at temperature 1 with service.inference_service.logprobs_mode "
                    f"raw_logprobs"]
        return []

    def __init__(self, config: Mapping[str, Any] | None):
        opts, problems = parse_serve_options(config)
        problems += [p for p in self.check_config(config or {}, "service.inference_service") if p not in problems]
        if problems:
            raise ConfigError("; ".join(problems))
        config = _section(config, "service.inference_service")
        self.server: ManagedVLLMServer | None = None
        if opts is not None:
            if opts.model_path == EMBEDDED_MODEL:
                from nexrl_torch.models import resolve_model_path

                opts.model_path = resolve_model_path(EMBEDDED_MODEL)
                opts.served_model_name = opts.served_model_name or EMBEDDED_MODEL
            self.server = ManagedVLLMServer(opts).start()
            root = self.server.url
        else:
            root = str(_value(config, "url")).rstrip("/")
            root = root[: -len("/v1")] if root.endswith("/v1") else root
        self.root_url = root
        client_config = {k: _value(config, k) for k in _CLIENT_KEYS if _value(config, k) is not None}
        client_config.update(url=f"{root}/v1", model_tag=_value(config, "model_tag"),
                             request_logprobs=True, return_token_ids=True)
        try:
            super().__init__(client_config)
            self.control = VLLMControl(root, api_key=_value(config, "api_key"))
        except BaseException:
            if self.server is not None:
                self.server.stop()
            raise
        self._gate = threading.Condition()
        self._updating = False
        self._in_flight: set[int] = set()
        self._attempts: dict[int, Any] = {}
        self._broken: str | None = None
        self._continue_cut = False  # weight.partial_rollout: a reply the pause aborted goes on from its tokens
        self._cut_version = 0  # the version served when the last update paused generation
        # vLLM 0.32 on the CPU crashes scoring several prompts in one call when LoRA is on: one per call then.
        # True for a server started with LoRA, and once vllm_lora pushed an adapter to an attached one.
        self.lora_enabled = bool(opts and opts.max_lora_rank)
        self._closed = False
        self._death_reported = False

    def __repr__(self) -> str:
        managed = f", pid={self.server.pid}" if self.server else ""
        return f"VLLMClient(url={self.root_url!r}, model={self.model!r}{managed})"

    # ------------------------------------------------------------------ generation
    def complete(self, prompt: str | list[dict[str, Any]], params: SamplingParams) -> CompletionResult:
        with self._gate:
            self._raise_if_unusable()
        result = self._with_token_data(super().complete(prompt, params))
        return self._continued(result, params, None) if result.finish_reason == CUT else result

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams,
             tools: list[dict[str, Any]] | None = None) -> CompletionResult:
        with self._gate:
            self._raise_if_unusable()
        result = self._with_token_data(super().chat(messages, params, tools))
        return self._continued(result, params, tools) if result.finish_reason == CUT else result

    def _parse(self, chat: bool, body: dict[str, Any], endpoint: str, with_tools: bool = False) -> CompletionResult:
        """The core client's reading of an answer, except for a reply the pause of a partial-rollout
        update aborted after some tokens: it is kept (finish_reason :data:`CUT`, its tokens labelled
        with the version they were sampled under) instead of being retried from scratch."""
        choices = body.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not (self._continue_cut and isinstance(choice, dict) and choice.get("finish_reason") == "abort"
                and choice.get("token_ids")):
            return super()._parse(chat, body, endpoint, with_tools)  # an abort before any token: retried whole
        cut = super()._parse(chat, {**body, "choices": [{**choice, "finish_reason": "length"}]}, endpoint, with_tools)
        cut.finish_reason = CUT
        # Sampled before the pause, by the weights then served (whatever label the attempt got since).
        cut.token_versions = [self._cut_version] * len(cut.response_token_ids or [])
        return cut

    def _continued(self, cut: CompletionResult, params: SamplingParams,
                   tools: list[dict[str, Any]] | None) -> CompletionResult:
        """``cut`` (a reply an update's pause aborted) generated to its end: after the update, the
        prompt's and the kept tokens' ids are completed for the tokens left (through
        ``/v1/completions``, chat replies too: their prompt ids are the rendered chat), again after
        each later update that cuts it. A chat reply offered ``tools`` has its text decoded from its
        token ids by the server (a tool parser takes the calls out of an answer's text) and its
        calls read from that text."""
        prompt_ids = list(cut.prompt_token_ids or [])
        ids, logprobs = list(cut.response_token_ids or []), list(cut.response_logprobs or [])
        versions = list(cut.token_versions or [])
        text = self._detokenize(ids) if tools else cut.text
        finish = CUT
        while finish == CUT:
            left = params.max_tokens - len(ids)
            if left <= 0:
                finish = "length"
                break
            part = self._with_token_data(self._with_retries(
                "POST /completions (a reply continued after a weight update)",
                functools.partial(self._continue_once, prompt_ids + ids, params, left, len(ids))))
            new_ids = part.response_token_ids or []
            versions += part.token_versions if part.finish_reason == CUT and part.token_versions \
                else [part.model_version] * len(new_ids)
            ids += new_ids
            logprobs += part.response_logprobs or []
            text += part.text
            finish = part.finish_reason
        result = CompletionResult(text=text, finish_reason=finish, prompt_token_ids=prompt_ids, response_token_ids=ids,
                                  response_logprobs=logprobs, model_version=versions[0],
                                  token_versions=versions if len(set(versions)) > 1 else None)
        if tools:
            result.tool_calls = parse_tool_calls(text)[1] or None
        return result

    def _continue_once(self, ids: list[int], params: SamplingParams, left: int, kept: int,
                       timeout: float) -> CompletionResult:
        # Another seed than the first part's: the same one would replay its random draws.
        seed = None if params.seed is None else zlib.crc32(f"{params.seed}|continued after {kept}".encode())
        with self.generation_attempt() as served:  # waits for the update to end
            raw = self._post(False, self._served_model(), ids, replace(params, max_tokens=left, seed=seed), timeout)
        part = self._parse(False, self._decode(raw, "/completions"), "/completions")
        part.model_version = served.model_version
        return part

    def _detokenize(self, ids: list[int]) -> str:
        answer = self.control.call("detokenize", "POST", "/detokenize",
                                   body={"model": self._served_model(), "tokens": ids})
        text = answer.get("prompt") if isinstance(answer, dict) else None
        if not isinstance(text, str):
            raise self._malformed("/detokenize", f"expected {{\"prompt\": text}}, got {answer!r}")
        return text

    def _with_token_data(self, result: CompletionResult) -> CompletionResult:
        missing = [name for name, value in (("prompt token ids", result.prompt_token_ids),
                                            ("response token ids", result.response_token_ids),
                                            ("log-probs", result.response_logprobs)) if value is None]
        if missing:
            raise InferenceError(
                f"vLLM server {self.root_url} answered without {', '.join(missing)}: training needs vLLM's "
                "`return_token_ids` and `logprobs` (a vLLM release with return_token_ids; is `url` a vLLM server?)")
        return result

    def score(self, requests: list[tuple[list[int], list[int], float]]) -> list[list[float]]:
        """Log-probs of given tokens through vLLM's ``prompt_logprobs``: all requests in one call, or
        one call each while LoRA is on (:attr:`lora_enabled`).

        vLLM takes prompt log-probs from the raw logits whatever the request's temperature
        (measured: at T = 0.7 they equal the trainer's T = 1 log-probs within 1e-6 and miss its
        T = 0.7 ones by 0.37), so only temperature 1 is answered; other temperatures raise
        NotImplementedError, which the served-version probe and ``nexrl validate`` read as
        "cannot score"."""
        if not requests:
            return []
        for _, response_ids, temperature in requests:
            if abs(float(temperature) - 1.0) > 1e-9:
                raise NotImplementedError(f"vLLM's prompt_logprobs are taken at temperature 1, not {temperature:g}")
            if not response_ids:
                raise ValueError("score: a request has no response tokens")
        with self._gate:
            self._raise_if_unusable()

        def attempt(rows: list[tuple[list[int], list[int], float]], timeout: float) -> list[list[float]]:
            with self.generation_attempt():  # named inside the gate: the adapter an update just served
                raw = self._client.completions.with_raw_response.create(
                    model=self._served_model(), prompt=[list(p) + list(r) for p, r, _ in rows], max_tokens=1, temperature=1.0,
                    timeout=timeout, extra_body={"prompt_logprobs": 0})
            choices = self._decode(raw, "/completions").get("choices")
            if not isinstance(choices, list) or len(choices) != len(rows):
                raise self._malformed("/completions", f"{len(rows)} choices were expected for prompt_logprobs")
            by_index = {int(c.get("index", i)): c for i, c in enumerate(choices) if isinstance(c, dict)}
            return [self._given_token_logprobs(by_index.get(i), prompt_ids, response_ids)
                    for i, (prompt_ids, response_ids, _) in enumerate(rows)]

        calls = [[row] for row in requests] if self.lora_enabled else [list(requests)]
        scored: list[list[float]] = []
        for rows in calls:
            scored += self._with_retries("POST /completions (prompt_logprobs)",
                                         functools.partial(attempt, rows))
        return scored

    def _given_token_logprobs(self, choice: Any, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        entries = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
        if not isinstance(entries, list) or len(entries) != len(prompt_ids) + len(response_ids):
            raise self._malformed("/completions", "choices[].prompt_logprobs is missing or of the wrong length")
        out = []
        for entry, token in zip(entries[len(prompt_ids):], response_ids):
            found = entry.get(str(token)) if isinstance(entry, dict) else None
            value = found.get("logprob") if isinstance(found, dict) else None
            if not isinstance(value, (int, float)):
                raise self._malformed("/completions", f"prompt_logprobs has no log-prob for token {token}")
            out.append(float(value))
        return out

    @contextlib.contextmanager
    def generation_attempt(self) -> Iterator[Any]:
        """Hold the request while a weight update is in progress; track it while it is in flight."""
        attempt = types.SimpleNamespace(model_version=0)
        with self._gate:
            self._gate.wait_for(lambda: not self._updating or self._closed)
            self._raise_if_unusable()
            attempt.model_version = self.model_version()
            self._in_flight.add(id(attempt))
            self._attempts[id(attempt)] = attempt
        try:
            yield attempt
        finally:
            with self._gate:
                self._in_flight.discard(id(attempt))
                self._attempts.pop(id(attempt), None)
                self._gate.notify_all()

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise InferenceError(f"vLLM client {self.root_url} is closed")
        if self._broken:
            raise InferenceError(f"vLLM server {self.root_url} is not serving: {self._broken}")

    # ------------------------------------------------------------------ weight updates
    @contextlib.contextmanager
    def weight_update(self, version: int, pause_mode: str = "abort", settle_timeout: float = 60.0,
                      partial_rollout: bool = False) -> Iterator[VLLMControl]:
        """Bracket a weight update: yields the control plane with generation held and paused.

        On success the prefix cache is reset, ``version`` becomes the served version and generation
        resumes. On failure the client refuses further requests (the server's weights are in an
        unknown state) and the error, which names the phase, propagates. ``partial_rollout`` (with
        ``pause_mode`` abort): the requests the pause aborts go on from their tokens after the update.
        """
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode: '{pause_mode}' is not one of {', '.join(PAUSE_MODES)}")
        if partial_rollout and pause_mode != "abort":
            raise ValueError(f"partial_rollout: needs pause_mode abort (the cut requests' tokens come back in "
                             f"vLLM's aborted answers), got '{pause_mode}'")
        with self._gate:
            self._raise_if_unusable()
            self._updating = True
            self._continue_cut = partial_rollout
            self._cut_version = self.model_version()
        try:
            try:
                self.control.pause(pause_mode)
                held = self._settle(min(DRAIN_GRACE_S, settle_timeout)) if pause_mode != "keep" else []
                yield self.control
                self.control.reset_prefix_cache()
                self.set_model_version(version)
                if pause_mode != "keep":
                    # Still in flight after the pause: the server holds them and generates them after
                    # the resume, with the new weights. (Kept requests mix versions: they keep the old.)
                    for attempt in held:
                        attempt.model_version = version
                self.control.resume()
            except BaseException as exc:
                with self._gate:
                    self._broken = f"the weight sync to version {version} failed ({exc})"
                raise
        finally:
            with self._gate:
                self._updating = False
                self._gate.notify_all()

    def _settle(self, grace: float) -> list[Any]:
        """After the pause: let answers already on their way arrive (aborted or finished requests);
        the requests still in flight are those the server holds until the resume."""
        with self._gate:
            self._gate.wait_for(lambda: not self._in_flight, grace)
            return [self._attempts[key] for key in self._in_flight if key in self._attempts]

    # ------------------------------------------------------------------ health, shutdown
    def server_exit(self, wait: float = 0.0) -> str | None:
        """"the vLLM server (pid N) exited with code C" when the server nexrl started is gone (given up
        to ``wait`` seconds to finish dying: a request may fail while it is being killed), else None."""
        server = self.server
        if server is None or server.proc is None:
            return None
        if wait and server.alive():
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(wait)
        if server.alive():
            return None
        return f"the vLLM server (pid {server.pid}) exited with code {server.proc.returncode}"

    def health_check(self) -> bool:
        gone = self.server_exit()
        if gone:
            if not self._death_reported and self.server is not None:
                self._death_reported = True
                log_file = self.server.opts.log_file
                logger.error(f"{gone}; last lines of {log_file}:\n{log_tail(log_file)}")
            return False
        try:
            return self.control.call("health", "GET", "/health", timeout=5.0) is not NotImplemented
        except SyncPhaseError:
            return False

    def close(self) -> None:
        with self._gate:
            self._closed = True
            self._gate.notify_all()
        try:
            super().close()
            self.control.close()
        finally:
            if self.server is not None:
                self.server.stop()


def require_vllm_client(inference_client: Any, backend: str) -> VLLMClient:
    if not isinstance(inference_client, VLLMClient):
        raise ConfigError(f"weight.backend: '{backend}' pushes weights into a vLLM server; it needs "
                          f"service.inference_service.backend: vllm (got {type(inference_client).__name__})")
    return inference_client
