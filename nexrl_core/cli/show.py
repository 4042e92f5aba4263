"""``nexrl show RUN_DIR``: what the model said, in the terminal.

Reads ``RUN_DIR/samples.jsonl`` (written by ``nexrl run`` at the first and last step and every
``logger.samples_every`` steps) or the ``samples.jsonl`` of a ``nexrl eval --out`` folder, and
prints each sample readably: the prompt (each chat message with its role), the reply, the reward,
the advantage where the trainer recorded one, the evaluator's other scores, and the step's
trainer-vs-rollout log-prob gap where it is large.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ..errors import ConfigError
from .run_log import METRICS_FILE, SAMPLES_FILE, read_jsonl

_LABEL = 9  # width of the field names, so every text starts in one column
#: the per-step metric of the largest per-token |trainer - rollout log-prob| (rollout_mismatch_metrics):
#: samples.jsonl keeps no per-token log-probs, so a sample is shown with its step's
GAP_KEY = "train/rollout_logprob_diff_max"
#: a gap above this is large: some token was more than twice as likely to one side as to the
#: other (the default algorithm.rollout_correction.cap)
LARGE_GAP = math.log(2.0)


def read_samples(path: str) -> list[dict[str, Any]]:
    """The rows of a samples.jsonl file, in file order (a torn or foreign line is skipped)."""
    return read_jsonl(path)


def samples_path(where: str) -> str:
    """``where``'s samples.jsonl (a run directory or an eval --out folder), or the file itself."""
    if os.path.isfile(where):
        return where
    if not os.path.isdir(where):
        raise ConfigError(f"{where}: no such run directory")
    path = os.path.join(where, SAMPLES_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no {SAMPLES_FILE} yet: `nexrl run` writes it at the first training step "
                          f"(unless logger.samples_every is 0), `nexrl eval --out DIR` into DIR")
    return path


def pick(rows: list[dict[str, Any]], last: int | None) -> list[dict[str, Any]]:
    """The ``last`` newest rows; by default the rows of the newest step (or weight version)."""
    if not rows:
        return []
    if last is not None:
        return rows[-last:] if last > 0 else []
    key = "step" if "step" in rows[-1] else "model_version"
    newest = rows[-1].get(key)
    return [r for r in rows if r.get(key) == newest]


def step_gaps(folder: str) -> dict[int, float]:
    """step -> :data:`GAP_KEY` of ``folder/metrics.jsonl`` (empty without it)."""
    path = os.path.join(folder, METRICS_FILE)
    if not os.path.isfile(path):
        return {}
    return {r["step"]: float(r[GAP_KEY]) for r in read_jsonl(path)
            if isinstance(r.get("step"), int) and _is_number(r.get(GAP_KEY))}


def render(rows: list[dict[str, Any]], source: str, total: int, gaps: dict[int, float] | None = None) -> str:
    """The text ``nexrl show`` prints for ``rows`` (of ``total`` in ``source``); ``gaps``: each
    step's log-prob gap (:func:`step_gaps`), shown where large."""
    if not rows:
        return f"{source}: no samples"
    steps = sorted({r["step"] for r in rows if isinstance(r.get("step"), int)})
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}" if steps else "evaluation"
    blocks = [f"{source}: {len(rows)} of {total} samples ({where})"]
    blocks += [_sample(r, (gaps or {}).get(r["step"]) if isinstance(r.get("step"), int) else None) for r in rows]
    return "\n\n".join(blocks)


def _sample(row: dict[str, Any], gap: float | None = None) -> str:
    head = []
    if isinstance(row.get("step"), int):
        head.append(f"step {row['step']}")
    head.append(f"sample {row.get('uid')}#{row.get('sample_index', 0)}")
    if row.get("data_source") not in (None, "default"):
        head.append(str(row["data_source"]))
    if row.get("model_version") is not None:
        head.append(f"weights v{row['model_version']}")
    head.append(f"reward {_number(row.get('reward'))}")
    if _is_number(row.get("advantage")):
        head.append(f"advantage {row['advantage']:+.3f}")
    if gap is not None and gap > LARGE_GAP:
        head.append(f"step's log-prob gap {gap:.3g} (large)")
    lines = [" · ".join(head)]
    if row.get("failed"):
        lines.append(_field("failed", str(row.get("error") or "(no message)")))
    lines.append(_field("prompt", _prompt_text(row.get("prompt"))))
    reply = row.get("response")
    note = " [cut off at max_tokens]" if row.get("finish_reason") == "length" else ""
    lines.append(_field("reply", ("" if reply is None else str(reply)) + note))
    scores = {k: v for k, v in (row.get("score") or {}).items() if k != "reward"}
    if scores:
        lines.append(_field("score", "  ".join(f"{k}={_number(v)}" for k, v in sorted(scores.items()))))
    return "\n".join(lines)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages
        return "\n".join(f"[{m.get('role', '?')}] {m.get('content', '')}" if isinstance(m, dict) else str(m)
                         for m in prompt)
    return "" if prompt is None else str(prompt)


def _field(name: str, text: str) -> str:
    """``  name     text``, with the text's further lines indented under its first."""
    pad = " " * (2 + _LABEL)
    body = text.replace("\r\n", "\n").split("\n") or [""]
    return "\n".join(line.rstrip() for line in [f"  {name:<{_LABEL}}{body[0]}", *(pad + x for x in body[1:])])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: Any) -> str:
    if not _is_number(value):
        return "-" if value is None else str(value)
    return f"{value:g}" if float(value).is_integer() else f"{value:.3f}"


def show(where: str, last: int | None = None) -> str:
    """What ``nexrl show WHERE [--last N]`` prints."""
    path = samples_path(where)
    rows = read_samples(path)
    return render(pick(rows, last), path, len(rows), step_gaps(os.path.dirname(path)))
