"""``llm_judge``: another model scores the reply.

The judge is any registered inference backend, built by name through the plugin manager from the
evaluator's own ``service`` mapping (the same keys as ``service.inference_service``: an
OpenAI-compatible server by ``url``, the in-process ``hf`` engine by ``model_path``, ...). Its
reply is parsed into a score in [0, 1]; a judge that errors or answers nonsense after its retries
raises, so the sample is recorded as failed instead of scoring a 0 it did not earn.
"""

from __future__ import annotations

import json
import math
import re
import threading
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from nexrl_core import (
    ANSWER_FIELDS,
    BaseEvaluationTarget,
    ConfigError,
    EvaluationRunResult,
    Evaluator,
    InferenceClient,
    SamplingParams,
    component_options,
    get_plugin_manager,
    required_row_field,
    row_field,
)

from .options import KEY as _KEY
from .options import number, whole

DEFAULT_TEMPLATE = (
    "You are grading an answer to a question against a reference answer.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer:\n{reference}\n\n"
    "Answer to grade:\n{response}\n\n"
    "Is the answer to grade correct? Reply with one word: correct or incorrect."
)
DEFAULT_VERDICTS = {
    "correct": 1.0, "incorrect": 0.0, "not correct": 0.0, "partially correct": 0.5,
    "right": 1.0, "wrong": 0.0, "yes": 1.0, "no": 0.0, "true": 1.0, "false": 0.0,
    "pass": 1.0, "fail": 0.0, "accept": 1.0, "reject": 0.0, "good": 1.0, "bad": 0.0,
}
PLACEHOLDERS = ("question", "reference", "response")
_PLACEHOLDER = re.compile(r"\{(question|reference|response)\}")
# "Score: 7", "**Verdict:** correct", "Final answer = yes" at the start of a line.
_LABELED = re.compile(r"(?im)^[\W_]*(?:final\s+)?(?:score|rating|grade|verdict|judge?ment|decision|answer)"
                      r"[\W_]*?\s*[:=]\s*(.+?)\s*$")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_EDGE_NOISE = " \t\r\n*_`'\".,!;:()[]"
_SHOWN_REPLY = 500


class JudgeError(RuntimeError):
    """The judge gave no usable score after its retries: the sample fails (never a 0 reward)."""


def parse_score(text: str, verdicts: Mapping[str, float], json_key: str,
                score_range: tuple[float, float]) -> tuple[float, str] | None:
    """(score in [0, 1], where it was found: ``json``, ``label`` or ``reply``), or None.

    Tried in order: a JSON object with ``json_key``; the last "Score: / Verdict: / ..." line whose
    value reads as a score; the whole reply. A value is a number on ``score_range`` (outside
    it: not a score), ``N/M`` (N on a scale of M), or a word or phrase of ``verdicts``.
    """
    for obj in reversed(_json_objects(text)):
        if json_key in obj:
            value = obj[json_key]
            score = (_value(str(value), verdicts, score_range) if not isinstance(value, bool)
                     else float(value))
            if score is not None:
                return score, "json"
    for match in reversed(list(_LABELED.finditer(text))):
        score = _value(match.group(1), verdicts, score_range)
        if score is not None:
            return score, "label"
    score = _value(text, verdicts, score_range)
    return (score, "reply") if score is not None else None


def _value(raw: str, verdicts: Mapping[str, float], score_range: tuple[float, float]) -> float | None:
    value = " ".join(raw.strip(_EDGE_NOISE).lower().split())
    if value in verdicts:
        return float(verdicts[value])
    number = re.fullmatch(rf"({_NUMBER.pattern})(?:\s*/\s*({_NUMBER.pattern}))?", value)
    if number is None:
        return None
    x = float(number.group(1))
    if number.group(2) is not None:  # "7/10": 7 on a scale of 10
        scale = float(number.group(2))
        return x / scale if scale > 0 and 0 <= x <= scale else None
    lo, hi = score_range
    return (x - lo) / (hi - lo) if lo <= x <= hi else None


def _json_objects(text: str) -> list[dict]:
    """Every top-level ``{...}`` of ``text`` that parses as a JSON object."""
    found, depth, start, in_string, escaped = [], 0, -1, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"' and depth:
            in_string = True
        elif ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                try:
                    obj = json.loads(text[start:i + 1])
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    found.append(obj)
    return found


_CLIENTS: dict[str, InferenceClient] = {}
_CLIENTS_LOCK = threading.Lock()


def judge_client(service: Mapping[str, Any]) -> InferenceClient:
    """One client per distinct ``service`` mapping per process: every rollout worker's evaluator
    shares it (clients are thread-safe), so an in-process judge model is loaded once."""
    key = json.dumps(service, sort_keys=True, default=str)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = _build_client(service)
        return client


def _build_client(service: Mapping[str, Any]) -> InferenceClient:
    from omegaconf import OmegaConf

    where = f"{_KEY}.service"
    backend = service.get("backend")
    if not backend:
        raise ConfigError(f"{where}.backend: missing; name an inference backend (e.g. openai, hf, mock)")
    cls = get_plugin_manager().resolve("inference_backend", backend, f"{where}.backend")
    own = component_options(cls)
    accepted = {"backend", "model_tag", *(own or {})}
    unknown = sorted(set(service) - accepted)
    if unknown and own:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key for backend '{backend}' "
                          f"(accepted: {', '.join(sorted(accepted))})")
    try:
        return cls(OmegaConf.create(dict(service)))
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"{where}: backend '{backend}' rejected its configuration: {exc}") from exc


class LLMJudgeEvaluator(Evaluator):
    """Reward = the judge's score, normalised to [0, 1].

    Metrics (every sample reports all of them): ``accuracy`` (score >= ``pass_threshold``),
    ``judge_score``, ``judge_attempts``. ``extra_info``: ``reason`` (None when it passes, else
    ``judged_incorrect``), ``found_in`` (``json``, ``label`` or ``reply``), ``judge_reply``,
    ``attempts`` and ``problems`` (what went wrong with earlier attempts).
    """

    def __init__(self,
                 service: dict[str, Any] | None = None,
                 prompt_template: str = DEFAULT_TEMPLATE,
                 question_key: str = "prompt",
                 reference_key: str = "answer",
                 system_prompt: str | None = None,
                 use_chat: bool = True,
                 score_range: Sequence[float] = (0.0, 1.0),
                 verdicts: dict[str, float] | None = None,
                 json_key: str = "score",
                 pass_threshold: float = 0.5,
                 max_retries: int = 2,
                 max_tokens: int = 256,
                 temperature: float = 0.0,
                 retry_temperature: float = 0.7):
        """The judge and how its reply becomes a score (see docs/rewards.md).

        :param service: required: the judge's inference backend mapping (backend: openai, hf, mock or any plugin's,
            and its keys); one client per distinct mapping is shared by the process's rollout workers
        :param prompt_template: text with {question}, {reference} and {response} (required)
        :param question_key: data field that fills {question}; a dotted path reads a nested field
        :param reference_key: data field that fills {reference}; a dotted path reads a nested field
            (reward_model.ground_truth: verl's and NexRL's math rows)
        :param system_prompt: a system message before the prompt (chat only)
        :param use_chat: send chat messages (false: the text as a completion prompt)
        :param score_range: the scale of a numeric score, mapped to [0, 1]
        :param verdicts: words or phrases and their scores in [0, 1] (replaces the default table)
        :param json_key: the key read from a JSON object in the reply
        :param pass_threshold: the score from which the accuracy metric is 1
        :param max_retries: more attempts after a reply that is not a score, or a backend error
        :param max_tokens: the judge's token limit
        :param temperature: the judge's sampling temperature on the first attempt
        :param retry_temperature: the temperature of the attempts after a reply that was not a score
        """
        if not isinstance(service, Mapping):  # required: the judge has no sensible default
            raise ConfigError(f"{_KEY}.service: expected a mapping like {{backend: openai, url: ...}}, "
                              f"got {'nothing' if service is None else type(service).__name__}")
        if "{response}" not in prompt_template:
            raise ConfigError(f"{_KEY}.prompt_template: must contain {{response}} (the reply to judge); "
                              f"placeholders: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
        try:
            lo, hi = (float(x) for x in score_range)
        except (TypeError, ValueError):
            raise ConfigError(f"{_KEY}.score_range: expected [low, high], got {score_range!r}") from None
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ConfigError(f"{_KEY}.score_range: {score_range!r} needs low < high")
        table = DEFAULT_VERDICTS if verdicts is None else verdicts
        if not isinstance(table, Mapping) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0 for v in table.values()):
            raise ConfigError(f"{_KEY}.verdicts: expected a mapping of words to scores in [0, 1]")
        self.prompt_template = prompt_template
        self.question_key = question_key
        self.reference_key = reference_key
        self.system_prompt = system_prompt
        self.use_chat = bool(use_chat)
        self.score_range = (lo, hi)
        self.verdicts = {" ".join(str(k).lower().split()): float(v) for k, v in table.items()}
        self.json_key = json_key
        self.pass_threshold = number(pass_threshold, "pass_threshold")
        self.max_retries = whole(max_retries, "max_retries", low=0)
        self.max_tokens = whole(max_tokens, "max_tokens", low=1)
        self.temperature = number(temperature, "temperature", low=0)
        self.retry_temperature = number(retry_temperature, "retry_temperature", low=0)
        self.client = judge_client(dict(service))

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        prompt = self._prompt(data, evaluation_target.final_answer)
        problems: list[str] = []
        for attempt in range(self.max_retries + 1):
            # A retry after a reply that made no sense samples again instead of repeating it.
            temperature = self.temperature if attempt == 0 or not problems[-1].startswith("unparseable") \
                else max(self.temperature, self.retry_temperature)
            seed = zlib.crc32(f"{data.get('uid')}|{data.get('sample_index')}|{attempt}".encode())
            try:
                reply = self.client.complete(prompt, SamplingParams(max_tokens=self.max_tokens,
                                                                    temperature=temperature, seed=seed)).text
            except Exception as exc:  # noqa: BLE001 - a backend error is a failed attempt
                problems.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                continue
            parsed = parse_score(reply, self.verdicts, self.json_key, self.score_range)
            if parsed is None:
                problems.append(f"unparseable reply {reply[:200]!r}")
                continue
            score, found_in = parsed
            passed = score >= self.pass_threshold
            return EvaluationRunResult(
                reward=score, ground_truth=str(self._reference(data)),
                metrics={"accuracy": float(passed), "judge_score": score, "judge_attempts": float(attempt + 1)},
                extra_info={"reason": None if passed else "judged_incorrect", "found_in": found_in,
                            "judge_reply": reply[:_SHOWN_REPLY], "attempts": attempt + 1, "problems": problems})
        raise JudgeError(f"the judge gave no usable score in {self.max_retries + 1} attempt"
                         f"{'s' if self.max_retries else ''}: {'; '.join(problems)}")

    def _prompt(self, data: dict[str, Any], response: str) -> str | list[dict[str, str]]:
        values = {"response": response}
        for name, key in (("question", self.question_key), ("reference", self.reference_key)):
            if "{" + name + "}" in self.prompt_template:
                values[name] = _as_text(required_row_field(data, key, f"{_KEY}.{name}_key",
                                                           ANSWER_FIELDS if name == "reference" else ()))
        text = _PLACEHOLDER.sub(lambda m: values[m.group(1)], self.prompt_template)
        if not self.use_chat:
            return text
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": text}]

    def _reference(self, data: dict[str, Any]) -> Any:
        """The reference answer, or "" when the row has none (a template without {reference})."""
        reference = row_field(data, self.reference_key)
        return "" if reference is None else reference


def _as_text(value: Any) -> str:
    """A chat prompt (list of messages) becomes its user turns' text; anything else str()."""
    if isinstance(value, (list, tuple)) and all(isinstance(m, Mapping) for m in value):
        return "\n\n".join(str(m.get("content", "")) for m in value if m.get("role", "user") == "user")
    return str(value)
