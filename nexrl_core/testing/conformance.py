"""Conformance of an evaluator: does it return valid results on sample data, as a rollout worker
needs them? ``nexrl plugins check NAME`` runs :func:`check_evaluator` on every evaluator a plugin
registers; a plugin's own tests call it directly.

An evaluator may declare its sample data as a class attribute::

    class Contains(Evaluator):
        EXAMPLES = [
            {"data": {"prompt": "Name a colour", "answer": "red"}, "response": "Red.", "reward": 1.0},
            {"data": {"prompt": "Name a colour", "answer": "red"}, "response": "blue", "reward": 0.0},
        ]

each with the data item (a row of the data file), a reply, optionally the reward it must get
and ``options`` (constructor keywords). Without examples the check uses generic arithmetic data.
"""

from __future__ import annotations

import copy
import math
import pickle
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config.options import Check, Option, check_options
from ..evaluation import BaseEvaluationTarget, EvaluationRunResult, Evaluator
from ..launch.parts import PARTS_FIX, takes_parts

GENERIC_EXAMPLES: list[dict[str, Any]] = [
    {"data": {"prompt": "What is 2 + 3? Reply with only the number.", "answer": 5, "data_source": "check"},
     "response": "5"},
    {"data": {"prompt": "What is 2 + 3? Reply with only the number.", "answer": 5, "data_source": "check"},
     "response": "The answer is 6."},
]

#: Replies a model really produces early in training. An evaluator must score them (typically 0),
#: not raise: a reply that raises becomes a failed sample, which the trainer never learns from.
ODD_REPLIES: dict[str, str] = {
    "an empty reply": "",
    "a blank reply": " \n\t ",
    "a reply of special tokens": "<|im_end|><|endoftext|></s>",
    "a non-ASCII reply": "Ответ: ５ — ✓ 🙂 \u200b",
    "a control character": "5\x00\x1b[31m",
    "a very long reply": "9 " * 20000,
    "an unbalanced reply": "\\boxed{ ((( [ {{ $$ ```python\nprint(",
}

_THREADS = 4


@dataclass
class ConformanceReport:
    """The outcome of :func:`check_evaluator` for one evaluator (or, from :func:`check_plugin`,
    of the option declarations of another component)."""

    component: str  #: e.g. "evaluator 'math_rule' (nexrl-rewards 0.1.0)"
    problems: list[str] = field(default_factory=list)  #: what must be fixed
    notes: list[str] = field(default_factory=list)  #: worth knowing, not failures
    skipped: str | None = None  #: why it was not checked (e.g. options it needs were not given)
    calls: int = 0  #: evaluate calls made
    checked: str = ""  #: what was checked, when not calls (e.g. "option declarations")

    @property
    def ok(self) -> bool:
        return not self.problems and self.skipped is None

    def text(self) -> str:
        if self.skipped is not None:
            head = f"{self.component}: skipped: {self.skipped}"
        elif self.problems:
            head = f"{self.component}: FAILED ({len(self.problems)} problem{'s' if len(self.problems) > 1 else ''})"
        else:
            head = f"{self.component}: ok ({self.checked or f'{self.calls} calls'})"
        lines = [head] + [f"  problem: {p}" for p in self.problems] + [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"component": self.component, "ok": self.ok, "problems": self.problems, "notes": self.notes,
                "skipped": self.skipped, "calls": self.calls}


def check_evaluator(evaluator: type[Evaluator] | str, options: Mapping[str, Any] | None = None,
                    examples: list[Mapping[str, Any]] | None = None, pm: Any = None,
                    label: str | None = None) -> ConformanceReport:
    """Build ``evaluator`` as a rollout worker does and check what it returns.

    :param evaluator: the class, or a registered name (looked up in ``pm``).
    :param options: constructor keywords (the recipe's ``rollout_worker.evaluator`` keys but
        ``type``), checked against the declared options first, as ``nexrl validate`` checks
        them. An example's own ``options`` take precedence.
    :param examples: ``[{"data": ..., "response": ..., "reward": optional, "options": optional}]``;
        default: the class's ``EXAMPLES``, else generic arithmetic data.
    :param pm: the plugin manager that resolves a name (default: the process's).
    :param label: how the report names the evaluator.
    :return: a report: ``ok``, ``problems`` (one line each), ``notes``, ``skipped``.

    Checked: the declared options and their defaults; the constructor; for every example and
    for odd replies (empty, blank, special tokens, non-ASCII, control characters, very long):
    ``evaluate`` returns an ``EvaluationRunResult`` with a finite reward, finite numeric
    metrics, a string ground truth and a dict of extra info that pickles (results travel
    between processes); it leaves the data item unchanged (the samples of a group share it);
    an example's expected reward; one instance per thread in parallel threads (one evaluator
    lives per rollout worker thread) gives the sequential results. Noted: metric names that
    differ between samples, results that differ between two calls, the time per call.
    """
    from ..errors import ConfigError
    from ..launch.recipe import component_check, declared_options

    cls = _resolve(evaluator, pm)
    report = ConformanceReport(label or f"evaluator {getattr(cls, '__qualname__', cls)!s}")
    if not (isinstance(cls, type) and issubclass(cls, Evaluator)):
        report.problems.append(f"{cls!r} is not a subclass of nexrl_core.Evaluator")
        return report
    declared = declared_options("evaluator", cls)
    report.problems += _declaration_problems(declared)
    own = getattr(cls, "EXAMPLES", None)
    samples = [dict(e) for e in (examples if examples is not None else own or [])]
    generic = not samples
    if generic:
        samples = [dict(e) for e in GENERIC_EXAMPLES]
        report.notes.append("declares no EXAMPLES: checked on generic arithmetic data ({prompt, answer}); declare "
                            "EXAMPLES with the data your evaluator reads")
    report.problems += _example_shape_problems(samples)
    if report.problems:
        return report
    builds: dict[str, dict[str, Any]] = {}  # options key -> constructor keywords
    instances: dict[str, Evaluator] = {}
    for sample in samples:
        opts = {**dict(options or {}), **dict(sample.get("options") or {})}
        key = sample["_key"] = repr(sorted(opts.items()))
        if key in instances:
            continue
        missing = [k for k, o in (declared or {}).items() if o.required and o.removed is None and opts.get(k) is None]
        if missing:
            report.skipped = (f"needs options {', '.join(missing)}: give them (nexrl plugins check NAME "
                              f"{' '.join(f'{k}=...' for k in missing)}) or in its EXAMPLES")
            return report
        lines = check_options(opts, declared, "options") if declared is not None else []
        lines = lines or component_check(cls, opts, "options")
        if lines:
            report.problems += lines
            return report
        try:
            instances[key] = cls(**opts)
        except ConfigError as exc:
            if opts:
                report.problems.append(f"{cls.__name__}(**{opts!r}) refused its options: {exc}")
            else:  # it needs options it does not declare as required (a service to call, ...)
                report.skipped = f"needs options: {exc}"
            return report
        except Exception as exc:
            report.problems.append(f"{cls.__name__}(**{opts!r}) raised {type(exc).__name__}: {exc}")
            return report
        builds[key] = opts
    name = "EXAMPLES" if examples is None and own else "sample"
    cases = [_Case(f"{name}[{i}]", s["data"], s["response"], s.get("reward"), s["_key"])
             for i, s in enumerate(samples)]
    _check_cases(cases, instances, report)
    if report.problems:  # the replies below use the examples' data: their problems would repeat these
        if generic:
            report.problems.append("the generic sample data does not suit this evaluator: declare EXAMPLES")
        return report
    odd = [_Case(f"{what} (data of {name}[0])", samples[0]["data"], reply, None, samples[0]["_key"], odd=True)
           for what, reply in ODD_REPLIES.items()]
    _check_cases(odd, instances, report)
    _timing_notes(cases + odd, report)
    if not report.problems:
        _check_threads(cls, cases + odd, builds, report)
    return report


@dataclass
class _Case:
    name: str
    data: Mapping[str, Any]
    reply: str
    expected: float | None
    key: str
    odd: bool = False
    reward: float | None = None  # what the sequential call gave
    metrics: tuple[str, ...] | None = None
    seconds: float | None = None


def _resolve(evaluator: Any, pm: Any) -> Any:
    if not isinstance(evaluator, str):
        return evaluator
    from ..plugins import get_plugin_manager

    return (pm or get_plugin_manager()).resolve("evaluator", evaluator, "evaluator")


def _declaration_problems(declared: Mapping[str, Any] | None) -> list[str]:
    problems = []
    for key, opt in (declared or {}).items():
        if not isinstance(opt, Option):
            problems.append(f"OPTIONS['{key}'] is {type(opt).__name__}, not a nexrl_core.Option")
            continue
        if opt.required or opt.removed is not None:
            continue
        try:
            default = opt.default_value()
            wrong = Check().value(default, opt, f"OPTIONS['{key}']")
        except Exception as exc:
            wrong = [f"OPTIONS['{key}']: its declaration cannot be read ({type(exc).__name__}: {exc})"]
        problems += [f"{w} (the declared default fails its own declaration)" for w in wrong]
    return problems


def _example_shape_problems(samples: list[dict[str, Any]]) -> list[str]:
    problems = []
    for i, sample in enumerate(samples):
        if not isinstance(sample.get("data"), Mapping):
            problems.append(f"EXAMPLES[{i}]: needs 'data' (a mapping: the data item)")
        if not isinstance(sample.get("response"), str):
            problems.append(f"EXAMPLES[{i}]: needs 'response' (the reply text)")
        unknown = set(sample) - {"data", "response", "reward", "options"}
        if unknown:
            problems.append(f"EXAMPLES[{i}]: unknown keys {sorted(unknown)} (data, response, reward, options)")
    return problems


def _check_cases(cases: list[_Case], instances: dict[str, Evaluator], report: ConformanceReport) -> None:
    for case in cases:
        started = time.perf_counter()
        result = _call(instances[case.key], case, report)
        report.calls += 1
        if result is None:
            continue
        case.reward = result.reward
        case.metrics = tuple(sorted(result.metrics))
        case.seconds = time.perf_counter() - started
        if case.expected is not None and not math.isclose(float(result.reward), float(case.expected), abs_tol=1e-9):
            report.problems.append(f"{case.name}: reward {result.reward!r}, the example expects {case.expected!r}")
        again = _call(instances[case.key], case, None)
        report.calls += 1
        if again is not None and again.reward != result.reward and not _noted(report, "two calls"):
            report.notes.append(f"{case.name}: two calls on the same reply gave rewards {result.reward!r} and "
                                f"{again.reward!r} (fine for a sampled judge; a rule should be deterministic)")


def _timing_notes(cases: list[_Case], report: ConformanceReport) -> None:
    timed = [c.seconds for c in cases if c.seconds is not None]
    if timed:
        report.notes.append(f"{sum(timed) / len(timed) * 1000:.2f} ms per call (slowest {max(timed) * 1000:.1f} ms)")
    metric_names = {c.metrics for c in cases if c.metrics is not None}
    if len(metric_names) > 1:
        shown = " / ".join(", ".join(n) or "(none)" for n in sorted(metric_names))
        report.notes.append(f"metric names differ between samples ({shown}): a validation mean counts a "
                            f"missing metric as 0")


def _noted(report: ConformanceReport, words: str) -> bool:
    return any(words in note for note in report.notes)


def _call(evaluator: Evaluator, case: _Case, report: ConformanceReport | None) -> EvaluationRunResult | None:
    item = copy.deepcopy(dict(case.data))
    try:
        result = evaluator.evaluate(item, BaseEvaluationTarget(final_answer=case.reply))
    except Exception as exc:
        if report is not None:
            from ..runtime.logs import failure_location

            where = failure_location(exc)
            hint = "; a reply it cannot use should score (e.g. 0), not fail the sample" if case.odd else ""
            report.problems.append(f"{case.name}: evaluate raised {type(exc).__name__}: {exc}"
                                   f"{f' ({where})' if where else ''}{hint}")
        return None
    problems = result_problems(result)
    if item != dict(case.data):
        problems.append("evaluate changed the data item it was given (the samples of a group share it)")
    if report is not None:
        report.problems += [f"{case.name}: {p}" for p in problems]
    return None if problems else result


def result_problems(result: Any) -> list[str]:
    """What is wrong with one ``evaluate`` answer (empty: valid)."""
    if not isinstance(result, EvaluationRunResult):
        return [f"evaluate returned {type(result).__name__}, expected nexrl_core.EvaluationRunResult"]
    problems = []
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        problems.append(f"reward {reward!r} is not a finite number")
    if not isinstance(result.metrics, Mapping):
        problems.append(f"metrics is {type(result.metrics).__name__}, expected dict[str, float]")
    else:
        for k, v in result.metrics.items():
            if not isinstance(k, str):
                problems.append(f"metric name {k!r} is not a string")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                problems.append(f"metric '{k}' is {v!r}, not a finite number")
    if not isinstance(result.ground_truth, str):
        problems.append(f"ground_truth is {type(result.ground_truth).__name__}, expected str")
    if not isinstance(result.extra_info, Mapping):
        problems.append(f"extra_info is {type(result.extra_info).__name__}, expected dict")
    else:
        try:
            pickle.dumps(result.extra_info)
        except Exception as exc:
            problems.append(f"extra_info does not pickle ({type(exc).__name__}: {exc}); results travel between "
                            f"processes")
    return problems


def _check_threads(cls: type, cases: list[_Case], builds: dict[str, dict[str, Any]],
                   report: ConformanceReport) -> None:
    """One instance per thread, all threads at once (as rollout workers run): the sequential rewards."""
    try:
        fresh = [{key: cls(**opts) for key, opts in builds.items()} for _ in range(_THREADS)]
    except Exception as exc:
        report.problems.append(f"building a second instance raised {type(exc).__name__}: {exc} (every rollout "
                               f"worker thread builds its own)")
        return
    answers: dict[int, list[float | None]] = {}
    barrier = threading.Barrier(_THREADS)

    def work(t: int) -> None:  # each thread starts at another case, so they overlap on different data
        order = list(range(t, len(cases))) + list(range(t))
        barrier.wait()
        got: list[float | None] = [None] * len(cases)
        for i in order:
            got[i] = getattr(_call(fresh[t][cases[i].key], cases[i], None), "reward", None)
        answers[t] = got

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    report.calls += _THREADS * len(cases)
    differ = sorted({c.name for got in answers.values() for c, a in zip(cases, got) if a != c.reward})
    if len(answers) < _THREADS:
        report.problems.append(f"evaluate did not return within 300 s in {_THREADS} parallel threads")
    elif differ:
        text = (f"with one instance per thread in {_THREADS} threads at once, rewards differ from the sequential "
                f"ones on {', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''}")
        if _noted(report, "two calls"):
            report.notes.append(text)  # it is not deterministic anyway
        else:
            report.problems.append(text + ": state shared between instances (a class attribute, a module global)?")


# -- a whole plugin (nexrl plugins check NAME) -------------------------------------------------------

def check_plugin(name: str, pm: Any = None, options: Mapping[str, Any] | None = None) -> list[ConformanceReport]:
    """Reports for ``name``: a plugin (entry-point name or distribution) -- every evaluator it
    registers (:func:`check_evaluator`) and the option declarations of its other components --
    or one registered evaluator (``options`` are its constructor keywords). Raises
    :class:`~nexrl_core.PluginError` for a plugin that failed to load and
    :class:`~nexrl_core.ConfigError` for a name nothing has."""
    from ..config.options import component_options
    from ..errors import ConfigError, PluginError
    from ..plugins import KINDS, get_plugin_manager

    pm = pm or get_plugin_manager()
    for failure in pm.failures:
        if name in (failure.name, failure.distribution):
            raise PluginError(f"plugin '{failure.name}' ({failure.distribution}) failed to load: {failure.error}")
    plugins = [r.name for r in pm.records.values() if name in (r.name, r.distribution)]
    evaluators = pm.components("evaluator")
    if not plugins:
        if name not in evaluators:
            known = sorted({r.distribution for r in pm.records.values()} | set(evaluators))
            raise ConfigError(f"'{name}' is neither an installed plugin (distribution or entry-point name) nor a "
                              f"registered evaluator; known: {', '.join(known)}")
        reg = evaluators[name]
        return [check_evaluator(reg.cls, options, pm=pm, label=_label("evaluator", name, reg, pm))]
    if options:
        raise ConfigError(f"key=value options apply to one evaluator: name it (nexrl plugins check EVALUATOR "
                          f"key=value ...), not the plugin '{name}'")
    reports = []
    for kind in KINDS:
        for component, reg in sorted(pm.components(kind).items()):
            if reg.plugin not in plugins:
                continue
            label = _label(kind, component, reg, pm)
            if kind == "evaluator":
                reports.append(check_evaluator(reg.cls, pm=pm, label=label))
                continue
            report = ConformanceReport(label)
            for attr in ("OPTIONS", "ALGORITHM_OPTIONS", "TRAIN_SERVICE_OPTIONS"):
                report.problems += [f"{attr}: {p}" for p in _declaration_problems(component_options(reg.cls, attr))]
            if kind in ("rollout_worker", "trainer") and not takes_parts(reg.cls):
                report.notes.append(f"__init__ takes no `parts`: it runs only without an evaluator, a train service "
                                    f"or an algorithm registry ({PARTS_FIX})")
            report.checked = "option declarations"
            reports.append(report)
    return reports


def _label(kind: str, name: str, reg: Any, pm: Any) -> str:
    record = pm.records.get(reg.plugin)
    version = f" {record.version}" if record is not None and record.version else ""
    return f"{kind.replace('_', ' ')} '{name}' ({reg.distribution}{version})"
