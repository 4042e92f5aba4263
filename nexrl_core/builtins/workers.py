"""Built-in rollout workers: single-turn sampling (``simple``) and computed targets (``pig_latin``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ..config.options import Option
from ..config.settings import Settings, setting
from ..errors import ConfigError
from ..evaluation import row_field
from ..markers import hookimpl
from ..rollout_worker import BaseRolloutWorker, ItemFailure, RolloutParts
from ..runtime.inference import CompletionResult, SamplingParams, sampling_options

SamplingValue = int | float | str | list[str]  # a sampling key's value (stop: one string or a list)


@dataclass(frozen=True, kw_only=True)
class SimpleWorkerSettings(Settings):
    """The simple worker's ``rollout_worker`` keys (next to the core's)."""

    prompt_key: str = setting("prompt", "task field that holds the prompt")
    use_chat: bool = setting(True, "send chat messages (false: the raw prompt text)")
    system_prompt: str | None = setting(None, "system message put before the prompt (chat only)")
    sampling: dict[str, SamplingValue] = setting(dict, "sampling parameters of every request",
                                                 options=sampling_options())
    domain_sampling: dict[str, dict[str, SamplingValue]] = setting(
        {}, "per-domain changes to sampling, {<domain>: {max_tokens: 64, ...}}: a task of a domain listed here is "
            "sampled with them",
        values=Option({}, dict, "a domain's sampling keys (those of rollout_worker.sampling) that differ from "
                                "rollout_worker.sampling"))

    def domain_sampling_merged(self) -> dict[str, dict[str, SamplingValue]]:
        """Each domain's full sampling mapping: the shared ``sampling`` with the domain's changes over it."""
        return {str(domain): {**self.sampling, **change} for domain, change in self.domain_sampling.items()}


class SimpleRolloutWorker(BaseRolloutWorker):
    """Single turn: prompt -> inference service -> evaluator -> trajectory."""

    # Its keys are read once, into the attributes below: `self.settings` is left to a subclass's own.
    SETTINGS: ClassVar[type[Settings]] = SimpleWorkerSettings

    def __init__(self, config: Mapping[str, Any], parts: RolloutParts | None = None):
        super().__init__(config, parts)
        settings = SimpleWorkerSettings.own(self._config, "rollout_worker")
        self._prompt_key = settings.prompt_key
        self._use_chat = settings.use_chat
        self._system_prompt = settings.system_prompt
        self._validate_temperature: float | None = self._config["validate_temperature"]  # the core's key
        problems = _sampling_problems(settings, self._validate_temperature, "rollout_worker")
        if problems:
            raise ConfigError("; ".join(problems))
        self._sampling = SamplingParams.from_config(settings.sampling)
        self._domain_sampling = {domain: SamplingParams.from_config(sampling)
                                 for domain, sampling in settings.domain_sampling_merged().items()}

    @classmethod
    def check_config(cls, section: Mapping[str, Any], key: str = "rollout_worker") -> list[str]:
        """The sampling values (``nexrl validate`` and the constructor run the same checks)."""
        settings, problems = SimpleWorkerSettings.parse(section, key, own=True)
        if settings is None:
            return problems
        return _sampling_problems(settings, section.get("validate_temperature"), key)

    def build_prompt(self, task: dict[str, Any]) -> str | list[dict[str, Any]]:
        prompt: Any = task.get(self._prompt_key)
        if isinstance(prompt, list) or not self._use_chat:
            return prompt
        messages = [{"role": "system", "content": self._system_prompt}] if self._system_prompt else []
        return messages + [{"role": "user", "content": str(prompt)}]

    def sampling_params(self, task: dict[str, Any]) -> SamplingParams:
        """``rollout_worker.sampling``, with the task's domain's changes (``domain_sampling``) and
        ``validate_temperature`` for a validation task."""
        domain = task.get("domain")
        params = self._sampling if domain is None else self._domain_sampling.get(domain, self._sampling)
        if self._task_is_validation and self._validate_temperature is not None:
            params = replace(params, temperature=float(self._validate_temperature))
        return params

    def prepare_tasks(self, tasks: list[dict[str, Any]]) -> None:
        """The tasks' first requests in one ``complete_many`` call (:meth:`prepare_first_calls`), and,
        when :meth:`step` is this class's (the first answer is the trajectory's), their scoring in
        one call per evaluator (:meth:`evaluate_in_advance`)."""
        asked = [t for t in tasks if t.get(self._prompt_key) not in (None, "")]
        self.prepare_first_calls([(t, self.build_prompt(t)) for t in asked])
        if type(self).step is SimpleRolloutWorker.step:
            self.evaluate_in_advance([(t, answer.text) for t in asked
                                      if isinstance(answer := self._prepared[id(t)][2], CompletionResult)])

    def step(self, task: dict[str, Any]) -> str | None:
        if task.get(self._prompt_key) in (None, ""):
            raise ItemFailure("missing_prompt", f"task has no '{self._prompt_key}' field")
        prompt = self.build_prompt(task)
        result = self.complete(prompt)
        return self._put_trajectory(self.completion_trajectory(task, prompt, result))


def _sampling_problems(settings: SimpleWorkerSettings, validate_temperature: float | None, key: str) -> list[str]:
    problems = SamplingParams.recipe_problems(settings.sampling, f"{key}.sampling")
    merged = settings.domain_sampling_merged()
    for domain, change in settings.domain_sampling.items():
        # What the recipe wrote for the domain first, then that over the shared sampling.
        where = f"{key}.domain_sampling.{domain}"
        problems += SamplingParams.recipe_problems(change, where) or \
            SamplingParams.recipe_problems(merged[str(domain)], where)
    if validate_temperature is not None and SamplingParams(temperature=validate_temperature).problems():
        problems.append(f"{key}.validate_temperature: must be a finite number >= 0 (0: greedy), "
                        f"got {validate_temperature!r}")
    return problems


_WORD = re.compile(r"[A-Za-z]+")


def pig_latin(text: str) -> str:
    """Move a word's leading consonants to its end and add "ay" ("way" after a vowel)."""
    def convert(match: re.Match) -> str:
        word = match.group()
        lower = word.lower()
        i = next((k for k, ch in enumerate(lower) if ch in "aeiou"), len(word))
        out = word[i:] + word[:i].lower() + ("way" if i == 0 else "ay")
        return out.capitalize() if word[0].isupper() else out
    return _WORD.sub(convert, text)


@dataclass(frozen=True, kw_only=True)
class PigLatinSettings(Settings):
    """The pig_latin worker's ``rollout_worker`` keys."""

    prompt_key: str = setting("prompt", "task field that holds the source text")
    instruction: str = setting("Translate to Pig Latin: ", "text put before the source in the prompt")
    target_key: str | None = setting(None, "task field that holds the expected translation (NexRL's rows: output), "
                                           "dotted for a nested one; null: the translation computed from the source")


class PigLatinRolloutWorker(BaseRolloutWorker):
    """Supervised data for the cross-entropy trainer: the target is computed, not sampled."""

    SETTINGS: ClassVar[type[Settings]] = PigLatinSettings

    def __init__(self, config: Mapping[str, Any], parts: RolloutParts | None = None):
        super().__init__(config, parts)
        self.settings = PigLatinSettings.own(self._config, "rollout_worker")

    def step(self, task: dict[str, Any]) -> str | None:
        source = str(task.get(self.settings.prompt_key, ""))
        instruction = self.settings.instruction
        target_key = self.settings.target_key
        target = pig_latin(source) if target_key is None else row_field(task, target_key)
        if target in (None, ""):
            raise ItemFailure("missing_target", f"task has no '{target_key}' field (rollout_worker.target_key)")
        trajectory = self.base_trajectory(task)
        trajectory.update({"prompt": [{"role": "user", "content": instruction + source}],
                           "response": str(target), "reward": 1.0, "score": {"reward": 1.0},
                           "model_version": self._current_version()})
        return self._put_trajectory(trajectory)


@hookimpl
def nexrl_rollout_workers():
    return {"simple": SimpleRolloutWorker, "pig_latin": PigLatinRolloutWorker}
