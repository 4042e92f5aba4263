"""Generated tasks that ship with the core: no data files or downloads needed."""

from __future__ import annotations

import random
import re
from typing import Any

from .dataloader import BaseDataLoader
from .errors import ConfigError
from .rollout_worker import BaseRolloutWorker


class ArithmeticDataLoader(BaseDataLoader):
    """``a + b`` questions with exact integer answers, generated from a seed.

    ``split: train`` and ``split: validation`` draw from disjoint halves of the
    operand space (by a hash of the pair), so validation never repeats a training
    question.
    """

    CONFIG_KEYS = {"num_rows": 256, "min_value": 0, "max_value": 99, "split": "train",
                   "template": "What is {a} + {b}? Reply with only the number.", "data_source": "arithmetic"}

    def load_rows(self) -> list[dict[str, Any]]:
        cfg = self._config
        lo, hi = int(cfg.get("min_value", 0)), int(cfg.get("max_value", 99))
        n = int(cfg.get("num_rows", 256))
        split = str(cfg.get("split", "train"))
        if split not in ("train", "validation"):
            raise ConfigError(f"data.split: '{split}' is not one of train, validation")
        pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)
                 if ((a * 7919 + b * 104729) % 5 == 0) == (split == "validation")]
        if n > len(pairs):
            raise ConfigError(f"data.num_rows: {n} rows requested but only {len(pairs)} distinct "
                              f"{split} questions exist in [{lo}, {hi}]")
        random.Random(int(cfg.get("seed", 0) or 0) + (1 if split == "validation" else 0)).shuffle(pairs)
        template = str(cfg.get("template", self.CONFIG_KEYS["template"]))
        source = str(cfg.get("data_source", "arithmetic"))
        return [{"prompt": template.format(a=a, b=b), "answer": a + b, "data_source": source}
                for a, b in pairs[:n]]


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

    CONFIG_KEYS = {"prompt_key": "prompt", "instruction": "Translate to Pig Latin: "}

    def step(self, task: dict[str, Any]) -> str | None:
        source = str(task.get(self._config.get("prompt_key", "prompt"), ""))
        instruction = str(self._config.get("instruction", "Translate to Pig Latin: "))
        trajectory = self.base_trajectory(task)
        trajectory.update({"prompt": [{"role": "user", "content": instruction + source}],
                           "response": pig_latin(source), "reward": 1.0, "score": {"reward": 1.0},
                           "model_version": self._current_version()})
        return self._put_trajectory(trajectory)
