"""A math-verify worker process (``python -m nexrl_rewards._verify_worker MEMORY_MB``).

Reads one JSON request per line on stdin, ``{"gold": str, "pred": str, "timeout": float}``, and
answers one JSON line on stdout::

    {"status": "ok" | "timeout" | "error", "equal": bool, "gold": [str], "pred": [str], "error": str}

It exists because math-verify's own timeouts use SIGALRM, which works only in a main thread, and
rollout workers are threads; and because sympy can spin in C code that no signal interrupts, so
the parent must be able to kill the whole process (see verify_pool.py). Its address space is
capped so a pathological expression ends in a MemoryError instead of taking the machine's memory.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

# Parsed values are reported, not reasoned on: a few hundred characters are enough to read them.
_MAX_REPORTED_CHARS = 300


class _Deadline(BaseException):
    """Raised by SIGALRM; a BaseException so math-verify's `except Exception` cannot swallow it."""


def _on_alarm(_signum, _frame):
    raise _Deadline()


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= _MAX_REPORTED_CHARS else text[:_MAX_REPORTED_CHARS] + "..."


def main() -> int:
    memory_mb = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    sys.stdout = sys.stderr  # a library print must never corrupt the protocol stream (stderr goes nowhere)
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    signal.signal(signal.SIGALRM, _on_alarm)
    protocol.write('{"status": "ready"}\n')
    protocol.flush()
    for line in sys.stdin:
        request = json.loads(line)
        answer: dict = {"status": "ok", "equal": False, "gold": [], "pred": [], "gold_is_math": False,
                        "pred_is_math": False, "error": ""}
        signal.setitimer(signal.ITIMER_REAL, max(0.01, float(request["timeout"])))
        try:
            # math-verify's own signal timeouts are off (None): the alarm above covers the whole job.
            gold = parse(request["gold"], configs, parsing_timeout=None)
            answer["gold"] = [_short(g) for g in gold]
            # math-verify falls back to the raw string when it cannot parse: that is not math.
            answer["gold_is_math"] = any(not isinstance(g, str) for g in gold)
            pred = parse(request["pred"], configs, parsing_timeout=None) if answer["gold_is_math"] else []
            answer["pred"] = [_short(p) for p in pred]
            answer["pred_is_math"] = any(not isinstance(p, str) for p in pred)
            if gold and pred:
                answer["equal"] = bool(verify(gold, pred, timeout_seconds=None))
        except _Deadline:
            answer["status"] = "timeout"
        except Exception as exc:  # MemoryError and RecursionError included: the input was pathological
            answer["status"] = "error"
            answer["error"] = f"{type(exc).__name__}: {_short(exc)}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        protocol.write(json.dumps(answer) + "\n")
        protocol.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
