"""Built-in rollout workers: single-turn sampling (``simple``) and computed targets (``pig_latin``)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..config.options import Option, option_defaults
from ..errors import ConfigError
from ..markers import hookimpl
from ..rollout_worker import BaseRolloutWorker, ItemFailure
from ..runtime.inference import CompletionResult, SamplingParams, sampling_options


class SimpleRolloutWorker(BaseRolloutWorker):
    """Single turn: prompt -> inference service -> evaluator -> trajectory."""

    OPTIONS = {
        "prompt_key": Option("prompt", str, "task field that holds the prompt"),
        "use_chat": Option(True, bool, "send chat messages (false: the raw prompt text)"),
        "system_prompt": Option(None, str, "system message put before the prompt (chat only)"),
        "sampling": Option(options=sampling_options(), help="sampling parameters of every request"),
        "domain_sampling": Option({}, dict, "per-domain changes to sampling, {<domain>: {max_tokens: 64, ...}}: a "
                                            "task of a domain listed here is sampled with them",
                                  values=Option({}, dict, "a domain's sampling keys (those of rollout_worker.sampling) "
                                                          "that differ from rollout_worker.sampling")),
    }
    CONFIG_KEYS = option_defaults(OPTIONS)  # deprecated view, for plugins that extend it

    def __init__(self, config: Any):
        super().__init__(config)
        config = self._config
        self._prompt_key = str(config["prompt_key"])
        self._use_chat = bool(config["use_chat"])
        self._system_prompt = config["system_prompt"]
        problems = self.check_config(config)
        if problems:
            raise ConfigError("; ".join(problems))
        self._sampling = SamplingParams.from_config(_plain(config["sampling"]))
        self._domain_sampling = {str(domain): SamplingParams.from_config(sampling)
                                 for domain, sampling in _domain_sampling(config).items()}
        self._validate_temperature = config["validate_temperature"]

    @classmethod
    def check_config(cls, section: Any, key: str = "rollout_worker") -> list[str]:
        """The sampling values (``nexrl validate`` and the constructor run the same checks)."""
        problems = SamplingParams.recipe_problems(_plain(section.get("sampling")), f"{key}.sampling")
        changes = _plain(section.get("domain_sampling")) or {}
        merged = _domain_sampling(section)
        for domain, change in changes.items():
            # What the recipe wrote for the domain first, then that over the shared sampling.
            where = f"{key}.domain_sampling.{domain}"
            problems += SamplingParams.recipe_problems(change, where) or \
                SamplingParams.recipe_problems(merged[str(domain)], where)
        temperature = section.get("validate_temperature")
        if temperature is not None and SamplingParams(temperature=temperature).problems():
            problems.append(f"{key}.validate_temperature: must be a finite number >= 0 (0: greedy), "
                            f"got {temperature!r}")
        return problems

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


def _plain(value: Any) -> Any:
    if hasattr(value, "to_dict"):  # a BoundConfig
        return value.to_dict()
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def _domain_sampling(section: Any) -> dict[str, dict[str, Any]]:
    """``rollout_worker.domain_sampling``: each domain's full sampling mapping (the shared
    ``sampling`` with the domain's changes over it)."""
    shared = _plain(section.get("sampling")) or {}
    changes = _plain(section.get("domain_sampling")) or {}
    return {str(d): {**shared, **(c if isinstance(c, dict) else {})} for d, c in changes.items()}


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


class PigLatinRolloutWorker(BaseRolloutWorker):
    """Supervised data for the cross-entropy trainer: the target is computed, not sampled."""

    OPTIONS = {
        "prompt_key": Option("prompt", str, "task field that holds the source text"),
        "instruction": Option("Translate to Pig Latin: ", str, "text put before the source in the prompt"),
    }
    CONFIG_KEYS = option_defaults(OPTIONS)  # deprecated view, for plugins that extend it

    def step(self, task: dict[str, Any]) -> str | None:
        source = str(task.get(self._config["prompt_key"], ""))
        instruction = str(self._config["instruction"])
        trajectory = self.base_trajectory(task)
        trajectory.update({"prompt": [{"role": "user", "content": instruction + source}],
                           "response": pig_latin(source), "reward": 1.0, "score": {"reward": 1.0},
                           "model_version": self._current_version()})
        return self._put_trajectory(trajectory)


@hookimpl
def nexrl_rollout_workers():
    return {"simple": SimpleRolloutWorker, "pig_latin": PigLatinRolloutWorker}
