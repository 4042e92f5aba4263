"""A run's metrics.jsonl as tests compare it."""

from __future__ import annotations

import json
from pathlib import Path


def without_clock(rows: list[dict]) -> list[dict]:
    """The rows less what the wall clock decides (``time`` stamps, ``timing/*``): two runs that
    compute the same things agree on the rest."""
    return [{k: v for k, v in row.items() if k != "time" and not k.startswith("timing/")} for row in rows]


def read_metrics(run_dir: str | Path, clock: bool = False) -> list[dict]:
    """Every row of ``run_dir/metrics.jsonl``; without the clock's keys unless ``clock``."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows if clock else without_clock(rows)
