"""Deterministic components for tests and overhead benchmarks (registered as ``mock``).

They are real components (they run through the same controller, pool and
weight-sync paths as any plugin); only the model is replaced by a rule.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..config.options import Capabilities
from ..config.settings import Settings, setting
from ..markers import hookimpl
from ..runtime.inference import CompletionResult, InferenceClient, InferenceError, SamplingParams
from ..trainer import BaseTrainer, TrainerParts
from ..types import Trajectory

_SUM = re.compile(r"(-?\d+)\s*\+\s*(-?\d+)")


def _last_user_text(prompt: str | list[dict[str, Any]]) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
    return str(users[-1] if users else "")


def mock_sum_threshold(a: int, b: int, learn_steps: int) -> int:
    """Weight version from which the mock model answers ``a + b`` correctly."""
    return (7 * a + b) % learn_steps if learn_steps > 0 else 0


@dataclass(frozen=True, kw_only=True)
class MockInferenceSettings(Settings):
    """The mock inference backend's keys."""

    mode: Literal["echo", "sum"] = setting("echo", "echo: answer the prompt text; sum: answer 'A + B' prompts")
    learn_steps: int = setting(4, "sum mode: versions until every sum is answered right", ge=0,
                               needs=".mode == sum")
    delay_s: float = setting(0.0, "seconds each completion takes", ge=0)


class MockInferenceClient(InferenceClient):
    """``mode: echo`` answers the prompt text; ``mode: sum`` answers "A + B" prompts,
    correctly once the served version reaches :func:`mock_sum_threshold` (so
    accuracy rises with training in a way tests can compute exactly)."""

    # Its keys are read once, into the attributes below: `self.settings` is left to a subclass's own.
    SETTINGS: ClassVar[type[Settings]] = MockInferenceSettings

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        settings = MockInferenceSettings.own(self.config, "service.inference_service")
        self.mode = settings.mode
        self.learn_steps = settings.learn_steps
        self.delay_s = settings.delay_s
        self.calls = 0

    def complete(self, prompt: str | list[dict[str, Any]], params: SamplingParams) -> CompletionResult:
        version = self.model_version()
        self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        text = _last_user_text(prompt)
        if self.mode == "sum" and (m := _SUM.search(text)):
            a, b = int(m.group(1)), int(m.group(2))
            text = str(a + b if version >= mock_sum_threshold(a, b, self.learn_steps) else a + b + 1)
        text = text[: params.max_tokens]
        ids = list(text.encode())
        return CompletionResult(text=text, finish_reason="stop", prompt_token_ids=list(_last_user_text(prompt).encode()),
                                response_token_ids=ids, response_logprobs=[-0.5] * len(ids), model_version=version)

    def complete_many(self, requests: list[tuple[Any, SamplingParams]]) -> list[CompletionResult | InferenceError]:
        return [self.complete(prompt, params) for prompt, params in requests]  # instant: no threads needed

    def num_calls(self) -> int:
        """Completions served so far (public: reachable through a handle in any launch mode)."""
        return self.calls


@dataclass(frozen=True, kw_only=True)
class MockTrainerSettings(Settings):
    """The mock trainer's ``trainer`` keys."""

    step_time_s: float = setting(0.0, "seconds each training step takes", ge=0)


class MockTrainer(BaseTrainer):
    """Trains nothing; remembers what it was given (tests check the data flow with it)."""

    # Exports an (empty) state dict, so it stands in for a self-hosted trainer with any in-process
    # weight sync; its weights never change, so it needs none.
    CAPABILITIES = Capabilities(provides=frozenset({"trainer:state_dict"}))
    NO_MODEL_STATE = True  # nothing to save: its checkpoints resume exactly

    SETTINGS: ClassVar[type[Settings]] = MockTrainerSettings

    def __init__(self, config: Mapping[str, Any], parts: TrainerParts | None = None):
        super().__init__(config, parts)
        # Read once, into an attribute: `self.settings` is left to a subclass's own (tests extend it).
        self.step_time_s = MockTrainerSettings.own(self._config, "trainer").step_time_s
        self.batches: list[list[Trajectory]] = []

    def train(self, trajectories: list[Trajectory]) -> dict[str, float]:
        if self.step_time_s:
            time.sleep(self.step_time_s)
        self.batches.append(trajectories)
        return {"train/loss": 0.0}

    def get_batches(self) -> list[list[Trajectory]]:
        """Every batch trained on so far (public: reachable through a handle in any launch mode)."""
        return self.batches

    def export_weights(self) -> dict[str, Any]:
        return {}


@hookimpl
def nexrl_trainers():
    return {"mock": MockTrainer}


@hookimpl
def nexrl_inference_backends():
    return {"mock": MockInferenceClient}
