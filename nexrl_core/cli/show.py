"""``nexrl show RUN_DIR``: what the model said, in the terminal.

Reads ``RUN_DIR/samples.jsonl`` (written by ``nexrl run`` at the first and last step and every
``logger.samples_every`` steps) or the ``samples.jsonl`` of a ``nexrl eval --out`` folder, and
prints each sample readably: the weight version that sampled it (per token when its tokens came
from several), the prompt (each chat message with its role), the reply, the reward,
the advantage where the trainer recorded one, the evaluator's other scores, and the sample's
trainer-vs-rollout log-prob gap where it is large (the step's, for a trainer that records none
per sample).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import yaml

from ..algorithms.rollout_correction import ROLLOUT_CORRECTION_DEFAULTS
from ..errors import ConfigError
from ..runtime.run_info import CONFIG_FILE
from ..runtime.run_log import METRICS_FILE, SAMPLES_FILE, read_jsonl

_LABEL = 9  # width of the field names, so every text starts in one column
#: the per-step metric of the largest per-token |trainer - rollout log-prob| (rollout_mismatch_metrics),
#: shown for a sample whose trainer recorded no ``logprob_gap`` of its own
GAP_KEY = "train/rollout_logprob_diff_max"
#: a sample's own gap: ``{"max", "position"[, "token", "segment"]}`` (the GRPO trainers record it)
SAMPLE_GAP = "logprob_gap"


def large_gap(folder: str) -> float:
    """A gap above this is large: ln of the run's ``algorithm.rollout_correction.cap`` (from its
    config.yaml; the option's default without one), where the correction would cap the token's
    importance weight: the token was more than ``cap`` times as likely to one side as to the other."""
    cap = ROLLOUT_CORRECTION_DEFAULTS["cap"]
    try:
        with open(os.path.join(folder, CONFIG_FILE), encoding="utf-8") as f:
            run_cap = ((yaml.safe_load(f) or {}).get("algorithm") or {}).get("rollout_correction", {}).get("cap")
    except (OSError, AttributeError, yaml.YAMLError):
        run_cap = None
    if _is_number(run_cap) and run_cap >= 1:
        cap = run_cap
    return math.log(float(cap))


def sample_gap(row: dict[str, Any]) -> dict[str, Any] | None:
    """The row's own log-prob gap record, when it holds a usable one."""
    gap = row.get(SAMPLE_GAP)
    return gap if isinstance(gap, dict) and _is_number(gap.get("max")) else None


def gap_where(gap: dict[str, Any]) -> str:
    """``token 5 " the"`` (``segment 1`` first for a trajectory of several): where the gap is largest;
    the token's text JSON-quoted, so whitespace and control characters show as escapes."""
    parts = []
    if isinstance(gap.get("segment"), int):
        parts.append(f"segment {gap['segment']}")
    if isinstance(gap.get("position"), int):
        parts.append(f"token {gap['position']}" + (f" {json.dumps(gap['token'], ensure_ascii=False)}" if isinstance(gap.get("token"), str)
                                                   else ""))
    return " ".join(parts)


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


def render(rows: list[dict[str, Any]], source: str, total: int, gaps: dict[int, float] | None = None,
           large: float | None = None) -> str:
    """The text ``nexrl show`` prints for ``rows`` (of ``total`` in ``source``); each sample's own
    log-prob gap, else ``gaps``: its step's (:func:`step_gaps`), shown above ``large``
    (:func:`large_gap`)."""
    if not rows:
        return f"{source}: no samples"
    steps = sorted({r["step"] for r in rows if isinstance(r.get("step"), int)})
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}" if steps else "evaluation"
    blocks = [f"{source}: {len(rows)} of {total} samples ({where})"]
    large = math.log(ROLLOUT_CORRECTION_DEFAULTS["cap"]) if large is None else large
    blocks += [_sample(r, (gaps or {}).get(r["step"]) if isinstance(r.get("step"), int) else None, large)
               for r in rows]
    return "\n\n".join(blocks)


def _sample(row: dict[str, Any], step_gap: float | None, large: float) -> str:
    head = []
    if isinstance(row.get("step"), int):
        head.append(f"step {row['step']}")
    head.append(f"sample {row.get('uid')}#{row.get('sample_index', 0)}")
    if row.get("data_source") not in (None, "default"):
        head.append(str(row["data_source"]))
    weights = weights_text(row)
    if weights:
        head.append(weights)
    head.append(f"reward {_number(row.get('reward'))}")
    if _is_number(row.get("advantage")):
        head.append(f"advantage {row['advantage']:+.3f}")
    own = sample_gap(row)
    if own is not None and own["max"] > large:
        where = gap_where(own)
        head.append(f"log-prob gap {own['max']:.3g}{f' at {where}' if where else ''} (large)")
    elif own is None and step_gap is not None and step_gap > large:
        head.append(f"step's log-prob gap {step_gap:.3g} (large)")
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


def weights_text(row: dict[str, Any]) -> str | None:
    """``weights v4``; for a sample whose tokens came from several weight versions (its
    ``token_versions``), their range and how many tokens each gave: ``weights v3-4 per token
    (v3 ×5, v4 ×7)`` (the counts left out beyond three versions)."""
    versions = row.get("token_versions")
    if isinstance(versions, list) and versions and all(isinstance(v, int) and not isinstance(v, bool)
                                                       for v in versions):
        counts = {v: versions.count(v) for v in sorted(set(versions))}
        if len(counts) > 1:
            span = f"weights v{min(counts)}-{max(counts)} per token"
            return span + (f" ({', '.join(f'v{v} ×{n}' for v, n in counts.items())})" if len(counts) <= 3 else "")
    if row.get("model_version") is not None:
        return f"weights v{row['model_version']}"
    return None


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
    folder = os.path.dirname(path)
    return render(pick(rows, last), path, len(rows), step_gaps(folder), large_gap(folder))
