"""Inference over any OpenAI-compatible HTTP server (vLLM, SGLang, OpenAI, ...).

`OpenAICompatibleClient` sends a text prompt to ``POST {url}/completions`` and chat
messages to ``POST {url}/chat/completions`` with the `openai` package's synchronous
client, and asks for what RL training needs besides the text, the way vLLM's
OpenAI-compatible server accepts it:

- ``logprobs``: ``1`` on completions (answer in ``choices[0].logprobs.token_logprobs``),
  ``true`` on chat (answer in ``choices[0].logprobs.content[j].logprob``);
- ``return_token_ids: true`` (sent through ``extra_body``): the response token ids come
  back in ``choices[0].token_ids``, the prompt token ids in
  ``choices[0].prompt_token_ids`` (completions) or the top-level ``prompt_token_ids``
  (chat).

``chat(messages, params, tools)`` sends ``tools`` (OpenAI's function schemas) and reads
``choices[0].message.tool_calls`` (vLLM fills it when started with a tool parser, e.g.
``--enable-auto-tool-choice --tool-call-parser hermes``; without one the calls stay in the text and
are read from it with :func:`nexrl_core.parse_tool_calls`). Without tools it is :meth:`complete`.

A server without those extensions (plain OpenAI) simply leaves them out, and the
result carries ``None`` for them. A server that rejects ``return_token_ids`` with a 400
(api.openai.com does) is asked again without it, and this client stops sending it.

Config (the recipe's ``service.inference_service`` mapping):

=====================  =========  ======================================================
key                    default    meaning
=====================  =========  ======================================================
``url``                required   base URL, e.g. ``http://127.0.0.1:8000/v1``
``api_key``            "EMPTY"    bearer token; falls back to env ``OPENAI_API_KEY``
``model``              discovered served model name; the first of ``GET {url}/models``
                                  when unset
``model_tag``          "default"  name of this service inside nexrl
``timeout``            60         seconds per HTTP request
``max_retries``        3          retries after the first attempt
``retry_backoff``      0.5        first retry delay in seconds, doubled on each retry
``max_retry_time``     120        bound in seconds on the time spent retrying: no retry
                                  starts past it and a retry's timeout is cut to it
``request_logprobs``   true       ask for logprobs (``response_logprobs``)
``return_token_ids``   true       send vLLM's ``return_token_ids``
=====================  =========  ======================================================

Sampling: ``max_tokens``, ``temperature``, ``top_p``, ``stop`` and ``seed`` are standard
request fields; ``top_k`` (when > 0) is sent as vLLM's extra body field ``top_k`` — a server
that does not know it answers 400 and the request fails (it is never silently dropped).

Retries: connection errors, timeouts, HTTP 408, 429 and 5xx, and vLLM's
``finish_reason: "abort"`` are retried with exponential backoff (a ``Retry-After``
header lengthens the wait); any other 4xx fails at once. The `openai` package's own
retries are switched off so the two never multiply. A malformed answer (no choices,
token ids and logprobs of different lengths, a body that is not JSON) raises
`InferenceError` at once, naming the server URL and what was wrong.

One client is shared by all rollout-worker threads: the underlying HTTP connection
pool is thread-safe and the client keeps no per-request state.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from loguru import logger

from ..config.settings import Settings, setting
from ..markers import hookimpl
from ..runtime.inference import CompletionResult, InferenceClient, InferenceError, SamplingParams
from ..tool_calls import parse_tool_calls

if TYPE_CHECKING:
    import openai

__all__ = ["OpenAICompatibleClient"]

T = TypeVar("T")

_HEALTH_TIMEOUT = 5.0
_RETRYABLE_STATUS = frozenset({408, 429})


class _Transient(Exception):
    """An attempt failed in a way worth retrying (internal)."""

    def __init__(self, what: str, retry_after: float | None = None):
        super().__init__(what)
        self.what = what
        self.retry_after = retry_after


@dataclass(frozen=True, kw_only=True)
class OpenAIClientSettings(Settings):
    """The recipe keys of ``service.inference_service`` for the OpenAI client (the table above)."""

    url: str | None = setting(None, "the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    base_url: str | None = setting(None, "another name for url")
    api_key: str | None = setting(None, "bearer token (default: env OPENAI_API_KEY)", secret=True)
    model: str | None = setting(None, "served model name (default: the first of GET {url}/models)")
    timeout: float = setting(60.0, "seconds per HTTP request", gt=0)
    max_retries: int = setting(3, "retries after the first attempt", ge=0)
    retry_backoff: float = setting(0.5, "first retry delay in seconds, doubled on each retry", ge=0)
    max_retry_time: float = setting(120.0, "seconds spent retrying at most", ge=0)
    request_logprobs: bool = setting(True, "ask for the response tokens' logprobs")
    return_token_ids: bool = setting(True, "send vLLM's return_token_ids")


class OpenAICompatibleClient(InferenceClient):
    """`InferenceClient` for an OpenAI-compatible HTTP server. See the module docstring."""

    # Its keys are read once, into the attributes below: `self.settings` is left to a subclass's own
    # (nexrl-vllm's client adds its server's keys).
    SETTINGS: ClassVar[type[Settings]] = OpenAIClientSettings

    @classmethod
    def check_config(cls, section: Mapping[str, Any], key: str) -> list[str]:
        settings = OpenAIClientSettings.own(section, key)
        if not settings.url and not settings.base_url:
            return [f"{key}.url: required (the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1)"]
        return []

    def __init__(self, config: Mapping[str, Any]):
        import openai  # here: `nexrl validate` and runs without this client skip its 1 s import
        super().__init__(config)
        settings = OpenAIClientSettings.own(self.config, "service.inference_service")
        url = settings.url or settings.base_url
        if not url:
            raise ValueError(
                "OpenAICompatibleClient needs `url` in service.inference_service "
                "(the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1)"
            )
        self.url: str = url.rstrip("/")
        api_key = settings.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.model: str | None = settings.model or None
        self.timeout: float = settings.timeout
        self.max_retries: int = settings.max_retries
        self.retry_backoff: float = settings.retry_backoff
        self.max_retry_time: float = settings.max_retry_time
        self.request_logprobs: bool = settings.request_logprobs
        self._send_token_ids: bool = settings.return_token_ids
        self._model_lock = threading.Lock()
        # max_retries=0: retries are ours (bounded by max_retry_time), never the package's too.
        self._client = openai.OpenAI(base_url=self.url, api_key=str(api_key), timeout=self.timeout, max_retries=0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, model={self.model!r}, model_tag={self.model_tag!r})"

    # ------------------------------------------------------------------ public API

    def complete(self, prompt: str | list[dict[str, Any]], params: SamplingParams) -> CompletionResult:
        payload: str | list[dict[str, Any]]
        if isinstance(prompt, str):
            chat, payload = False, prompt
        elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
            chat, payload = True, [{str(k): v for k, v in cast(Mapping[str, Any], m).items()} for m in prompt]
        else:
            raise TypeError(f"prompt must be a string or a list of chat messages, not {type(prompt).__name__}")
        return self._generate(chat, payload, params, None)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams,
             tools: list[dict[str, Any]] | None = None) -> CompletionResult:
        """A chat reply offered ``tools``: sent as OpenAI ``tools``, calls read from
        ``choices[0].message.tool_calls`` (vLLM: a server started with a tool parser). A server
        without one leaves the calls in the text; they are then read from it as the in-process
        engine reads them (:func:`nexrl_core.parse_tool_calls`)."""
        if not tools and not any(m.get("tool_calls") for m in messages):
            return self.complete(messages, params)
        return self._generate(True, [_wire_message(m) for m in messages], params, tools or None)

    def _generate(self, chat: bool, payload: Any, params: SamplingParams,
                  tools: list[dict[str, Any]] | None) -> CompletionResult:
        endpoint = "/chat/completions" if chat else "/completions"

        def attempt(timeout: float) -> CompletionResult:
            with self.generation_attempt() as served:
                # Named per attempt, inside the gate: a retry after a weight update asks for the
                # model (a LoRA adapter's name) that update served, as its version label says.
                raw = self._post(chat, self._served_model(), payload, params, timeout, tools)
            result = self._parse(chat, self._decode(raw, endpoint), endpoint, tools is not None)
            result.model_version = served.model_version
            return result

        return self._with_retries(f"POST {endpoint}", attempt)

    @contextlib.contextmanager
    def generation_attempt(self) -> Iterator[Any]:
        """Entered around every generation request (each retry too). Yields an object whose
        ``model_version``, read when the request is done, is the weight version its result carries.
        A subclass whose server swaps weights under live traffic overrides it (vLLM: requests wait
        while an update is in progress, and one the server held across the update gets the new
        version)."""
        yield types.SimpleNamespace(model_version=self.model_version())

    def health_check(self) -> bool:
        """True when ``GET {url}/models`` answers 2xx with a JSON object within a few seconds."""
        try:
            raw = self._client.models.with_raw_response.list(timeout=min(self.timeout, _HEALTH_TIMEOUT))
            return isinstance(json.loads(raw.text), dict)
        except Exception:  # noqa: BLE001 - any failure means "not healthy"
            return False

    def close(self) -> None:
        self._client.close()

    # ------------------------------------------------------------------ requests

    def _post(self, chat: bool, model: str, payload: Any, params: SamplingParams, timeout: float,
              tools: list[dict[str, Any]] | None = None) -> Any:
        import openai
        kwargs: dict[str, Any] = {
            "model": model,
            "max_tokens": int(params.max_tokens),
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
            "timeout": timeout,
        }
        stop = [str(s) for s in (params.stop or [])]
        if stop:
            kwargs["stop"] = stop
        if params.seed is not None:
            kwargs["seed"] = int(params.seed)
        if tools:
            kwargs["tools"] = tools
        if self.request_logprobs:
            # Completions take a count of top alternatives (the sampled token's logprob
            # comes with any count); chat takes a flag.
            kwargs["logprobs"] = True if chat else 1
        create = (
            self._client.chat.completions.with_raw_response.create
            if chat
            else self._client.completions.with_raw_response.create
        )
        target = {"messages": payload} if chat else {"prompt": payload}
        # vLLM's extensions of the OpenAI request go in the body as extra fields.
        extra: dict[str, Any] = {"top_k": int(params.top_k)} if params.top_k > 0 else {}
        send_ids = self._send_token_ids
        try:
            body = {**extra, "return_token_ids": True} if send_ids else extra
            return create(**target, **kwargs, extra_body=body or None)
        except openai.BadRequestError as exc:
            if not (send_ids and "return_token_ids" in str(exc.message)):
                raise
            # A server without vLLM's extensions that refuses unknown fields: ask again
            # without it (this is not a retry) and stop sending it.
            if self._send_token_ids:
                self._send_token_ids = False
                logger.warning(f"inference server {self.url} rejects `return_token_ids`; continuing without "
                               f"token ids (set return_token_ids: false to silence this)")
            return create(**target, **kwargs, extra_body=extra or None)

    def _served_model(self) -> str:
        if self.model:
            return self.model
        with self._model_lock:
            if self.model:
                return self.model

            def attempt(timeout: float) -> str:
                raw = self._client.models.with_raw_response.list(timeout=timeout)
                body = self._decode(raw, "/models")
                data = body.get("data")
                if not isinstance(data, list) or not data or not isinstance(data[0], Mapping) or not data[0].get("id"):
                    raise self._malformed("/models", "it lists no model (no data[0].id); set `model` in the config")
                return str(data[0]["id"])

            self.model = self._with_retries("GET /models", attempt)
            return self.model

    def _with_retries(self, what: str, attempt: Callable[[float], T]) -> T:
        import openai
        start = time.monotonic()
        deadline = start + self.max_retry_time
        attempts = 0
        timeout = self.timeout
        while True:
            attempts += 1
            try:
                return attempt(timeout)
            except openai.APIStatusError as exc:
                status = exc.status_code
                if status not in _RETRYABLE_STATUS and status < 500:
                    raise InferenceError(self._rejected_message(what, exc)) from exc
                failure = _Transient(f"HTTP {status}: {_short(exc.message)}", _retry_after(exc.response))
            except openai.APITimeoutError:
                failure = _Transient(f"no answer within {timeout:.3g}s (timeout)")
            except openai.APIConnectionError as exc:
                cause = exc.__cause__ or exc
                failure = _Transient(f"connection failed ({type(cause).__name__}: {_short(str(cause)) or exc.message})")
            except _Transient as exc:
                failure = exc
            except openai.OpenAIError as exc:
                raise InferenceError(
                    f"inference server {self.url}: {what} failed ({type(exc).__name__}: {_short(str(exc))})"
                ) from exc

            now = time.monotonic()
            delay = self.retry_backoff * (2 ** (attempts - 1)) * (1.0 + 0.1 * random.random())
            if failure.retry_after is not None:
                delay = max(delay, failure.retry_after)
            if attempts > self.max_retries or now + delay >= deadline:
                elapsed = now - start
                raise InferenceError(
                    f"inference server {self.url}: {what} failed after {attempts} attempt"
                    f"{'s' if attempts != 1 else ''} over {elapsed:.1f}s (max_retries={self.max_retries}, "
                    f"max_retry_time={self.max_retry_time:g}s); last error: {failure.what}"
                )
            logger.debug(f"{self.url} {what} failed ({failure.what}); retry {attempts} in {delay:.2f}s")
            time.sleep(delay)
            # A retry never runs past the retry budget.
            timeout = max(0.001, min(self.timeout, deadline - time.monotonic()))

    # ------------------------------------------------------------------ answers

    def _decode(self, raw: Any, endpoint: str) -> dict[str, Any]:
        text = raw.text
        try:
            body = json.loads(text)
        except ValueError:
            raise self._malformed(
                endpoint,
                f"the body is not JSON (HTTP {raw.status_code}, content-type "
                f"{raw.headers.get('content-type', '?')!r}, starts with {text[:120]!r})",
            ) from None
        if not isinstance(body, dict):
            raise self._malformed(endpoint, f"the body is a JSON {type(body).__name__}, not an object")
        return body

    def _parse(self, chat: bool, body: dict[str, Any], endpoint: str, with_tools: bool = False) -> CompletionResult:
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices:
            raise self._malformed(endpoint, "it has no choices")
        choice = choices[0]
        if not isinstance(choice, dict):
            raise self._malformed(endpoint, "choices[0] is not an object")

        if chat:
            message = choice.get("message")
            if not isinstance(message, dict):
                raise self._malformed(endpoint, "choices[0].message is missing")
            text = message.get("content") or ""
            prompt_ids = body.get("prompt_token_ids", choice.get("prompt_token_ids"))
            calls = self._tool_calls(message.get("tool_calls"), endpoint) if with_tools else None
            if with_tools and not calls and "<tool_call>" in str(text):
                calls = parse_tool_calls(str(text))[1]  # a server without a tool parser
        else:
            text = choice.get("text")
            prompt_ids = choice.get("prompt_token_ids", body.get("prompt_token_ids"))
            calls = None
        if not isinstance(text, str):
            raise self._malformed(endpoint, "the completion text is not a string")

        finish = choice.get("finish_reason")
        if finish == "abort":
            raise _Transient("the server aborted the request (finish_reason 'abort')")

        prompt_ids = self._int_list(prompt_ids, "prompt_token_ids", endpoint)
        response_ids = self._int_list(choice.get("token_ids"), "choices[0].token_ids", endpoint)
        logprobs = self._logprobs(chat, choice.get("logprobs"), endpoint) if self.request_logprobs else None
        if response_ids is not None and logprobs is not None and len(response_ids) != len(logprobs):
            raise self._malformed(
                endpoint, f"it has {len(response_ids)} response token ids but {len(logprobs)} logprobs"
            )
        return CompletionResult(
            text=text,
            finish_reason="length" if finish == "length" else "stop",
            prompt_token_ids=prompt_ids,
            response_token_ids=response_ids,
            response_logprobs=logprobs,
            tool_calls=calls or None,
        )

    def _tool_calls(self, value: Any, endpoint: str) -> list[dict[str, Any]] | None:
        """``message.tool_calls`` in OpenAI's shape (arguments as JSON text)."""
        if not value:
            return None
        if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
            raise self._malformed(endpoint, "choices[0].message.tool_calls is not a list of objects")
        calls = []
        for call in value:
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise self._malformed(endpoint, "a tool call has no function name")
            args = fn.get("arguments")
            calls.append({"id": str(call.get("id") or ""), "type": "function",
                          "function": {"name": fn["name"],
                                       "arguments": args if isinstance(args, str) else json.dumps(args or {})}})
        return calls

    def _logprobs(self, chat: bool, obj: Any, endpoint: str) -> list[float] | None:
        if obj is None:
            return None
        if not isinstance(obj, dict):
            raise self._malformed(endpoint, "choices[0].logprobs is not an object")
        values: list[Any] | None
        if chat:
            content = obj.get("content")
            if content is None:
                return None
            if not isinstance(content, list) or not all(isinstance(c, dict) for c in content):
                raise self._malformed(endpoint, "choices[0].logprobs.content is not a list of objects")
            values = [c.get("logprob") for c in content]
            where = "choices[0].logprobs.content[].logprob"
        else:
            values = obj.get("token_logprobs")
            if values is None:
                return None
            where = "choices[0].logprobs.token_logprobs"
            if not isinstance(values, list):
                raise self._malformed(endpoint, f"{where} is not a list")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise self._malformed(endpoint, f"{where} holds a value that is not a number")
        return [float(v) for v in values]

    def _int_list(self, value: Any, where: str, endpoint: str) -> list[int] | None:
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self._malformed(endpoint, f"{where} is not a list of integers")
        return list(value)

    # ------------------------------------------------------------------ messages

    def _malformed(self, endpoint: str, what: str) -> InferenceError:
        return InferenceError(
            f"inference server {self.url} sent a malformed answer to {endpoint}: {what}. "
            "An OpenAI-compatible answer was expected (choices[0] with text or message.content, "
            "and when the server provides them, vLLM's token_ids/prompt_token_ids and logprobs "
            "of the same length); check that `url` points at the server's OpenAI base URL."
        )

    def _rejected_message(self, what: str, exc: openai.APIStatusError) -> str:
        hint = ""
        if exc.status_code == 404:
            hint = f" Check `model` (sent {self.model!r})"
            hint += " and that `url` ends with the API prefix, usually /v1." if not self.url.endswith("/v1") else "."
        elif exc.status_code in (401, 403):
            hint = " Check `api_key` (or OPENAI_API_KEY)."
        return (
            f"inference server {self.url} rejected {what} with HTTP {exc.status_code} "
            f"(not retried): {_short(exc.message)}.{hint}"
        )


def _wire_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the API takes it: tool calls with only OpenAI's fields. A reply whose
    calls were read from its own text (a server without a tool parser) goes back as the model
    wrote it, without ``tool_calls``: the server's template would write the calls a second time."""
    out = {str(k): v for k, v in message.items()}
    if out.get("role") == "assistant" and "<tool_call>" in str(out.get("content") or ""):
        out.pop("tool_calls", None)
    if out.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id", ""), "type": "function", "function": c.get("function", {})}
                             for c in out["tool_calls"]]
    return out


def _retry_after(response: Any) -> float | None:
    try:
        value = response.headers.get("retry-after")
        return max(0.0, float(value)) if value is not None else None
    except (AttributeError, TypeError, ValueError):
        return None


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@hookimpl
def nexrl_inference_backends():
    return {"openai": OpenAICompatibleClient}
