"""Inference clients: what a rollout worker talks to.

Every backend returns the response token ids and their logprobs (when the
server can give them) so training never re-tokenizes text.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import typing
from abc import ABC, abstractmethod
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..config.options import Option, check_options, component_options
from ..config.settings import Section, read_section
from ..errors import ConfigError


@dataclass
class SamplingParams:
    """How one completion is sampled. Every backend honours every field (none is dropped).

    A trajectory carries the parameters it was sampled with (``trajectory["sampling"]``, written
    by :meth:`as_record`): they travel with the data, so the trainer scores each row at the
    temperature that produced it. Conventions:

    - ``temperature`` 0 is greedy decoding, and the reported log-probs are then those at
      temperature 1 (vLLM's convention); :attr:`logprob_temperature` is the temperature the
      log-probs of a completion are taken at, which is what the trainer uses.
    - ``top_k`` 0 (or -1, vLLM's older spelling) keeps every token; ``top_p`` 1 likewise.
    - The trainer scores the full vocabulary at the temperature, as the in-process engine
      reports it even when ``top_k``/``top_p`` truncated the sampling distribution. A backend
      whose log-probs are those of the truncated distribution differs there, and the trainer's
      rollout-mismatch metrics show by how much.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    # Per-request seed: makes sampling reproducible whatever else is batched with it.
    seed: int | None = None

    @property
    def logprob_temperature(self) -> float:
        return float(self.temperature) if self.temperature > 0 else 1.0

    def problems(self) -> list[str]:
        """What is wrong with these values, one line per field (empty when they are sound)."""
        out = []
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            out.append(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            out.append(f"temperature: must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            out.append(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            out.append(f"top_k: must be an integer >= 0 (0 or -1: no limit), got {self.top_k!r}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) for x in self.stop):
            out.append(f"stop: must be a list of strings, got {self.stop!r}")
        return out

    def check(self) -> SamplingParams:
        """``self``, or ValueError naming every bad field."""
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def as_record(self) -> dict[str, Any]:
        """The parameters as a plain dict, for ``trajectory["sampling"]``."""
        record = dataclasses.asdict(self)
        record["stop"] = list(record["stop"])
        return record

    @classmethod
    def recipe_problems(cls, section: object, key: str = "rollout_worker.sampling") -> list[str]:
        """Problems of a recipe's sampling mapping, one line each naming the key: an unknown key
        (with a "did you mean") or a bad value. Empty when :meth:`from_config` will accept it."""
        if section is None:
            return []
        if not isinstance(section, Mapping):
            return [f"{key}: expected a mapping of sampling keys, got {section!r}"]
        problems = check_options(_stop_as_list(section), sampling_options(), key)
        if not problems:
            problems = [f"{key}.{line}" for line in cls(**_stop_as_list(section)).problems()]
        return problems

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None, key: str = "rollout_worker.sampling") -> SamplingParams:
        """Parameters from a recipe mapping (``top_k`` -1 read as 0); ConfigError listing
        :meth:`recipe_problems`."""
        problems = cls.recipe_problems(section, key)
        if problems:
            raise ConfigError("; ".join(problems))
        params = cls(**_stop_as_list(section or {}))
        if params.top_k == -1:
            params.top_k = 0
        return params


# Bounds and help of SamplingParams fields; a field not listed is checked by its type alone.
_SAMPLING: dict[str, dict[str, Any]] = {
    "max_tokens": dict(ge=1, help="most tokens a response may have"),
    "temperature": dict(ge=0, help="sampling temperature (0: greedy)"),
    "top_p": dict(gt=0, le=1, help="nucleus sampling: smallest token set with this much probability"),
    "top_k": dict(ge=-1, help="sample among the k likeliest tokens (0 or -1: all)"),
    "stop": dict(help="strings that end a response"),
}
_NOT_RECIPE_KEYS = {"seed": "the seed is derived per request from rollout_worker.seed"}


def sampling_options() -> dict[str, Option]:
    """``rollout_worker.sampling``: exactly the fields of :class:`SamplingParams` a recipe sets."""
    hints = typing.get_type_hints(SamplingParams)
    out = {}
    for f in dataclasses.fields(SamplingParams):
        if f.name in _NOT_RECIPE_KEYS:
            out[f.name] = Option(removed=_NOT_RECIPE_KEYS[f.name])
            continue
        default = f.default if f.default is not dataclasses.MISSING else \
            (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        extra = dict(_SAMPLING.get(f.name, {}))
        out[f.name] = Option(default, hints.get(f.name), **extra)
    return out


def _stop_as_list(section: Mapping[str, Any]) -> dict[str, Any]:
    """A single stop string is a list of one (as OpenAI's API accepts it)."""
    out = dict(section)
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class CompletionResult:
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    response_logprobs: list[float] | None = None
    # Weight version that produced this completion (-1 when the backend cannot tell).
    model_version: int = -1
    # Weight version that sampled each response token, for a backend whose completion can span a
    # weight update (one int per response token). None: every token is ``model_version``'s.
    token_versions: list[int] | None = None
    # Tool calls of a chat reply (InferenceClient.chat with tools), OpenAI's shape: {"id", "type":
    # "function", "function": {"name", "arguments": JSON text}}; a call the backend could not read
    # out of the model's text also has an "error" key. None: no call.
    tool_calls: list[dict[str, Any]] | None = None
    # What it was asked with (SamplingParams.as_record()): set by BaseRolloutWorker.complete, so
    # a trajectory built from it records how its tokens were sampled. None from a backend.
    sampling: dict[str, Any] | None = None


def completion_record(prompt: Any, params: SamplingParams, result: CompletionResult,
                      extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A completion as the seed's dict-shaped calls answer it (and what a worker's trajectory is
    filled in from): the prompt, the reply with its tokens, log-probs and versions, and the
    sampling record; ``extra``: keys passed through."""
    return {"prompt": prompt, "response": result.text, "finish_reason": result.finish_reason,
            "prompt_token_ids": result.prompt_token_ids, "response_token_ids": result.response_token_ids,
            "response_logprobs": result.response_logprobs, "model_version": result.model_version,
            "token_versions": result.token_versions, "sampling": params.as_record(), **(extra or {})}


class InferenceError(RuntimeError):
    """An inference call failed for good (after retries) or got a bad answer."""


class InferenceClient(ABC):
    """One inference service as seen by rollout workers (shared by all of them).

    Constructed with the `service.inference_service` mapping of the recipe.
    Implementations must be safe to call from several threads at once.
    """

    @classmethod
    def own_section(cls, config: Mapping[str, Any] | None, path: str = "service.inference_service") -> Section:
        """``config`` as this backend reads it (:attr:`config`): a copy, the core's
        ``service.inference_service`` keys and this backend's own, defaults filled."""
        from ..config.schema import InferenceServiceSettings

        return read_section(config, {**(component_options(cls) or {}), **InferenceServiceSettings.options()}, path)

    def __init__(self, config: Mapping[str, Any] | None):
        # Subclasses read their own keys with their Settings' own(self.config).
        self.config = config = type(self).own_section(config)
        self.model_tag: str = str(config["model_tag"])
        self._version = 0
        self._version_lock = threading.Lock()

    @abstractmethod
    def complete(self, prompt: str | list[dict[str, Any]], params: SamplingParams) -> CompletionResult:
        """Generate one completion for `prompt` (text, or chat messages)."""

    def score(self, requests: list[tuple[list[int], list[int], float]]) -> list[list[float]]:
        """Log-probs of given tokens, no generation: for each ``(prompt_ids, response_ids,
        temperature)`` the log-prob of every response token given the prompt and the response
        tokens before it, at ``temperature``. What a KL reference service answers
        (``service.reference_service``); a backend that can serves it by overriding this."""
        raise NotImplementedError(f"inference backend {type(self).__name__} cannot score given tokens")

    @classmethod
    def can_score(cls) -> bool:
        """Whether this backend answers :meth:`score` (checked by ``nexrl validate``)."""
        return cls.score is not InferenceClient.score

    def complete_many(self, requests: list[tuple[Any, SamplingParams]]) -> list[CompletionResult | InferenceError]:
        """:meth:`complete` for several ``(prompt, params)`` at once: one call for a worker's batch of
        tasks (``rollout_worker.tasks_per_call``; one round trip when the client is in another
        process). A request that fails gets its :class:`InferenceError` in its place. The requests
        run concurrently, so an engine that batches concurrent requests batches these too."""
        def attempt(request: tuple[Any, SamplingParams]) -> CompletionResult | InferenceError:
            try:
                return self.complete(*request)
            except InferenceError as exc:
                return exc

        if len(requests) <= 1:
            return [attempt(r) for r in requests]
        with ThreadPoolExecutor(max_workers=len(requests), thread_name_prefix="complete_many") as pool:
            return list(pool.map(attempt, requests))

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams,
             tools: list[dict[str, Any]] | None = None) -> CompletionResult:
        """One assistant reply to chat ``messages``, offered ``tools`` (OpenAI ``tools`` entries).

        The result's ``text`` is the reply as the model wrote it (an agent puts it back in the
        history as the assistant message's content) and ``tool_calls`` its calls. Without tools
        (and no tool calls in the history) this is :meth:`complete`. This default serves backends
        that only take text: the tools are described in the system message, calls already in the
        history are written out as ``<tool_call>`` blocks, and the reply's calls are read from its
        text (:func:`nexrl_core.tool_calls.parse_tool_calls`). Backends with native tool support
        override it.
        """
        if not tools and not any(m.get("tool_calls") for m in messages):
            return self.complete(messages, params)
        from ..tool_calls import as_text_messages, parse_tool_calls

        result = self.complete(as_text_messages(messages, tools), params)
        if tools:
            result.tool_calls = parse_tool_calls(result.text)[1] or None
        return result

    def completion(self, prompt: str | list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        """The seed's dict-shaped call: sampling keys as keyword arguments."""
        known = {k: kwargs.pop(k) for k in list(kwargs) if k in SamplingParams.__dataclass_fields__}
        params = SamplingParams(**known).check()
        return completion_record(prompt, params, self.complete(prompt, params), kwargs)

    def generate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                 **kwargs: Any) -> dict[str, Any]:
        """The seed's chat call: ``messages``, ``tools`` (OpenAI ``tools`` entries, passed to the
        model as :meth:`chat` passes them) and sampling keys as keyword arguments; the answer as
        :meth:`completion`'s plus ``messages`` and ``tool_calls`` (None: no call)."""
        known = {k: kwargs.pop(k) for k in list(kwargs) if k in SamplingParams.__dataclass_fields__}
        params = SamplingParams(**known).check()
        result = self.chat(messages, params, tools)
        return {"messages": messages, "tool_calls": result.tool_calls,
                **completion_record(messages, params, result, kwargs)}

    def get_model_tag(self) -> str:
        return self.model_tag

    def model_version(self) -> int:
        with self._version_lock:
            return self._version

    def set_model_version(self, version: int) -> None:
        with self._version_lock:
            self._version = version

    def share_cpus_with_trainer(self) -> Any:
        """The trainer computes in this process while this service generates (``weight.rollouts_ahead``
        in launch_mode local): an engine computing here may give it part of the CPU. Default: nothing."""
        return None

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Serve `state_dict` from now on (in-process engines only)."""
        raise NotImplementedError(f"{type(self).__name__} cannot load weights in process")

    def health_check(self) -> bool:
        return True

    def close(self) -> None:
        pass

