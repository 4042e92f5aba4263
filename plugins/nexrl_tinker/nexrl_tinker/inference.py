"""The ``tinker`` inference backend: rollouts sample through a Tinker sampling client.

Recipe keys (``service.inference_service``, :data:`INFERENCE_OPTIONS`):

- ``tokenizer_path`` (or ``model_path`` when it is a local folder): the model's tokenizer, read
  from disk (nothing is downloaded); prompts are tokenized here, chat prompts through the
  tokenizer's chat template (``chat_template: false`` joins the message contents instead);
- ``base_model``: the Tinker model name, sampled from until the first weight sync (with the
  ``tinker`` weight-sync backend the trainer's sampler takes over at once); or ``model_path``:
  a ``tinker://`` sampler checkpoint to sample from;
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
from typing import Any

from nexrl_core import CompletionResult, ConfigError, InferenceClient, InferenceError, Option, SamplingParams

from .remote import CONNECTION_OPTIONS, RemoteCalls, TinkerRequestError, plain_section, resolve_connection

INFERENCE_OPTIONS = {
    "base_model": Option(None, help="the Tinker model name, sampled from until the first weight sync"),
    "model_path": Option(None, help="a tinker:// sampler checkpoint to sample from, or a local folder holding the "
                                    "tokenizer"),
    "tokenizer_path": Option(None, help="local folder of the model's tokenizer (nothing is downloaded)"),
    "chat_template": Option(True, help="format chat prompts with the tokenizer's chat template (false: join the "
                                       "message contents)"),
    **CONNECTION_OPTIONS,
}


def _config_errors(check: Any) -> list[ConfigError]:
    try:
        check()
    except ConfigError as exc:
        return [exc]
    return []


class TinkerInferenceClient(InferenceClient):
    OPTIONS = INFERENCE_OPTIONS

    def __init__(self, config: Any, section: str = "service.inference_service"):
        super().__init__(config)
        cfg = plain_section(config, section)
        self.connection = resolve_connection(cfg, section)
        model_path = cfg.get("model_path")
        self.remote_path = str(model_path) if model_path and str(model_path).startswith("tinker://") else None
        self.base_model = cfg.get("base_model")
        tokenizer_path = cfg.get("tokenizer_path") or (model_path if not self.remote_path else None)
        if not tokenizer_path:
            raise ConfigError(f"{section}.tokenizer_path: required (a local folder holding the model's tokenizer)")
        if not os.path.isdir(str(tokenizer_path)):
            raise ConfigError(f"{section}.tokenizer_path: '{tokenizer_path}' is not a folder")
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{section}.tokenizer_path: no tokenizer in '{tokenizer_path}' ({exc})") from None
        self.use_chat_template = bool(cfg.get("chat_template", True))
        self._calls = RemoteCalls(self.connection)
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # fast tokenizers are not safe under concurrent use
        self._sampler: Any = None
        self._own_service: Any = None

    @classmethod
    def check_config(cls, section: Any, path: str = "service.inference_service") -> list[str]:
        """The problems the constructor would raise, found without contacting the service or loading
        the tokenizer (for ``nexrl validate``)."""
        try:
            cfg = plain_section(section, path)
        except ConfigError as exc:
            return [str(exc)]
        problems = [str(exc) for exc in _config_errors(lambda: resolve_connection(cfg, path))]
        model_path = cfg.get("model_path")
        remote = bool(model_path) and str(model_path).startswith("tinker://")
        tokenizer_path = cfg.get("tokenizer_path") or (None if remote else model_path)
        if not tokenizer_path:
            problems.append(f"{path}.tokenizer_path: required (a local folder holding the model's tokenizer)")
        elif not os.path.isdir(str(tokenizer_path)):
            problems.append(f"{path}.tokenizer_path: '{tokenizer_path}' is not a folder")
        return problems

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
            if isinstance(prompt, str):
                return list(self.tokenizer(prompt).input_ids)
            if self.use_chat_template:
                text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            else:
                text = "\n".join(str(m.get("content", "")) for m in prompt)
            # The template already holds every special token it wants.
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)

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

    def close(self) -> None:
        with self._lock:
            service, self._own_service, self._sampler = self._own_service, None, None
        if service is not None:
            try:
                self._calls.call("close session", lambda: service.close("success"), repeatable=False)
            except TinkerRequestError:
                pass
