"""benchmarks/async.py --dry-run: sync, fully-async and fully-async with partial rollout alternated
on both shapes (a tiny random model, 2 steps), each run's speed, validation curve and staleness
recorded, each mode compared with sync."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "async.py"


@pytest.mark.slow  # about 70 s on the shared 2-core machine: six runs of 2 steps
def test_the_dry_run_trains_every_mode_on_both_shapes_and_compares_them(tmp_path):
    out = tmp_path / "async.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["kind"] == "dry_run" and record["steps"] == 2
    runs = {(r["shape"], r["mode"]): r for r in record["runs"]}
    assert set(runs) == {(s, m) for s in ("quickstart", "long_tail")
                         for m in ("sync", "fully_async", "fully_async_partial")}
    for (_shape, mode), run in runs.items():
        assert run["steps"] == 2 and run["steps_per_s"] > 0 and run["trained_tokens_per_s"] > 0
        assert sorted(run["val_accuracy"]) == ["0", "2"]  # before training and after step 2
        assert run["staleness_max"] <= (0 if mode == "sync" else 1)
    assert runs[("long_tail", "sync")]["response_length_mean"] > runs[("quickstart", "sync")]["response_length_mean"]
    for key, row in record["table"].items():
        assert (row["tokens_per_s_vs_sync"] == 1.0) == key.endswith("/sync")
