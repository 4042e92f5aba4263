"""benchmarks/async.py --dry-run: sync and fully-async with partial rollout alternated on the
long-tail shape (a tiny random model, 2 steps), each run's speed, validation curve and staleness
recorded, each mode compared with sync. (Two of its six runs: the others take the same paths with
another shape or without partial rollout, and the suite's time is bounded.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "async.py"


@pytest.mark.slow  # about 25 s: two runs of 2 steps
def test_the_dry_run_trains_sync_and_async_with_partial_rollout_and_compares_them(tmp_path):
    out = tmp_path / "async.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--shapes", "long_tail", "--modes", "sync",
                           "fully_async_partial", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["kind"] == "dry_run" and record["steps"] == 2
    runs = {(r["shape"], r["mode"]): r for r in record["runs"]}
    assert set(runs) == {("long_tail", "sync"), ("long_tail", "fully_async_partial")}
    for (_shape, mode), run in runs.items():
        assert run["steps"] == 2 and run["steps_per_s"] > 0 and run["trained_tokens_per_s"] > 0
        assert sorted(run["val_accuracy"]) == ["0", "2"]  # before training and after step 2
        assert run["staleness_max"] <= (0 if mode == "sync" else 1)
    for key, row in record["table"].items():
        assert (row["tokens_per_s_vs_sync"] == 1.0) == key.endswith("/sync")
