"""The seed's NexAU rollout workers: an agent per task, trained on exactly the tokens it produced.

Recipe keys (``rollout_worker.*``): :class:`NexAUWorkerSettings`, besides the core's
``type``, ``num_workers``, ``seed``, ``evaluator``, ``reward_range`` and ``validate_temperature``
(reference: docs/recipe.md; guide: docs/agents.md).

A trajectory holds the first token sequence at the top level (``prompt_token_ids``,
``response_token_ids``, ``response_logprobs``, ``loss_mask`` with one 0/1 per response token)
and, when the run needed more than one sequence, all of them in ``segments``. It records why
the run ended (``stop_reason``: answered / max_iterations / truncated), whether a sequence was
cut (``truncated``, ``truncation_reason``), and counts of model calls, tool calls and tool errors
(also in ``score``, so validation reports them). A run whose inference call failed is a failed
item (``errors.jsonl``), never a trajectory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from loguru import logger

from nexrl_core import (
    BaseEvaluationTarget,
    BaseRolloutWorker,
    ConfigError,
    ItemFailure,
    RolloutParts,
    SamplingParams,
    Settings,
    Trajectory,
    execute,
    setting,
)

from .agent_config import load_agent_spec
from .runner import AgentRunner, AgentRunResult
from .trajectory import TraceError, call_masks, llm_calls, token_sequences, truncate

_QUERY_KEYS = ("prompt", "query", "question")
_MESSAGE_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, kw_only=True)
class NexAUWorkerSettings(Settings):
    """The ``rollout_worker.*`` keys of the NexAU workers (the core's are the rollout worker's)."""

    nexau_agent_config_path: str = setting(help="the agent YAML (NexAU's format)")
    nexau_agent_workspace: str | None = setting(None, "folder tool bindings are imported from (null: the agent "
                                                      "YAML's folder)")
    agent_runner: Literal["auto", "builtin", "nexau"] = setting("auto", "builtin: nexrl's runner; nexau: NexAU "
                                                                        "itself; auto: NexAU when importable")
    prompt_key: str | None = setting(None, "task field holding the query (null: the first of prompt, query, "
                                           "question)")
    # Partial overrides of the agent's llm_config: SamplingParams.recipe_problems checks them (check_config).
    sampling: dict[str, object] = setting({}, "max_tokens / temperature / top_p / top_k / stop of every model call, "
                                              "over the agent's llm_config")
    few_shot: list[dict[str, object]] = setting([], "demonstration messages (role + content) between the system "
                                                    "prompt and every query; never trained on")
    tool_timeout: float = setting(30.0, "seconds a tool call may take", gt=0)
    max_tool_output_chars: int = setting(8000, "longer tool results are cut (with a note)", ge=1)
    max_sequence_length: int | None = setting(None, "tokens of one training sequence, prompt included (null: no "
                                                    "limit); longer ones are cut", ge=1)
    truncated_reward: float | None = setting(0.0, "reward of a rollout cut at max_sequence_length (null: the "
                                                  "evaluator's)", needs=".max_sequence_length")
    enable_trace_prefix_merge: bool = setting(True, "merge model calls that share a token prefix into one sequence")
    save_trace: bool = setting(False, "write every rollout's trace as JSON to trace_path")
    trace_path: str | None = setting(None, "folder of the saved traces", needs=".save_trace")
    task_name: str | None = setting(None, "a name for logs and trace files")


class NexAUTrajectory(Trajectory, total=False):
    """A NexAU rollout: the core's keys and the agent's own (docs/agents.md), which the pool and the
    trainers carry along."""

    stop_reason: str  # answered / max_iterations / truncated
    truncated: bool  # a sequence was cut at max_sequence_length
    truncation_reason: str | None
    num_segments: int
    tool_error_kinds: dict[str, int]  # error kind -> count
    num_llm_calls: int
    num_tool_calls: int
    tool_errors: int


@dataclass
class NexAUEvaluationTarget(BaseEvaluationTarget):
    """What an agent's evaluator sees: the final answer, the whole conversation, and how it ended."""

    final_answer: str
    observation: list[dict[str, Any]] = field(default_factory=list)
    is_truncated: bool = False
    stop_reason: str = "answered"


class BaseNexAURolloutWorker(BaseRolloutWorker):
    """Runs a multi-turn, tool-using agent (NexAU's agent YAML) on every task and trains on the tokens
    the model wrote: tool outputs and prompts are in the sequence with ``loss_mask`` 0.

    Override points (the seed's): :meth:`format_task_query` (task -> the agent's query),
    :meth:`get_train_loss_mask` (which model replies are trained on), :meth:`run_agent` (the
    whole pipeline). :meth:`execute_agent` runs the agent and may be replaced to drive another
    agent framework, as long as it returns an :class:`AgentRunResult` with a trace.
    """

    SETTINGS = NexAUWorkerSettings

    def __init__(self, config: Mapping[str, Any], parts: RolloutParts | None = None):
        super().__init__(config, parts)
        self.settings = settings = NexAUWorkerSettings.own(self._config, "rollout_worker")
        problems = self.settings_problems(settings)
        if problems:
            raise ConfigError("; ".join(problems))
        self._trace_path = settings.trace_path if settings.save_trace else None
        self._validate_temperature = self._config["validate_temperature"]  # the core's rollout_worker key
        self.agent_spec = load_agent_spec(settings.nexau_agent_config_path, settings.nexau_agent_workspace)
        self._sampling = SamplingParams.from_config({**self.agent_spec.sampling_defaults(), **settings.sampling})
        self.runner_kind = _choose_runner(settings.agent_runner)
        if self.runner_kind == "builtin":
            self.runner: Any = AgentRunner(self.agent_spec, settings.tool_timeout, settings.max_tool_output_chars,
                                           settings.few_shot)
        else:
            from .nexau_adapter import NexAUAgentRunner

            self.runner = NexAUAgentRunner(self.agent_spec, settings.tool_timeout, settings.few_shot)
        if self._trace_path:
            os.makedirs(self._trace_path, exist_ok=True)

    @classmethod
    def check_config(cls, section: Mapping[str, Any], key: str = "rollout_worker") -> list[str]:
        """The rules beyond the declared options (``nexrl validate`` and the constructor run both):
        the agent YAML and its tool bindings load, NexAU is importable when asked for, sampling
        keys and few-shot messages are well formed, a saved trace has a folder."""
        settings, problems = NexAUWorkerSettings.parse(section, key, own=True)
        return problems if settings is None else cls.settings_problems(settings, key)

    @staticmethod
    def settings_problems(settings: NexAUWorkerSettings, key: str = "rollout_worker") -> list[str]:
        """:meth:`check_config`'s rules, on settings that have their declared types."""
        problems = []
        path = settings.nexau_agent_config_path
        try:
            spec = load_agent_spec(path, settings.nexau_agent_workspace)
            from .tools import resolve_binding

            for tool in spec.tools:
                if not tool.lazy:
                    resolve_binding(tool.binding, spec.workspace, f"{path}: tool '{tool.name}'")
        except ConfigError as exc:
            problems.append(f"{key}.nexau_agent_config_path: {exc}")
        if settings.agent_runner == "nexau" and not _nexau_importable():
            problems.append(f"{key}.agent_runner: 'nexau' needs the nexau package (github.com/nex-agi/NexAU, not on "
                            f"PyPI), which is not importable here; use 'builtin' or 'auto'")
        problems += SamplingParams.recipe_problems(settings.sampling, f"{key}.sampling")
        if not all(m.get("role") in _MESSAGE_ROLES and isinstance(m.get("content"), str) for m in settings.few_shot):
            problems.append(f"{key}.few_shot: expected a list of chat messages, each with a role (system, user, "
                            f"assistant, tool) and a string content")
        if settings.save_trace and not settings.trace_path:
            problems.append(f"{key}.trace_path: required when save_trace is true")
        return problems

    # -- the seed's override points ----------------------------------------------------------
    def format_task_query(self, data_item: dict[str, Any]) -> str | list[dict[str, Any]]:
        """The agent's query for a task: its ``prompt_key`` field (default: the first of
        ``prompt``, ``query``, ``question``). A list of chat messages opens the conversation."""
        keys = [self.settings.prompt_key] if self.settings.prompt_key else _QUERY_KEYS
        for name in keys:
            value = data_item.get(name)
            if value not in (None, ""):
                return value if isinstance(value, list) else str(value)
        raise ItemFailure("missing_prompt", f"task has none of the fields {', '.join(keys)}")

    def get_train_loss_mask(self, trajectory_infos: list[dict[str, Any]]) -> list[Any]:
        """Which model replies get gradient: one entry per LLM call, ``True``/``False`` for the
        whole reply or a list of 0/1 per reply token. Prompts and tool outputs never do.
        Default: every reply."""
        return [True] * len(trajectory_infos)

    def step(self, task: dict[str, Any]) -> str | None:
        return self.run_agent(task)

    def run_agent(self, task: dict[str, Any]) -> str | None:
        """Query -> agent run (traced) -> LLM calls -> token sequences with loss masks ->
        truncation -> evaluator -> trajectory -> pool (or validator)."""
        query = self.format_task_query(task)
        params = self.sampling_params(task)
        result = self.execute_agent(query, params, task)
        if result.stop_reason == "error":
            raise ItemFailure("agent_error", f"agent run failed: {result.error}")
        try:
            infos = llm_calls(result.trace)
        except TraceError as exc:
            raise ItemFailure("bad_trace", str(exc)) from None
        if not infos:
            raise ItemFailure("no_llm_calls", "the agent's trace holds no completed LLM call")
        try:
            masks = call_masks(infos, self.get_train_loss_mask(infos))
        except ValueError as exc:
            raise ItemFailure("bad_loss_mask", str(exc)) from None
        settings = self.settings
        sequences = [truncate(s, settings.max_sequence_length)
                     for s in token_sequences(infos, masks, settings.enable_trace_prefix_merge)]
        truncated = any(s.truncated for s in sequences)
        target = NexAUEvaluationTarget(final_answer=result.final_answer, observation=result.messages,
                                       is_truncated=truncated, stop_reason=result.stop_reason)
        evaluation = self.evaluate(task, target)
        reward = float(evaluation.reward)
        if truncated and settings.truncated_reward is not None:
            reward = float(settings.truncated_reward)
        segments = [s.as_trajectory_fields() for s in sequences]
        versions = [i["model_version"] for i in infos if i["model_version"] is not None and i["model_version"] >= 0]
        counts = {"num_llm_calls": float(result.num_llm_calls), "num_tool_calls": float(result.num_tool_calls),
                  "tool_errors": float(result.num_tool_errors),
                  "called_tool": float(result.num_tool_calls - result.num_tool_errors > 0),
                  "answered": float(result.stop_reason == "answered"), "truncated": float(truncated)}
        trajectory: NexAUTrajectory = {
            **self.base_trajectory(task),
            **segments[0],
            "prompt": infos[0]["prompt_messages"],
            "response": result.final_answer,
            "finish_reason": infos[-1]["finish_reason"],
            "stop_reason": result.stop_reason,
            "truncated": truncated,
            "truncation_reason": "max_sequence_length" if truncated else None,
            "num_segments": len(segments),
            "tool_error_kinds": dict(result.tool_errors),
            "sampling": params.as_record(),
            "model_version": min(versions) if versions else self._current_version(),
            "reward": reward,
            "ground_truth": evaluation.ground_truth,
            "score": {"reward": reward, **{k: float(v) for k, v in evaluation.metrics.items()}, **counts},
            "extra_info": evaluation.extra_info,
            "num_llm_calls": result.num_llm_calls,
            "num_tool_calls": result.num_tool_calls,
            "tool_errors": result.num_tool_errors,
        }
        if len(segments) > 1:
            trajectory["segments"] = [dict(s) for s in segments]
        if self._trace_path:
            self._save_trace(self._trace_path, task, result, trajectory)
        return self._put_trajectory(trajectory)

    # -- helpers -------------------------------------------------------------------------------
    def sampling_params(self, task: dict[str, Any]) -> SamplingParams:
        """This task's sampling: the configured values, its own seed, greedy-or-not for validation."""
        params = dataclasses.replace(self._sampling, seed=self.sampling_seed(task))
        if self._task_is_validation and self._validate_temperature is not None:
            params.temperature = float(self._validate_temperature)
        return params

    def execute_agent(self, query: str | list[dict[str, Any]], params: SamplingParams,
                      task: dict[str, Any]) -> AgentRunResult:
        """One traced agent run, sampling through this worker's inference client."""
        return self.runner.run(query, self._chat, params, variables=task)

    def _chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, params: SamplingParams) -> Any:
        return execute(self._llm_client.chat, messages, params, tools)

    def _save_trace(self, folder: str, task: dict[str, Any], result: AgentRunResult,
                    trajectory: NexAUTrajectory) -> None:
        name = f"{self.settings.task_name or 'task'}_{task.get('uid')}_{task.get('sample_index', 0)}" \
               f"_v{trajectory['model_version']}{'_val' if self._task_is_validation else ''}.json"
        path = os.path.join(folder, "".join(c if c.isalnum() or c in "._-" else "_" for c in name))
        record = {"uid": task.get("uid"), "sample_index": task.get("sample_index"), "stop_reason": result.stop_reason,
                  "reward": trajectory["reward"], "final_answer": result.final_answer, "messages": result.messages,
                  "trace": result.trace}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f, ensure_ascii=False, indent=1, default=str)


DefaultNexAURolloutWorker = BaseNexAURolloutWorker  # the seed's name for the complete default


def _choose_runner(kind: str) -> str:
    if kind == "builtin":
        return "builtin"
    if kind == "auto" and not _nexau_importable():
        logger.info("NexAU (github.com/nex-agi/NexAU, not on PyPI) is not importable: agents run on nexrl's "
                    "built-in runner, which reads the same agent YAML (rollout_worker.agent_runner: builtin to "
                    "choose it explicitly)")
        return "builtin"
    if not _nexau_importable():
        raise ConfigError("rollout_worker.agent_runner: 'nexau' needs the nexau package, which is not importable")
    logger.info("NexAU is importable: agents run on NexAU itself (rollout_worker.agent_runner: builtin to change)")
    return "nexau"


def _nexau_importable() -> bool:
    """NexAU's package (its tracer module, not just any folder named nexau) can be imported."""
    import importlib.util

    try:
        return importlib.util.find_spec("nexau.archs.tracer.adapters.in_memory") is not None
    except (ImportError, ValueError):
        return False


