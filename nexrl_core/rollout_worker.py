"""Rollout workers: take a task, ask the inference service, score it, hand the trajectory on."""

from __future__ import annotations

import math
import os
import sys
import zlib
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

from loguru import logger

from .errors import ErrorSeverity
from .evaluation import BaseEvaluationTarget, EvaluationRunResult, Evaluator
from .protocols import TaskSource, TrajectorySink, WeightSyncHandle, wired
from .runtime.eval_core import DEFAULT_DATA_SOURCE
from .runtime.execute import execute
from .runtime.inference import CompletionResult, InferenceClient, InferenceError, SamplingParams, completion_record
from .runtime.logs import failure_location, failure_signature, format_traceback
from .runtime.threaded import ThreadedModule
from .types import DEFAULT_MODEL_TAG, Trajectory

_IDLE_WAIT_S = 0.05


class ItemFailure(Exception):
    """A task that cannot produce a usable trajectory; ``cause`` goes to errors.jsonl, with
    ``response`` (the reply that could not be used, when there is one)."""

    def __init__(self, cause: str, message: str, response: str | None = None,
                 severity: ErrorSeverity = ErrorSeverity.WARNING):
        super().__init__(message)
        self.cause = cause
        self.response = response
        self.severity = severity  # ERROR: a plugin bug, which the default error policy stops the run on


class BaseRolloutWorker(ThreadedModule):
    """Thread loop of the seed: fetch task -> :meth:`step` -> pool or validator.

    ``step`` returns "success", "fail", "re-rollout" (the task goes back to the
    front of its data loader) or None. Exceptions are never swallowed: the task
    becomes a *failed* trajectory (so its group still completes and validation
    still counts it) and the cause is recorded in the run's errors.jsonl (training items once
    the trainer consumes them; see docs/reliability.md).

    Built as ``cls(config, parts)``: the ``rollout_worker`` mapping and the evaluators it names
    (:class:`RolloutParts`, built by the launcher in the worker's process); the inference client
    and the other modules arrive as handles in :meth:`set_module_references`, once all are built.
    A subclass that defines ``__init__`` takes ``parts`` and hands them on.
    """

    def __init__(self, config: Mapping[str, Any], parts: RolloutParts | None = None):
        """``parts``: None (built by hand) is no evaluator."""
        super().__init__()
        from .config.options import component_options
        from .config.schema import RolloutWorkerSettings
        from .config.settings import read_section

        # The section, a copy (a subclass reads its own keys with its Settings' own(self._config)).
        self._config = read_section(config, {**(component_options(type(self)) or {}),
                                             **RolloutWorkerSettings.options()}, "rollout_worker")
        #: the core's keys of the section, typed
        self.core_settings = core = RolloutWorkerSettings.own(self._config, "rollout_worker")
        self._llm_client: Any = None  # the inference client, wrapped for seed-style calls (_SeedClient)
        parts = parts or RolloutParts()
        self._evaluator = parts.evaluator
        self._evaluator_label = parts.evaluator_label
        self._worker_label = parts.worker_label or f"rollout worker {type(self).__name__}"
        # A task's `domain` picks its evaluator (multi-domain data); others use the default one.
        self._domain_evaluators = dict(parts.domain_evaluators)
        self._domain_labels: dict[Any, str] = dict(parts.domain_labels)  # a task's domain (None: none) -> label
        self._model_tag = DEFAULT_MODEL_TAG
        self._seed = core.seed
        self._reward_range = core.reward_range  # read once: not on the per-task path
        self._is_running_validate = False
        self._task_is_validation = False  # mode of the task in hand (the flag may flip meanwhile)
        self._task_version = 0
        self._trajectory_pool: TrajectorySink | None = None
        self._dataloader: TaskSource | None = None
        self._weight_sync_controller: WeightSyncHandle | None = None
        self._validate_dataloader: TaskSource | None = None
        self._validator: TrajectorySink | None = None
        self.completed = 0
        self._puts_this_task = 0  # trajectories submitted for the task in hand
        self._tasks_per_call = core.tasks_per_call
        self._idle_wait_s = _IDLE_WAIT_S
        # While running several tasks: (task number, destination, trajectory) held for one call each.
        self._held: list[tuple[int, Any, Trajectory]] | None = None
        self._task_number = 0
        self._task_in_hand: dict[str, Any] | None = None  # what a plain-dict trajectory is filled in from
        self._calls_this_task = 0  # model calls made for the task in hand (each gets its own seed)
        # id(task) -> (prompt, params, answer) of a first call asked in advance (prepare_tasks)
        self._prepared: dict[int, tuple[Any, SamplingParams, CompletionResult | Exception]] = {}
        # id(task) -> (evaluator, reply, result) scored with the other tasks of a call (evaluate_in_advance)
        self._evaluated: dict[int, tuple[Evaluator, str, EvaluationRunResult | Exception]] = {}
        self._last_completion: dict[str, Any] | None = None  # the seed-style call's answer, for the same

    def set_module_references(self, trajectory_pool: TrajectorySink | None, dataloader: TaskSource | None,
                              weight_sync_controller: WeightSyncHandle | None,
                              validate_dataloader: TaskSource | None, validator: TrajectorySink | None,
                              inference_client: InferenceClient | None = None) -> None:
        """The seed's references, plus the inference service this worker samples from (a handle:
        in local mode the one client every worker shares, so an in-process engine batches across them)."""
        self._trajectory_pool = trajectory_pool
        self._dataloader = dataloader
        self._weight_sync_controller = weight_sync_controller
        self._validate_dataloader = validate_dataloader
        self._validator = validator
        self._llm_client = None if inference_client is None else _SeedClient(inference_client, self)
        if inference_client is not None:
            self._model_tag = str(execute(inference_client.get_model_tag))

    def set_idle_wait(self, seconds: float) -> None:
        """How long the loop waits for a rollout slot or a task before it looks at its mode again
        (validation starting). The launch mode sets it: where each wait is a call to another
        process, a longer one costs fewer calls while rollouts are held back."""
        self._idle_wait_s = float(seconds)

    # -- lifecycle (the thread itself: ThreadedModule) ---------------------------------
    def begin_validate(self) -> None:
        self._is_running_validate = True

    def end_validate(self) -> None:
        self._is_running_validate = False

    # -- loop -------------------------------------------------------------------------
    def _main_loop(self) -> None:
        while not self._should_stop():
            validating = self._is_running_validate
            wsc = None if validating else self._weight_sync_controller
            admitted = self._tasks_per_call
            if wsc is not None:
                # begin_rollout(s) admits tasks (sync mode starts no more rollouts than one batch needs)
                if admitted > 1:
                    admitted = execute(wsc.begin_rollouts, self._model_tag, admitted)
                elif execute(wsc.check_rollout_service_status, self._model_tag) == "block" or \
                        not execute(wsc.begin_rollout, self._model_tag):
                    admitted = 0
                if not admitted:
                    execute(wsc.wait_rollout_allowed, self._model_tag, self._idle_wait_s)
                    continue
            loader = self._loader(validating)
            tasks: list[dict[str, Any]] = []
            landed = 0
            try:
                with self._activity_tracker.track(self._module_name, "validate" if validating else "rollout"):
                    if admitted == 1:
                        task = execute(loader.get_next_item)
                        tasks = [] if task is None else [task]
                        landed = sum(bool(self._run_task(t, validating)) for t in tasks)
                    else:
                        tasks = execute(loader.get_next_items, admitted)
                        landed = self._run_tasks(tasks, validating)
            finally:
                if wsc is not None:
                    if admitted == 1:
                        execute(wsc.end_rollout, self._model_tag, landed == 1)
                    else:
                        execute(wsc.end_rollouts, self._model_tag, landed, admitted - landed)
            if not tasks:
                execute(loader.wait_for_item, self._idle_wait_s)

    def _run_tasks(self, tasks: list[dict[str, Any]], validating: bool) -> int:
        """Several tasks, their trajectories handed on in one call per destination (``tasks_per_call``);
        returns how many went on (the others were re-queued)."""
        self._held, done = [], []
        version = self._current_version()  # the tasks were admitted together, at this version
        self._task_version, self._task_is_validation = version, validating
        try:
            self.prepare_tasks(tasks)
        except Exception as exc:  # each task then does its own work (and fails on its own)
            logger.warning(f"{self._module_name}: preparing {len(tasks)} tasks failed ({type(exc).__name__}: {exc})")
        try:
            for number, task in enumerate(tasks):
                self._task_number = number
                done.append(bool(self._run_task(task, validating, version)))
        finally:
            held, self._held = self._held, None
        by_target: dict[int, tuple[Any, list[tuple[int, Trajectory]]]] = {}
        for i, target, trajectory in held:
            by_target.setdefault(id(target), (target, []))[1].append((i, trajectory))
        last: dict[int, str] = {}  # task -> result of its last put (what step() returns locally)
        for target, items in by_target.values():
            results = execute(target.put_trajectories, [t for _, t in items])
            for (i, _), result in zip(items, results):
                last[i] = result
        landed = 0
        for i, task in enumerate(tasks):
            if done[i] and last.get(i) == "re-rollout":  # e.g. the pool was locked for a weight push
                self.completed -= 1
                self._put_rollout_task(task, validating)
            else:
                landed += int(done[i])
        return landed

    def _run_task(self, task: dict[str, Any], validating: bool, version: int | None = None) -> bool:
        """Run one task; True when its trajectory went on (False: the task was re-queued).
        ``version``: the served weight version (read here when not given)."""
        self._task_is_validation = validating
        # what a failed attempt is stamped with, and what seeds its sampling
        self._task_version = self._current_version() if version is None else version
        self._puts_this_task = 0
        self._task_in_hand, self._last_completion, self._calls_this_task = task, None, 0
        try:
            result = self.step(task)
            if result != "re-rollout" and self._puts_this_task == 0:
                # step() gave up without a trajectory: record it as failed, never drop it silently
                # (its group could never complete; validation would miss a sample).
                raise ItemFailure("no_trajectory", f"{type(self).__name__}.step returned {result!r} "
                                                   f"without submitting a trajectory")
        except ItemFailure as exc:
            result = self._put_failed(task, exc.cause, str(exc), validating, exc.response, exc.__cause__,
                                      exc.severity)
        except InferenceError as exc:
            result = self._put_failed(task, "rollout_failure", str(exc), validating)
        except Exception as exc:  # a bug in a plugin: record it (an ERROR), keep the item accounted for
            where = failure_location(exc, _code_folder(self))
            result = self._put_failed(task, "worker_exception", f"{self._worker_label} raised {type(exc).__name__}: "
                                      f"{exc}{f' ({where})' if where else ''}", validating, error=exc,
                                      severity=ErrorSeverity.ERROR)
        if result == "re-rollout":
            self._put_rollout_task(task, validating)
            return False
        if result == "success":
            self.completed += 1
        return True

    # -- subclass API -----------------------------------------------------------------------
    def prepare_tasks(self, tasks: list[dict[str, Any]]) -> None:
        """Called before :meth:`step` runs on each of several tasks taken in one call
        (``tasks_per_call`` > 1), e.g. to ask the inference service for all of them at once
        (:meth:`prepare_first_calls`). :meth:`sampling_seed` already gives their seeds here."""

    def prepare_first_calls(self, requests: list[tuple[dict[str, Any], str | list[dict[str, Any]]]]) -> None:
        """Ask for each ``(task, prompt)``'s first completion in one ``complete_many`` call; the
        task's first :meth:`complete` with that prompt and the worker's sampling gets the answer
        from here (any other first call asks the model itself)."""
        asked = []
        for task, prompt in requests:
            self._calls_this_task = 0  # each as its own first call: the seed step() would give it
            asked.append((prompt, self._call_params(task, None)))
        self._calls_this_task = 0
        answers = execute(wired(self._llm_client, "inference client").complete_many, asked)
        self._prepared = {id(task): (prompt, params, answer)
                          for (task, _), (prompt, params), answer in zip(requests, asked, answers)}

    @abstractmethod
    def step(self, task: dict[str, Any]) -> str | None:
        """Process one task; submit with :meth:`_put_trajectory`; return its result."""

    def _put_trajectory(self, trajectory: Trajectory) -> str:
        if not trajectory.get("failed"):
            self._fill_in(cast(dict[str, Any], trajectory))
            self._check_trajectory(trajectory)
        self._puts_this_task += 1
        trajectory.setdefault("model_tag", self._model_tag)
        trajectory.setdefault("rollout_worker", self._worker_label)  # named when a trainer refuses it
        target = wired(self._validator, "validator") if self._is_validation_task(trajectory) else \
            wired(self._trajectory_pool, "trajectory pool")
        if self._held is not None:  # handed on with the other tasks' (see _run_tasks)
            self._held.append((self._task_number, target, trajectory))
            return "success"
        return execute(target.put_trajectory, trajectory)

    def _fill_in(self, trajectory: dict[str, Any]) -> None:
        """What a worker written against the seed's guide leaves out of its plain dict, filled in
        from the task in hand (``uid``, ``sample_index``, ``data_source``, ... of
        :meth:`base_trajectory`), from this task's last ``self._llm_client.completion`` /
        ``generate`` answer when the trajectory's ``response`` is that answer's (token ids,
        log-probs, the ``sampling`` record, ``model_version``), and a ``reward`` from the recipe's
        evaluator when the worker set none. Keys the worker set are kept; ``token_versions``, when
        the worker set none, is ``model_version`` for every response token."""
        task = self._task_in_hand
        if task is None:
            return
        for key, value in self.base_trajectory(task).items():
            trajectory.setdefault(key, value)
        last = self._last_completion
        if last is not None and trajectory.get("response") == last.get("response"):
            for key in COMPLETION_KEYS:
                if trajectory.get(key) is None and last.get(key) is not None:
                    trajectory[key] = last[key]
            if not isinstance(trajectory.get("model_version"), int) or trajectory["model_version"] < 0:
                trajectory["model_version"] = self._task_version
        trajectory.setdefault("model_version", self._task_version)
        response_ids = trajectory.get("response_token_ids")
        if trajectory.get("token_versions") is None and isinstance(response_ids, (list, tuple)) \
                and isinstance(trajectory["model_version"], int):
            trajectory["token_versions"] = [trajectory["model_version"]] * len(response_ids)
        if "reward" not in trajectory and isinstance(trajectory.get("response"), str) \
                and self.evaluator_for(task) is not None:
            evaluation = self.evaluate(task, trajectory["response"])
            trajectory["reward"] = float(evaluation.reward)
            trajectory.setdefault("ground_truth", evaluation.ground_truth)
            trajectory.setdefault("score", {"reward": float(evaluation.reward),
                                            **{k: float(v) for k, v in evaluation.metrics.items()}})
            trajectory.setdefault("extra_info", evaluation.extra_info)

    def _check_trajectory(self, trajectory: Trajectory) -> None:
        """The contract every trajectory a worker hands on keeps: a finite number ``reward`` (a
        trajectory that could not be scored is a failed one instead). Never a silent 0."""
        reward = trajectory.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            what = "without a 'reward'" if reward is None else f"with reward {reward!r}"
            raise ItemFailure("bad_trajectory", f"{self._worker_label} handed on a trajectory {what}: every trajectory "
                                                f"needs a finite number 'reward' (one that could not be scored is "
                                                f"a failed one: raise ItemFailure)", severity=ErrorSeverity.ERROR)

    def _put_rollout_task(self, task: dict[str, Any], validating: bool = False) -> bool:
        execute(self._loader(validating).add_item_front, task)
        return True

    def _loader(self, validating: bool) -> TaskSource:
        if validating:
            return wired(self._validate_dataloader, "validation data loader")
        return wired(self._dataloader, "data loader")

    def _is_validation_task(self, trajectory: Trajectory) -> bool:
        return bool(trajectory.get("is_validation"))

    # -- the model call ------------------------------------------------------------------------
    def complete(self, prompt: str | list[dict[str, Any]], sampling: SamplingParams | dict[str, Any] | None = None,
                 *, tools: list[dict[str, Any]] | None = None) -> CompletionResult:
        """One completion of ``prompt`` (text, or chat messages) from the inference service, for the
        task in hand: the worker's sampling (:meth:`sampling_params`) with ``sampling``'s keys over
        it, seeded per task and call (the same task at the same weights samples the same text; a
        second call of the task gets a seed of its own), at the validation temperature for a
        validation task. ``tools`` (OpenAI ``tools`` entries) ask for a chat reply that may call
        them (``result.tool_calls``). Call it from :meth:`step` as often as the rollout needs.

        Returns a :class:`CompletionResult`: ``text``, ``finish_reason``, the token ids and
        log-probs, ``model_version`` and ``sampling`` (the record of what it was asked with).
        :meth:`completion_trajectory` turns one into the trajectory a trainer reads. A failed call
        raises :class:`InferenceError` (the task becomes a failed trajectory, ``rollout_failure``).
        """
        task = self._task_in_hand or {}
        first_call = self._calls_this_task == 0
        params = self._call_params(task, sampling)
        prepared = self._prepared.pop(id(task), None) if first_call else None
        client = wired(self._llm_client, "inference client")
        if prepared is not None and not tools and prepared[0] == prompt and prepared[1] == params:
            answer = prepared[2]  # asked with the other tasks of the call (prepare_tasks)
            if isinstance(answer, Exception):
                raise answer
            result = answer
        elif tools:
            if not isinstance(prompt, list):
                prompt = [{"role": "user", "content": str(prompt)}]
            result = execute(client.chat, prompt, params, tools)
        else:
            result = execute(client.complete, prompt, params)
        result.sampling = params.as_record()
        self._last_completion = completion_record(prompt, params, result)
        return result

    def sampling_params(self, task: dict[str, Any]) -> SamplingParams:
        """The sampling a call for ``task`` starts from (a seed set here is kept; else each call gets
        its own): the defaults here; the simple worker's are the recipe's ``rollout_worker.sampling``
        (per domain, at the validation temperature for a validation task)."""
        return SamplingParams()

    def _call_params(self, task: dict[str, Any], sampling: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """What the next call for ``task`` is sampled with, its seed included (and counts the call)."""
        if isinstance(sampling, SamplingParams):
            params = sampling
        else:
            params = self.sampling_params(task)
            if sampling:
                unknown = sorted(set(sampling) - set(SamplingParams.__dataclass_fields__))
                if unknown:
                    raise TypeError(f"complete(sampling=...): unknown sampling keys {unknown} (those of "
                                    f"SamplingParams: {sorted(SamplingParams.__dataclass_fields__)})")
                params = replace(params, **sampling)
        call, self._calls_this_task = self._calls_this_task, self._calls_this_task + 1
        if params.seed is None:
            seed = self.sampling_seed(task)
            params = replace(params, seed=seed if call == 0 else zlib.crc32(f"{seed}|call {call}".encode()))
        return params.check()

    def completion_trajectory(self, task: dict[str, Any], prompt: str | list[dict[str, Any]],
                              result: CompletionResult) -> Trajectory:
        """The trajectory of one completion: the task's ids (:meth:`base_trajectory`), the prompt, the
        reply with its token ids, log-probs, ``sampling``, ``model_version`` and ``token_versions``
        (the version of each response token: the backend's, else ``model_version`` for every one),
        and the reward and metrics of the task's evaluator on the reply. Hand it on with
        :meth:`_put_trajectory` (after adding keys of your own, if any)."""
        version = result.model_version if result.model_version >= 0 else self._current_version()
        token_versions = completion_token_versions(result, version)
        evaluation = self.evaluate(task, result.text)
        trajectory = self.base_trajectory(task)
        trajectory.update(cast(Trajectory, {  # a backend may leave token ids out: the trainer says so
            "prompt": prompt,
            "response": result.text,
            "finish_reason": result.finish_reason,
            "prompt_token_ids": result.prompt_token_ids,
            "response_token_ids": result.response_token_ids,
            "response_logprobs": result.response_logprobs,
            "sampling": result.sampling,  # what produced these tokens: the trainer scores with it
            "model_version": version,
            "token_versions": token_versions,
            "reward": float(evaluation.reward),
            "ground_truth": evaluation.ground_truth,
            "score": {"reward": float(evaluation.reward), **{k: float(v) for k, v in evaluation.metrics.items()}},
            "extra_info": evaluation.extra_info,
        }))
        return trajectory

    # -- helpers for subclasses -------------------------------------------------------------
    def sampling_seed(self, task: dict[str, Any]) -> int:
        """Per-request seed: the same task at the same weights samples the same text (the weights
        served when the task started)."""
        version = self._task_version
        key = f"{self._seed}|{task.get('uid')}|{task.get('sample_index')}|{self._task_is_validation}|{version}"
        return zlib.crc32(key.encode())

    def evaluator_for(self, task: dict[str, Any]) -> Evaluator | None:
        """The evaluator of the task's ``domain`` (``rollout_worker.domain_evaluators``), else the
        default ``rollout_worker.evaluator``."""
        domain = task.get("domain")
        if domain is not None and domain in self._domain_evaluators:
            return self._domain_evaluators[domain]
        return self._evaluator

    def evaluate_in_advance(self, replies: list[tuple[dict[str, Any], str]]) -> None:
        """Score each ``(task, reply)`` now, one ``evaluate_many`` call per evaluator (a batch for
        TRL-style reward functions); :meth:`evaluate` of that task and reply then takes the result
        from here (and checks it as it checks any)."""
        by_evaluator: dict[int, tuple[Evaluator, list[tuple[dict[str, Any], str]]]] = {}
        for task, reply in replies:
            evaluator = self.evaluator_for(task)
            if evaluator is not None:
                by_evaluator.setdefault(id(evaluator), (evaluator, []))[1].append((task, reply))
        self._evaluated = {}
        for evaluator, items in by_evaluator.values():
            try:
                results = evaluator.evaluate_many([(t, BaseEvaluationTarget(final_answer=r)) for t, r in items])
            except Exception:  # each task is scored on its own in evaluate(), where a failure is recorded
                continue
            for (task, reply), result in zip(items, results):
                self._evaluated[id(task)] = (evaluator, reply, result)

    def evaluate(self, task: dict[str, Any], final_answer: str | BaseEvaluationTarget) -> EvaluationRunResult:
        """Score ``final_answer`` (a string, or a richer target such as an agent's) with the task's
        evaluator."""
        evaluator = self.evaluator_for(task)
        if evaluator is None:
            return EvaluationRunResult()
        label = self._domain_labels.get(task.get("domain"), self._evaluator_label)
        cls_name = type(evaluator).__name__
        target = final_answer if isinstance(final_answer, BaseEvaluationTarget) else \
            BaseEvaluationTarget(final_answer=final_answer)
        reply: Any = getattr(final_answer, "final_answer", final_answer)  # the text kept with a failure
        ahead = self._evaluated.pop(id(task), None)
        try:
            if ahead is not None and ahead[0] is evaluator and ahead[1] == reply and isinstance(reply, str):
                result = ahead[2]  # scored with the other tasks of the call (evaluate_in_advance)
                if isinstance(result, Exception):
                    raise result
            else:
                result = evaluator.evaluate(task, target)
        except Exception as exc:
            where = failure_location(exc, _code_folder(evaluator))
            raise ItemFailure("evaluator_exception", f"{label} raised {type(exc).__name__}: {exc}"
                                                     f"{f' ({where})' if where else ''}", reply) from exc
        if not isinstance(result, EvaluationRunResult):
            raise ItemFailure("evaluator_bad_result", f"{label}: {cls_name}.evaluate returned "
                                                      f"{type(result).__name__}, expected EvaluationRunResult",
                              reply)
        reward = result.reward
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
            raise ItemFailure("bad_reward", f"{label}: {cls_name} returned reward {reward!r}", reply)
        lo_hi = self._reward_range
        if lo_hi is not None and not (float(lo_hi[0]) <= reward <= float(lo_hi[1])):
            raise ItemFailure("reward_out_of_range",
                              f"reward {reward} outside rollout_worker.reward_range {list(lo_hi)}", reply)
        for name, value in result.metrics.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ItemFailure("bad_metric", f"{label}: metric '{name}' is {value!r}, not a finite number",
                                  reply)
        return result

    def base_trajectory(self, task: dict[str, Any]) -> Trajectory:
        return {
            "uid": task.get("uid"),
            "sample_index": task.get("sample_index"),
            "seq": task.get("seq"),
            "data_source": task.get("data_source", DEFAULT_DATA_SOURCE),
            "domain": task.get("domain"),
            "model_tag": self._model_tag,
            "is_validation": self._task_is_validation,
            "task": task,
        }

    def _put_failed(self, task: dict[str, Any], cause: str, message: str, validating: bool,
                    response: str | None = None, error: BaseException | None = None,
                    severity: ErrorSeverity = ErrorSeverity.WARNING) -> str:
        traj = self.base_trajectory(task)
        traj.update({"failed": True, "error": message, "error_cause": cause, "reward": 0.0,
                     "score": {}, "is_validation": validating, "model_version": self._task_version})
        if response is not None:
            traj["response"] = response  # the reply that could not be scored: kept for its author
        if error is not None:
            traj["error_traceback"] = format_traceback(error)
        # errors.jsonl gets a failed *validation* sample now (the validator consumes it at once);
        # a failed *training* item when the trainer consumes it (BaseTrainer._train_step): a failed
        # trajectory dropped as stale is re-rolled, and only the attempt that is used counts.
        line = f"{self._module_name}: task {task.get('uid')}#{task.get('sample_index')} failed ({cause}): {message}"
        if self._activity_tracker is not None:
            if validating:
                self._activity_tracker.record_lost_item(task, cause, message, True, traj["model_version"],
                                                        failure_detail(traj))
            # the tracker shows each distinct error once on the console; every one goes to run.log
            self._activity_tracker.report_error(self._module_name, cause, line, severity, {
                "uid": task.get("uid"), "sample_index": task.get("sample_index"), "seq": task.get("seq"),
                "validation": validating, "traceback": traj.get("error_traceback"),
                "signature": failure_signature(cause, message, error, _code_folder(self.evaluator_for(task)))})
        else:
            logger.warning(line)
        return self._put_trajectory(traj)

    def _current_version(self) -> int:
        return execute(self._llm_client.model_version) if self._llm_client is not None else 0


#: what a seed-style completion answer gives a trajectory that names its response (see ``_fill_in``)
COMPLETION_KEYS = ("prompt_token_ids", "response_token_ids", "response_logprobs", "sampling", "model_version",
                   "token_versions")


def completion_token_versions(result: CompletionResult, version: int) -> list[int] | None:
    """The weight version of each response token of ``result``: the backend's
    (``result.token_versions``), else ``version`` for every token; None without token ids. A
    backend's list that does not give one int per response token is an :class:`InferenceError`."""
    response = result.response_token_ids
    if response is None:
        return None
    reported = result.token_versions
    if reported is None:
        return [version] * len(response)
    if len(reported) != len(response) or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in reported):
        raise InferenceError(f"the inference backend reported {len(reported)} token versions for "
                             f"{len(response)} response tokens (expected one version >= 0 per token)")
    return list(reported)


class _SeedClient:
    """A worker's ``self._llm_client``: the inference client (or its handle), plus what the seed's
    guide calls on it: ``completion(prompt, **sampling)`` and ``generate(messages, **sampling)``
    returning dicts (their answer is remembered for the task in hand) and ``_model_tag``."""

    def __init__(self, client: Any, worker: BaseRolloutWorker):
        self._client, self._worker = client, worker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    @property
    def _model_tag(self) -> str:
        return self._worker._model_tag

    def completion(self, prompt: Any, **kwargs: Any) -> dict[str, Any]:
        answer = execute(self._client.completion, prompt, **kwargs)
        self._worker._last_completion = answer
        return answer

    def generate(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        answer = execute(self._client.generate, messages, **kwargs)
        self._worker._last_completion = answer
        return answer



@dataclass
class RolloutParts:
    """What a rollout worker is built with besides its config: its evaluators, built by the launcher
    (nexrl_core.launch.parts) with the plugin manager, and how messages name them."""

    evaluator: Evaluator | None = None
    evaluator_label: str = "no evaluator"
    #: ``rollout_worker.domain_evaluators``: a task's ``domain`` -> its evaluator (None: reward 0)
    domain_evaluators: dict[str, Evaluator | None] = field(default_factory=dict)
    domain_labels: dict[str, str] = field(default_factory=dict)
    worker_label: str | None = None


def failure_detail(trajectory: Trajectory) -> dict[str, Any]:
    """What errors.jsonl keeps of a failed trajectory besides its cause: the reply and the traceback."""
    return {key: trajectory[key] for key in ("response", "error_traceback") if trajectory.get(key) is not None}


def _code_folder(obj: Any) -> str | None:
    """Folder of the module that defines ``obj``'s class: where its author's code lives."""
    module = sys.modules.get(type(obj).__module__) if obj is not None else None
    path = getattr(obj, "source_path", None) or getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) if path else None
