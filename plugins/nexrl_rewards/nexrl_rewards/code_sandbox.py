"""``code_sandbox``: run the model's Python on the data item's test cases, in a sandbox.

The code is the last fenced ```python block of the reply (```py / ```python3 too; else the last
bare ``` block; else the whole reply). Each test case ``{"input": stdin, "output": expected
stdout}`` runs in a fresh process of one sandbox per evaluation (see sandbox.py and
_sandbox_launcher.py for the isolation). The comparison happens here, outside the sandbox.
"""

from __future__ import annotations

import json
import re
from typing import Any

from nexrl_core import BaseEvaluationTarget, ConfigError, EvaluationRunResult, Evaluator, required_row_field

from .options import KEY, choice, number, whole
from .sandbox import ISOLATION_MODES, CaseRun, Limits, NamespacesRefused, Sandbox

REWARD_MODES = ("fraction", "all_or_nothing")
COMPARE_MODES = ("trailing_whitespace", "exact", "whitespace")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}
# Per-case output kept in extra_info (it travels with the trajectory): enough to see what happened.
_SHOWN_STDOUT, _SHOWN_STDERR = 200, 600


def extract_code(reply: str) -> tuple[str, str]:
    """(code, where it came from: ``python_block``, ``plain_block`` or ``whole_reply``)."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(reply)]
    python = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    if python:
        return python[-1], "python_block"
    plain = [body for tag, body in blocks if not tag]
    if plain:
        return plain[-1], "plain_block"
    return reply, "whole_reply"


def outputs_match(actual: str, expected: str, mode: str) -> bool:
    if mode == "exact":
        return actual == expected
    if mode == "whitespace":
        return actual.split() == expected.split()
    # trailing_whitespace: trailing spaces of each line and trailing blank lines do not count
    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.replace("\r\n", "\n").rstrip().split("\n")]
    return norm(actual) == norm(expected)


class CodeSandboxEvaluator(Evaluator):
    """Reward = fraction of test cases passed (``reward_mode: fraction``) or 1 only when all pass
    (``all_or_nothing``, which stops at the first failing case). Metrics (every sample reports
    all): ``accuracy`` (all passed), ``pass_rate``, ``num_cases``. ``extra_info``: ``reason``
    (None, ``no_code`` or the first failing case's status), ``detail``, ``code_source``,
    ``isolation``, ``seccomp``, ``passed``, ``total`` and ``cases`` (per case: ``status`` — ``passed``,
    ``wrong_answer``, ``timeout``, ``cpu_limit``, ``memory_limit``, ``output_limit``,
    ``syntax_error``, ``runtime_error``, ``crashed`` or ``not_run`` — exit code, signal, times,
    the head of stdout and the tail of stderr).
    """

    # sample data for the conformance check (nexrl plugins check) and the docs
    EXAMPLES = [
        {"data": {"prompt": "Read n, print n squared.", "test_cases": [{"input": "3\n", "output": "9\n"},
                                                                      {"input": "-2\n", "output": "4\n"}]},
         "response": "```python\nn = int(input())\nprint(n * n)\n```", "reward": 1.0},
        {"data": {"prompt": "Read n, print n squared.", "test_cases": [{"input": "3\n", "output": "9\n"},
                                                                      {"input": "-2\n", "output": "4\n"}]},
         "response": "```python\nprint(9)\n```", "reward": 0.5},
    ]

    def __init__(self,
                 test_cases_key: str = "test_cases",
                 reward_mode: str = "fraction",
                 compare: str = "trailing_whitespace",
                 timeout_s: float = 10.0,
                 cpu_time_s: float = 5.0,
                 memory_mb: int = 512,
                 max_processes: int = 16,
                 max_open_files: int = 64,
                 max_output_kb: int = 1024,
                 max_file_mb: int = 16,
                 isolation: str = "auto",
                 python: str | None = None):
        """The test cases, the scoring and the sandbox's limits (see docs/rewards.md).

        :param test_cases_key: data field that holds the test cases [{input, output}, ...]; a dotted path reads
            a nested field
        :param reward_mode: fraction: the share of cases passed; all_or_nothing: 1 only when all pass
        :param compare: how stdout is compared: trailing_whitespace, exact or whitespace (the tokens)
        :param timeout_s: wall-clock limit per case, in seconds
        :param cpu_time_s: CPU-time limit per case and process, in seconds
        :param memory_mb: address-space limit per process, in MB
        :param max_processes: processes and threads the code may run at once
        :param max_open_files: open file descriptors per process
        :param max_output_kb: stdout beyond this many KB ends the case (output_limit)
        :param max_file_mb: the largest file, and the size of the writable working folder, in MB
        :param isolation: auto (= namespaces; refuses where the kernel denies them) or rlimits (weaker, by name only)
        :param python: interpreter that runs the code (default: the one running nexrl)
        """
        self.test_cases_key = test_cases_key
        self.reward_mode = choice(reward_mode, "reward_mode", REWARD_MODES)
        self.compare = choice(compare, "compare", COMPARE_MODES)
        limits = Limits(
            wall_s=number(timeout_s, "timeout_s", positive=True),
            cpu_s=number(cpu_time_s, "cpu_time_s", positive=True),
            memory_mb=whole(memory_mb, "memory_mb", low=32),
            max_processes=whole(max_processes, "max_processes", low=1),
            # python itself opens a dozen files before it runs a line
            max_open_files=whole(max_open_files, "max_open_files", low=16),
            max_output_bytes=whole(max_output_kb, "max_output_kb", low=1) * 1024,
            max_file_mb=whole(max_file_mb, "max_file_mb", low=1))
        self.sandbox = Sandbox(python=python, isolation=choice(isolation, "isolation", ISOLATION_MODES),
                               limits=limits)
        try:  # decided here, so that `nexrl validate` refuses what `nexrl run` would
            self.sandbox.mode  # noqa: B018 - the property decides the mode (and may refuse)
        except NamespacesRefused as exc:
            raise ConfigError(f"{KEY}.isolation: {exc}") from None

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        cases = self._test_cases(data)
        code, source = extract_code(evaluation_target.final_answer)
        info: dict[str, Any] = {"reason": None, "detail": "", "code_source": source, "isolation": None, "seccomp": None,
                                "passed": 0, "total": len(cases), "cases": []}
        if not code.strip():
            info.update(reason="no_code", detail="the reply holds no code")
            return self._result(0, len(cases), info)
        all_or_nothing = self.reward_mode == "all_or_nothing"
        verdicts: list[bool] = []

        def keep_going(run: CaseRun) -> bool:
            verdicts.append(run.status == "ok" and outputs_match(run.stdout, cases[run.index]["output"], self.compare))
            return verdicts[-1] or not all_or_nothing

        runs = self.sandbox.run(code, [case["input"] for case in cases], keep_going)
        info["isolation"] = self.sandbox.mode
        info["seccomp"] = self.sandbox.seccomp
        for run, passed in zip(runs, verdicts):
            status = "passed" if passed else ("wrong_answer" if run.status == "ok" else run.status)
            info["cases"].append({"index": run.index, "status": status, "exit_code": run.exit_code,
                                  "signal": run.signal, "wall_s": run.wall_s, "cpu_s": run.cpu_s,
                                  "stdout": run.stdout[:_SHOWN_STDOUT], "stderr": run.stderr[-_SHOWN_STDERR:]})
            if not passed and info["reason"] is None:
                info["reason"] = status
                info["detail"] = f"case {run.index}: {self._explain(status, run)}"
        info["cases"] += [{"index": i, "status": "not_run"} for i in range(len(runs), len(cases))]
        info["passed"] = sum(verdicts)
        return self._result(sum(verdicts), len(cases), info)

    def _result(self, passed: int, total: int, info: dict[str, Any]) -> EvaluationRunResult:
        rate = passed / total
        reward = rate if self.reward_mode == "fraction" else float(passed == total)
        return EvaluationRunResult(reward=reward, ground_truth=f"{total} test cases",
                                   metrics={"accuracy": float(passed == total), "pass_rate": rate,
                                            "num_cases": float(total)},
                                   extra_info=info)

    def _explain(self, status: str, run: CaseRun) -> str:
        limits = self.sandbox.limits
        last_error = (run.stderr.strip().splitlines() or [""])[-1][:200]
        return {
            "wrong_answer": f"wrong answer (stdout began {run.stdout[:60]!r})",
            "timeout": f"killed at the wall-clock limit ({limits.wall_s:g}s)",
            "cpu_limit": f"killed at the CPU-time limit ({limits.cpu_s:g}s)",
            "memory_limit": f"out of memory (limit {limits.memory_mb} MB): {last_error}",
            "output_limit": f"killed: printed more than {limits.max_output_bytes} bytes",
            "syntax_error": f"does not compile: {last_error}",
            "runtime_error": f"exited with code {run.exit_code}: {last_error}",
            "crashed": f"killed by {run.signal}",
        }.get(status, status)

    def _test_cases(self, data: dict[str, Any]) -> list[dict[str, str]]:
        where = f"data item {data.get('uid')!r}: '{self.test_cases_key}'"
        cases = required_row_field(data, self.test_cases_key, f"{KEY}.test_cases_key")
        if isinstance(cases, str):  # a JSON column in a Parquet/JSONL file
            try:
                cases = json.loads(cases)
            except ValueError as exc:
                raise ValueError(f"{where} is a string but not JSON ({exc})") from exc
        if not isinstance(cases, (list, tuple)) or not cases:
            raise ValueError(f"{where} must be a non-empty list of {{'input': ..., 'output': ...}}, "
                             f"got {type(cases).__name__}")
        out = []
        for i, case in enumerate(cases):
            if not isinstance(case, dict) or not isinstance(case.get("input"), str) \
                    or not isinstance(case.get("output"), str):
                raise ValueError(f"{where}[{i}] must be {{'input': <str>, 'output': <str>}}, got {case!r:.100}")
            out.append(case)
        return out
