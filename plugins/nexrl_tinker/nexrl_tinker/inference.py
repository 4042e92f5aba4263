"""The ``tinker`` inference backend: rollouts sample through a Tinker sampling client.

Recipe keys (``service.inference_service``, :class:`TinkerInferenceSettings` and the connection's):

- ``tokenizer_path`` (or ``model_path`` when it is a local folder): the model's tokenizer, read
  from disk (nothing is downloaded); prompts are tokenized here, chat prompts through the
  tokenizer's chat template (``chat_template: false`` joins the message contents instead);
- ``base_model``: the Tinker model name, sampled from until the first weight sync (with the
  ``tinker`` weight-sync backend the trainer's sampler takes over at once); or ``model_path``:
  a ``tinker://`` sampler checkpoint to sample from, or a nexrl ``global_step_<N>`` checkpoint of
  a Tinker run (the sampler snapshot it recorded: ``nexrl eval RECIPE checkpoint=...``);
- ``api_key`` / ``base_url`` / ``request_timeout`` / ``max_retries`` / ``retry_backoff``: see
  :mod:`nexrl_tinker.remote`.

Each completion returns the prompt token ids, the sampled token ids and their logprobs, and the
weight version of the sampler that produced them. Tokens are returned as sampled (a stop string's
tokens included, so training sees exactly what was sampled); ``text`` is their decoding, cut right
before the earliest stop string. ``finish_reason`` is ``stop`` for an EOS token or a stop string,
``length`` for ``max_tokens``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nexrl_core import (
    Capabilities,
    CompletionResult,
    ConfigError,
    DataError,
    InferenceClient,
    InferenceError,
    SamplingParams,
    Settings,
    setting,
)

from .remote import (
    CONNECTION_OPTIONS,
    RemoteCalls,
    TinkerConnectionSettings,
    TinkerRequestError,
    plain_section,
    resolve_connection,
)
from .tokens import encode_prompt, load_tokenizer

# What the tinker weight sync hands over and the tinker inference backend samples from.
SAMPLER_CAPABILITY = "inference:tinker_sampler"


@dataclass(frozen=True, kw_only=True)
class TinkerInferenceSettings(Settings):
    """What the ``tinker`` backend samples and how it tokenizes (the connection's keys are
    :class:`~nexrl_tinker.remote.TinkerConnectionSettings`)."""

    base_model: str | None = setting(None, "Tinker model sampled until the first weight sync (the tinker weight "
                                           "sync hands over the trainer's sampler at the start)")
    model_path: str | None = setting(None, "what to sample: a tinker:// sampler path, a nexrl checkpoint of a "
                                           "Tinker run (nexrl eval checkpoint=...), or a local model folder (its "
                                           "tokenizer)")
    tokenizer_path: str | None = setting(None, "local folder holding the model's tokenizer (prompts are tokenized "
                                               "here)")
    chat_template: bool = setting(True, "render chat prompts with the tokenizer's chat template (false: join the "
                                        "message contents)")


def _config_errors(check: Callable[[], object]) -> list[ConfigError]:
    try:
        check()
    except ConfigError as exc:
        return [exc]
    return []


def _model_paths(settings: TinkerInferenceSettings, section: str) -> tuple[str | None, str | None]:
    """(the ``tinker://`` path to sample from, or None; the local tokenizer folder) of the section:
    ``model_path`` may be a ``tinker://`` sampler path, a nexrl checkpoint of a Tinker run (its
    recorded sampler snapshot, what ``nexrl eval checkpoint=...`` passes) or a local model folder
    (its tokenizer)."""
    from .service import STATE_FILE, checkpoint_sampler_path

    model_path, tokenizer_path = settings.model_path, settings.tokenizer_path
    if model_path and model_path.startswith("tinker://"):
        return model_path, tokenizer_path
    if model_path and os.path.isfile(os.path.join(model_path, STATE_FILE)):
        try:
            return checkpoint_sampler_path(model_path), tokenizer_path
        except DataError as exc:
            raise ConfigError(f"{section}.model_path: {exc}") from None
    return None, tokenizer_path or model_path


def _tokenizer_problem(tokenizer_path: str | None, section: str) -> str | None:
    if not tokenizer_path:
        return f"{section}.tokenizer_path: required (a local folder holding the model's tokenizer)"
    if not os.path.isdir(str(tokenizer_path)):
        return f"{section}.tokenizer_path: '{tokenizer_path}' is not a folder"
    return None


class TinkerInferenceClient(InferenceClient):
    """Rollouts through a Tinker sampling client: prompt tokens, response tokens and their log-probs,
    and the weight version; the tinker weight sync hands it the trainer's sampler after every step."""

    SETTINGS = TinkerInferenceSettings
    OPTIONS = CONNECTION_OPTIONS
    CAPABILITIES = Capabilities(provides={SAMPLER_CAPABILITY})

    @classmethod
    def network_use(cls, recipe: dict[str, Any]) -> str | None:
        """ray.private_network: sampling goes through the Tinker service (base_url, else the hosted one)."""
        return "samples through the Tinker service"

    def __init__(self, config: Mapping[str, Any], section: str = "service.inference_service"):
        super().__init__(config)
        cfg = plain_section(self.config, section)  # bound: declared defaults filled
        self.settings = TinkerInferenceSettings.own(cfg, section)
        self.connection = resolve_connection(TinkerConnectionSettings.own(cfg, section), section)
        self.remote_path, tokenizer_path = _model_paths(self.settings, section)
        self.base_model = self.settings.base_model
        problem = _tokenizer_problem(tokenizer_path, section)
        if problem:
            raise ConfigError(problem)
        self.tokenizer = load_tokenizer(str(tokenizer_path), f"{section}.tokenizer_path")
        self.use_chat_template = self.settings.chat_template
        self._calls = RemoteCalls(self.connection)
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # fast tokenizers are not safe under concurrent use
        self._sampler: Any = None
        self._own_service: Any = None

    @classmethod
    def check_config(cls, section: Mapping[str, Any], path: str = "service.inference_service") -> list[str]:
        """The problems the constructor would raise, found without contacting the service or loading
        the tokenizer (for ``nexrl validate``)."""
        try:
            cfg = plain_section(section, path)
            settings = TinkerInferenceSettings.own(cfg, path)
        except ConfigError as exc:
            return [str(exc)]
        problems = [str(exc) for exc in _config_errors(lambda: resolve_connection(cfg, path))]
        try:
            _, tokenizer_path = _model_paths(settings, path)
        except ConfigError as exc:
            return problems + [str(exc)]
        problem = _tokenizer_problem(tokenizer_path, path)
        return problems + ([problem] if problem else [])

    # ------------------------------------------------------------------ weights

    def set_sampling_client(self, sampling_client: Any, version: int) -> None:
        """Sample from ``sampling_client`` (the trainer's current weights) as weight ``version``."""
        with self._lock:
            self._sampler = sampling_client
            self.set_model_version(version)

    def _current(self) -> tuple[Any, int]:
        with self._lock:
            if self._sampler is not None:
                return self._sampler, self.model_version()
        if not (self.base_model or self.remote_path):
            raise InferenceError("the tinker inference backend has no sampler yet: set service.inference_service."
                                 "base_model (or a tinker:// model_path), or use the tinker weight-sync backend")
        with self._lock:
            if self._sampler is None:
                if self._own_service is None:
                    self._own_service = self.connection.service_client()
                service = self._own_service
                what = self.remote_path or self.base_model
                self._sampler = self._calls.call(
                    f"create_sampling_client ({what})",
                    lambda: service.create_sampling_client(model_path=self.remote_path,
                                                           base_model=None if self.remote_path else self.base_model),
                    repeatable=True)
            return self._sampler, self.model_version()

    # ------------------------------------------------------------------ sampling

    def encode_prompt(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        with self._tokenizer_lock:
            return encode_prompt(self.tokenizer, prompt, self.use_chat_template)

    def complete(self, prompt: str | list[dict[str, Any]], params: SamplingParams) -> CompletionResult:
        from tinker import types  # imported on use: `nexrl plugins` / `validate` stay light

        prompt_ids = self.encode_prompt(prompt)
        sampler, version = self._current()
        top_k = getattr(params, "top_k", None)
        sampling = types.SamplingParams(max_tokens=int(params.max_tokens), temperature=float(params.temperature),
                                        top_p=float(params.top_p), top_k=int(top_k) if top_k else -1,
                                        stop=list(params.stop) or None, seed=params.seed)
        request = f"sample ({len(prompt_ids)} prompt tokens, max_tokens {params.max_tokens}, weights v{version})"
        try:
            response = self._calls.call(
                request, lambda: sampler.sample(types.ModelInput.from_ints(prompt_ids), 1, sampling),
                repeatable=True)
        except TinkerRequestError as exc:
            raise InferenceError(str(exc)) from exc.__cause__
        sequence = response.sequences[0]
        tokens = [int(t) for t in sequence.tokens]
        logprobs = [float(x) for x in (sequence.logprobs or [])]
        if logprobs and len(logprobs) != len(tokens):
            raise InferenceError(f"Tinker {request}: {len(tokens)} tokens but {len(logprobs)} logprobs")
        with self._tokenizer_lock:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in params.stop if s) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
        return CompletionResult(text=text, finish_reason="stop" if sequence.stop_reason == "stop" else "length",
                                prompt_token_ids=prompt_ids, response_token_ids=tokens,
                                response_logprobs=logprobs or None, model_version=version)

    def score(self, requests: list[tuple[list[int], list[int], float]]) -> list[list[float]]:
        """The log-prob of each response token given the prompt and the tokens before it: the
        sampling client's ``compute_logprobs`` (a teacher's scores of the student's tokens, for
        ``remote_api_opd``), the requests sent concurrently. Temperature 1 only (or 0, whose
        log-probs are those at 1): the service scores at no other."""
        from concurrent.futures import ThreadPoolExecutor

        from tinker import types

        with self._lock:
            handed = self._sampler is not None
        if not (handed or self.base_model or self.remote_path):  # what the served-weights probe asks first
            raise NotImplementedError("the tinker backend has nothing to score with before the tinker weight sync "
                                      "hands it the trainer's sampler (nor a base_model)")
        sampler, version = self._current()

        def one(request: tuple[list[int], list[int], float]) -> list[float]:
            prompt, response, temperature = request
            if SamplingParams(temperature=float(temperature)).logprob_temperature != 1.0:
                raise InferenceError(f"the tinker backend scores tokens at temperature 1 only, not {temperature}")
            if not response:
                return []
            if not prompt:
                raise InferenceError("the tinker backend scores a response after a prompt of at least one token")
            ids = [int(t) for t in (*prompt, *response)]
            what = f"compute_logprobs ({len(prompt)} prompt + {len(response)} response tokens, weights v{version})"
            try:
                values = self._calls.call(what, lambda: sampler.compute_logprobs(
                    types.ModelInput.from_ints(ids), prompt_logprobs_last_n=len(response)), repeatable=True)
            except TinkerRequestError as exc:
                raise InferenceError(str(exc)) from exc.__cause__
            scored = list(values or [])[-len(response):]
            if len(scored) != len(response) or any(v is None for v in scored):
                raise InferenceError(f"Tinker {what}: no log-prob for some of the {len(response)} response tokens")
            return [float(v) for v in scored]

        if len(requests) <= 1:
            return [one(r) for r in requests]
        with ThreadPoolExecutor(max_workers=min(len(requests), 16), thread_name_prefix="tinker-score") as pool:
            return list(pool.map(one, requests))

    def health_check(self) -> bool:
        """The service answers ``get_server_capabilities`` (as the openai backend's ``GET /models``); a
        failure raises, naming the service and why, which the run's health check reports."""
        self._calls.call("health check (get_server_capabilities)", self.connection.server_capabilities,
                         repeatable=False)
        return True

    def close(self) -> None:
        with self._lock:
            service, self._own_service, self._sampler = self._own_service, None, None
        if service is not None:
            try:
                self._calls.call("close session", lambda: service.close("success"), repeatable=False)
            except TinkerRequestError:
                pass
