"""``rollout_worker.evaluator.type: python``: a reward from a plain Python function in a file,
for the quick experiment before publishing an evaluator package (``nexrl new evaluator``).

.. code-block:: yaml

    rollout_worker:
      evaluator:
        type: python
        path: my_reward.py        # next to the recipe, or relative to the current folder
        function: score           # score(response, data, **kwargs)
        kwargs: {target_len: 40}  # optional keyword arguments of every call

The function gets the reply text and the data item (the row of the data file) and returns a
number (or a bool), a dict with ``reward`` and other numbers (metrics), or an
``EvaluationRunResult``. It runs in every rollout worker thread at once: keep it free of shared
mutable state.

``class: MyEvaluator`` (instead of ``function``) names an :class:`~nexrl_core.Evaluator` subclass
in the file, built once with ``kwargs`` as its constructor's keywords; its ``evaluate(data,
evaluation_target)`` scores each sample (what NexRL's ``evaluator_module_path: file.py:Class``
names, see ``nexrl migrate``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..config.settings import PlainData, Settings, setting
from ..errors import ConfigError
from ..evaluation import BaseEvaluationTarget, EvaluationRunResult, Evaluator
from ..runtime.python_class import class_from_file, import_file

KEY = "rollout_worker.evaluator"


@dataclass(frozen=True, kw_only=True)
class PythonFunctionSettings(Settings):
    """The ``python`` evaluator's keys."""

    path: str = setting(help="Python file that defines the reward function", path=True)
    function: str = setting("score", "the function: function(response, data, **kwargs) -> a number, a bool, a dict "
                                     "with 'reward' and metrics, or an EvaluationRunResult")
    class_: str | None = setting(None, "instead of function: an Evaluator subclass in the file, built with kwargs "
                                       "as its constructor's keywords; its evaluate(data, evaluation_target) scores",
                                 key="class")
    kwargs: dict[str, PlainData] = setting({}, "keyword arguments passed to the function on every call (to the "
                                               "class's constructor with class)")

    def load(self, key: str) -> tuple[Callable[..., Any] | None, type | None]:
        """The function, or the Evaluator class (with ``class``), each checked against ``kwargs``."""
        if self.class_ is None:
            return load_function(self.path, self.function, self.kwargs, key), None
        if self.function != PythonFunctionSettings.options()["function"].default:  # the composed recipe holds it
            raise ConfigError(f"{key}: give function or class, not both")
        return None, load_class(self.path, self.class_, self.kwargs, key)


class PythonFunctionEvaluator(Evaluator):
    """The reward a Python function in a file returns (``path``, ``function``, ``kwargs``), or an
    Evaluator class of that file (``class``)."""

    SETTINGS: ClassVar[type[Settings]] = PythonFunctionSettings

    @classmethod
    def check_config(cls, section: Mapping[str, Any], key: str) -> list[str]:
        try:
            PythonFunctionSettings.own(section, key).load(key)
        except ConfigError as exc:
            return [str(exc)]
        return []

    def __init__(self, **options: object):
        """Built with the keys of its recipe mapping (:class:`PythonFunctionSettings`) as keywords."""
        self.settings = settings = PythonFunctionSettings.of(options, KEY)
        self.source_path = os.path.abspath(settings.path)  # failures point at the user's file, not at nexrl's
        function, found = settings.load(KEY)
        self._evaluator: Evaluator | None = None if found is None else found(**settings.kwargs)
        if function is not None:
            self._function = function
        self._name = f"{settings.function}() of {settings.path}" if found is None else \
            f"{settings.class_}.evaluate() of {settings.path}"

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        if self._evaluator is not None:
            return as_result(self._evaluator.evaluate(data, evaluation_target), self._name)
        return as_result(self._function(evaluation_target.final_answer, data, **self.settings.kwargs), self._name)


def load_function(path: str, name: str, kwargs: dict[str, Any], key: str = KEY) -> Callable[..., Any]:
    """The function ``name`` of the file ``path``, checked to accept ``(response, data, **kwargs)``;
    every problem is a ConfigError naming the key or ``file:line``."""
    if not os.path.isfile(path):
        where = "a folder" if os.path.isdir(path) else "not found"
        raise ConfigError(f"{key}.path: '{path}' is {where} (a Python file that defines {name}())")
    module = import_file(os.path.abspath(path), key)
    function = getattr(module, name, None)
    if function is None:
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise ConfigError(f"{key}.function: {path} defines no '{name}' (functions in it: {', '.join(found) or 'none'})")
    if not callable(function):
        raise ConfigError(f"{key}.function: '{name}' in {path} is a {type(function).__name__}, not a function")
    try:
        inspect.signature(function).bind("response", {}, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"{key}.function: {name}{inspect.signature(function)} in {path} cannot be called as "
                          f"{name}(response, data{''.join(f', {k}=...' for k in kwargs)}): {exc}") from None
    except ValueError:  # no signature to inspect (a builtin): call it and see
        pass
    return function


def load_class(path: str, name: str, kwargs: dict[str, Any], key: str = KEY) -> type:
    """The class ``name`` of the file ``path``, checked to have an ``evaluate`` method and to take
    ``kwargs`` as its constructor's keywords."""
    found = class_from_file(path, name, key)
    if not callable(getattr(found, "evaluate", None)):
        raise ConfigError(f"{key}.class: {name} in {path} has no evaluate(data, evaluation_target) method "
                          f"(subclass nexrl_core.Evaluator)")
    if inspect.isabstract(found):
        raise ConfigError(f"{key}.class: {name} in {path} leaves abstract methods unimplemented: "
                          f"{', '.join(sorted(getattr(found, '__abstractmethods__', ())))}")
    try:
        inspect.signature(found).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{key}.kwargs: {name}{inspect.signature(found)} in {path} cannot be built as "
                          f"{name}({', '.join(f'{k}=...' for k in kwargs)}): {exc}") from None
    except ValueError:  # no signature to inspect
        pass
    return found


def as_result(value: Any, name: str) -> EvaluationRunResult:
    """The function's answer as an EvaluationRunResult."""
    if isinstance(value, EvaluationRunResult):
        return value
    if isinstance(value, (bool, int, float)):
        return EvaluationRunResult(reward=float(value))
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise TypeError(f"{name} returned a dict without 'reward' (keys: {', '.join(map(str, value)) or 'none'})")
        metrics, extra = {}, {}
        for k, v in value.items():
            if k in ("reward", "ground_truth"):
                continue
            if isinstance(v, (bool, int, float)):
                metrics[str(k)] = float(v)  # a NaN fails the sample (bad_metric), as any evaluator's
            else:
                extra[str(k)] = v
        reward = value["reward"]
        if not isinstance(reward, (bool, int, float)):
            raise TypeError(f"{name} returned reward {reward!r}, not a number")
        return EvaluationRunResult(reward=float(reward), ground_truth=str(value.get("ground_truth", "")),
                                   metrics=metrics, extra_info=extra)
    raise TypeError(f"{name} returned {type(value).__name__}; expected a number, a bool, a dict with 'reward' "
                    f"or an EvaluationRunResult")


@dataclass(frozen=True, kw_only=True)
class RewardFunctionsSettings(Settings):
    """The ``reward_funcs`` evaluator's keys."""

    functions: list[str] = setting(help="the reward functions, each 'file.py:name' (a file next to the recipe, or "
                                        "relative to the current folder)", path=True)
    weights: list[float] | None = setting(None, "weight of each function's score in the reward (default: 1 each)")


class RewardFunctionsEvaluator(Evaluator):
    """TRL-style reward functions (``rollout_worker.evaluator.type: reward_funcs``): each
    ``file.py:name`` of ``functions`` is called as TRL calls a reward function,
    ``name(prompts=[prompt], completions=[completion], **columns)`` with every other column of the
    data row as a one-item list, and returns a list with one score (or None: no score from this
    function for this sample). The reward is the ``weights``-weighted sum of the scores; each
    function's score is logged as the metric of its name.

    A conversational prompt (a list of messages) gets its completion as TRL gives it,
    ``[{"role": "assistant", "content": text}]``. Calls are per sample, or once for the samples a
    worker took together (``rollout_worker.tasks_per_call``; lists of that many), from every
    rollout worker thread at once: keep the functions free of shared mutable state."""

    SETTINGS: ClassVar[type[Settings]] = RewardFunctionsSettings

    @classmethod
    def check_config(cls, section: Mapping[str, Any], key: str) -> list[str]:
        settings = RewardFunctionsSettings.own(section, key)
        try:
            _load_reward_functions(settings.functions, settings.weights, key)
        except ConfigError as exc:
            return [str(exc)]
        return []

    def __init__(self, **options: object):
        """Built with the keys of its recipe mapping (:class:`RewardFunctionsSettings`) as keywords."""
        self.settings = RewardFunctionsSettings.of(options, KEY)
        self._functions = _load_reward_functions(self.settings.functions, self.settings.weights, KEY)
        self.source_path = os.path.abspath(self._functions[0][2]) if self._functions else None

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        result = self.evaluate_many([(data, evaluation_target)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def evaluate_many(self, items: list[tuple[dict[str, Any], BaseEvaluationTarget]]
                      ) -> list[EvaluationRunResult | Exception]:
        """Each function called once for all ``items``, as TRL calls it for a batch (lists of N); a
        call that raises is retried sample by sample, so only the samples it fails on fail."""
        if len(items) > 1:
            try:
                return list(self._score([d for d, _ in items], [t.final_answer for _, t in items]))
            except Exception:  # find the sample(s) it fails on
                pass
        out: list[EvaluationRunResult | Exception] = []
        for data, target in items:
            try:
                out.extend(self._score([data], [target.final_answer]))
            except Exception as exc:
                out.append(exc)
        return out

    def _score(self, rows: list[dict[str, Any]], texts: list[str]) -> list[EvaluationRunResult]:
        prompts = [row.get("prompt") for row in rows]
        completions: list[Any] = [[{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
                                  for prompt, text in zip(prompts, texts)]
        names = dict.fromkeys(k for row in rows for k in row if k not in ("prompt", "prompts", "completions"))
        columns = {k: [row.get(k) for row in rows] for k in names}
        rewards, scored = [0.0] * len(rows), [0] * len(rows)
        metrics: list[dict[str, float]] = [{} for _ in rows]
        for name, function, path, weight in self._functions:
            try:
                out = function(prompts=prompts, completions=completions, **columns)
            except TypeError as exc:
                raise TypeError(f"reward function {name} of {path}: {exc} (it is called with prompts, completions "
                                f"and the data row's columns: {', '.join(sorted(columns)) or 'none'})") from None
            if not isinstance(out, (list, tuple)) or len(out) != len(rows):
                raise TypeError(f"reward function {name} of {path} returned {out!r}; expected a list with one score "
                                f"per completion ({len(rows)} here)")
            for i, score in enumerate(out):
                if score is None:
                    continue
                if not isinstance(score, (bool, int, float)):
                    raise TypeError(f"reward function {name} of {path} returned score {score!r}, not a number")
                metrics[i][name] = float(score)
                rewards[i] += weight * float(score)
                scored[i] += 1
        if not all(scored):
            raise ValueError("every reward function returned None for this sample: no reward")
        return [EvaluationRunResult(reward=r, metrics=m) for r, m in zip(rewards, metrics)]


def _load_reward_functions(specs: list[str], weights: list[float] | None,
                           key: str) -> list[tuple[str, Callable[..., Any], str, float]]:
    """(name, function, file, weight) of each ``file.py:name``, checked to take TRL's keywords."""
    if not specs:
        raise ConfigError(f"{key}.functions: name at least one reward function ('file.py:name')")
    if weights is not None and len(weights) != len(specs):
        raise ConfigError(f"{key}.weights: {len(weights)} weights for {len(specs)} functions")
    out, names = [], set()
    for i, spec in enumerate(specs):
        path, sep, name = str(spec).rpartition(":")
        if not sep or not path or not name:
            raise ConfigError(f"{key}.functions[{i}]: '{spec}' is not 'file.py:name'")
        if not os.path.isfile(path):
            raise ConfigError(f"{key}.functions[{i}]: '{path}' is {'a folder' if os.path.isdir(path) else 'not found'} "
                              f"(a Python file that defines {name}())")
        module = import_file(os.path.abspath(path), key)
        function = getattr(module, name, None)
        if not callable(function):
            raise ConfigError(f"{key}.functions[{i}]: {path} defines no function '{name}'")
        try:
            parameters = list(inspect.signature(function).parameters.values())
        except ValueError:  # no signature to inspect (a builtin): call it and see
            parameters = []
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        if parameters and not takes_any and "completions" not in {p.name for p in parameters}:
            raise ConfigError(f"{key}.functions[{i}]: {name}{inspect.signature(function)} in {path} takes no "
                              f"'completions' (TRL's reward functions are name(prompts, completions, **kwargs))")
        if name in names:
            raise ConfigError(f"{key}.functions[{i}]: two functions named '{name}': their metrics would collide")
        names.add(name)
        out.append((name, function, path, float(weights[i]) if weights is not None else 1.0))
    return out
