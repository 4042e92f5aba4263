"""The guard of benchmarks/grpo_vs_trl.py (``--quick``): its command line and how it compares a run
with a recorded reference. Nothing here times anything or runs TRL."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_vs_trl.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("grpo_vs_trl", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stdlib only at import: TRL and torch load inside main()
    return module


def run_like(bench, ratios, cpu="Test CPU (family 1 model 2, 2 cores, native bf16)", **args):
    base = vars(bench.parse_args(["--quick"]))
    base["lr"] = 1e-5
    return {"date": "2026-01-01 00:00 UTC", "cpu": cpu, "ratios": dict(ratios), "args": {**base, **args}}


def test_the_guard_functions_load_without_torch_or_trl():
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('g', {str(SCRIPT)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m.parse_args(['--quick']); "
            "sys.exit(('torch' in sys.modules) * 1 + ('trl' in sys.modules) * 2)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_quick_fills_its_settings_and_an_explicit_flag_wins(bench):
    quick = bench.parse_args(["--quick"])
    assert (quick.mode, quick.blocks, quick.steps_per_block, quick.roofline_rows) == ("quick", 3, 1, -1)
    assert quick.trl_precisions == ["bf16"] and quick.nexrl_dtype == ["recipe"]
    full = bench.parse_args([])
    assert (full.mode, full.blocks, full.steps_per_block, full.trl_precisions) == ("full", 3, 2, ["bf16", "fp32"])
    mixed = bench.parse_args(["--quick", "--blocks", "4", "--trl-precisions", "fp32"])
    assert (mixed.blocks, mixed.trl_precisions, mixed.steps_per_block) == (4, ["fp32"], 1)
    assert bench.REFERENCES["quick"].endswith("benchmarks/results/grpo_vs_trl_quick.json")
    assert bench.parse_args(["--quick", "--record"]).record is True
    assert quick.noise is None and bench.parse_args(["--noise", "0.2"]).noise == 0.2  # None: by the load


def test_noise_must_be_a_positive_fraction(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--quick", "--noise", "0"])
    assert exc.value.code == 2
    assert "--noise must be a positive fraction, got 0.0" in capsys.readouterr().err


def test_a_drop_beyond_the_threshold_is_flagged_and_a_small_one_is_not(bench):
    ref = run_like(bench, {"nexrl-fp32 / TRL-bf16": 2.5, "nexrl-bf16 / TRL-bf16": 3.0})
    run = run_like(bench, {"nexrl-fp32 / TRL-bf16": 2.0, "nexrl-bf16 / TRL-bf16": 2.9})
    lines, slower = bench.compare_to_reference(run, ref, 0.1, "ref.json")
    assert slower == ["nexrl-fp32 / TRL-bf16 by 20.0%"]
    assert "  nexrl-fp32 / TRL-bf16: 2.00x now, 2.50x recorded: SLOWER by 20.0%" in lines
    assert "  nexrl-bf16 / TRL-bf16: 2.90x now, 3.00x recorded: -3.3%, within noise (10%)" in lines
    assert lines[0] == "against ref.json (2026-01-01 00:00 UTC, CPU Test CPU (family 1 model 2, 2 cores, native bf16)):"
    # The same drop under a wider threshold passes; a rise beyond it is reported, never flagged.
    assert bench.compare_to_reference(run, ref, 0.25, "ref.json")[1] == []
    lines, slower = bench.compare_to_reference(ref, run, 0.1, "ref.json")
    assert slower == [] and "  nexrl-fp32 / TRL-bf16: 2.50x now, 2.00x recorded: faster by 25.0%" in lines


def test_judged_against_a_reference_from_another_cpu_and_says_so(bench):
    """The ratio is nexrl against TRL in the same run: judged on any CPU, at the same threshold."""
    ref = run_like(bench, {"nexrl-fp32 / TRL-bf16": 2.5})
    other_cpu = run_like(bench, {"nexrl-fp32 / TRL-bf16": 1.5}, cpu="Other CPU")
    lines, slower = bench.compare_to_reference(other_cpu, ref, 0.1, "ref.json")
    assert slower == ["nexrl-fp32 / TRL-bf16 by 40.0%"]
    assert lines[1:] == ["  judged on this run's ratios against TRL, with the reference ratio from another CPU (this "
                         "one: Other CPU): a change beyond noise may be the CPU's as well as the code's",
                         "  nexrl-fp32 / TRL-bf16: 1.50x now, 2.50x recorded: SLOWER by 40.0%"]
    same = run_like(bench, {"nexrl-fp32 / TRL-bf16": 2.4}, cpu="Other CPU")
    assert bench.compare_to_reference(same, ref, 0.1, "ref.json")[1] == []


def test_other_settings_are_another_measurement_and_not_judged(bench):
    ref = run_like(bench, {"nexrl-fp32 / TRL-bf16": 2.5})
    other_steps = run_like(bench, {"nexrl-fp32 / TRL-bf16": 1.5}, blocks=2, cpu="Other CPU")
    lines, slower = bench.compare_to_reference(other_steps, ref, 0.1, "ref.json")
    assert slower is None and lines[1:] == ["  not judged (other settings: blocks 3 -> 2)",
                                            "  nexrl-fp32 / TRL-bf16: 1.50x now, 2.50x recorded: -40.0%"]


@pytest.mark.parametrize("cpu", ["Test CPU (family 1 model 2, 2 cores, native bf16)", "Other CPU"])
def test_a_20_percent_slower_nexrl_step_fails_the_guard_on_a_quiet_machine_whatever_the_cpu(bench, cpu):
    """nexrl's step 20% longer, TRL's unchanged: the ratio falls to 1/1.2 of the reference (-16.7%),
    beyond the quiet threshold (exit status 1); on a busy machine (40%) it passes as noise."""
    ref = run_like(bench, {"nexrl-fp32 / TRL-bf16": 2.78})
    slowed = run_like(bench, {"nexrl-fp32 / TRL-bf16": 2.78 / 1.2}, cpu=cpu)
    _, slower = bench.compare_to_reference(slowed, ref, bench.NOISE["quiet"], "ref.json")
    assert slower == ["nexrl-fp32 / TRL-bf16 by 16.7%"]
    line, status = bench.guard_outcome("quick", cpu, slower, bench.NOISE["quiet"], ref)
    assert status == 1 and line.startswith(f"guard (quick mode, CPU {cpu}): SLOWER: nexrl-fp32 / TRL-bf16 by 16.7%")
    assert line.endswith("(the reference ratio came from another CPU: Test CPU (family 1 model 2, 2 cores, "
                         "native bf16))") == (cpu == "Other CPU")
    _, slower = bench.compare_to_reference(slowed, ref, bench.NOISE["busy"], "ref.json")
    line, status = bench.guard_outcome("quick", cpu, slower, bench.NOISE["busy"], ref)
    assert status == 0 and "no ratio fell by more than 40%" in line


def test_the_guard_passes_only_what_it_judged(bench):
    ref = run_like(bench, {"nexrl-fp32 / TRL-bf16": 2.5})
    assert bench.guard_outcome("quick", "Other CPU", [], 0.1, ref) == (
        "guard (quick mode, CPU Other CPU): no ratio fell by more than 10% (the reference ratio came from another "
        "CPU: Test CPU (family 1 model 2, 2 cores, native bf16))", 0)
    assert bench.guard_outcome("quick", "Other CPU", None, 0.1, None) == (
        "guard (quick mode, CPU Other CPU): not judged (see above)", 0)


def test_the_cpu_seconds_ratio_is_shown_beside_and_never_judged(bench):
    ref = {**run_like(bench, {"nexrl-fp32 / TRL-bf16": 2.0}), "cpu_ratios": {"nexrl-fp32 / TRL-bf16": 1.8}}
    run = {**run_like(bench, {"nexrl-fp32 / TRL-bf16": 1.9}), "cpu_ratios": {"nexrl-fp32 / TRL-bf16": 1.2}}
    lines, slower = bench.compare_to_reference(run, ref, 0.1, "ref.json")
    assert slower == []
    assert lines[-1] == ("  nexrl-fp32 / TRL-bf16: 1.90x now, 2.00x recorded: -5.0%, within noise (10%)"
                         "   (CPU seconds: 1.20x now, 1.80x recorded, -33.3%)")


def test_missing_reference_and_missing_key(bench):
    run = run_like(bench, {"nexrl-fp32 / TRL-bf16": 2.0, "nexrl-bf16 / TRL-bf16": 2.9})
    lines, slower = bench.compare_to_reference(run, None, 0.1, "results/q.json")
    assert slower is None and "--record" in lines[0] and "results/q.json" in lines[0]
    ref = run_like(bench, {"nexrl-fp32 / TRL-bf16": 2.0})
    lines, slower = bench.compare_to_reference(run, ref, 0.1, "ref.json")
    assert slower == [] and "  nexrl-bf16 / TRL-bf16: 2.90x, none recorded" in lines


def test_other_jobs_load_is_the_load_before_or_the_peak_less_own_threads(bench):
    assert bench.other_load("0.20 0.30 0.40", ["1.90 1.0 0.5", "2.10 1.2 0.6"], 2) == 0.2  # quiet: only this run
    assert bench.other_load("0.20 0.30 0.40", ["1.90 1.0 0.5", "5.50 2.0 1.0"], 2) == 3.5  # a job came mid-run
    assert bench.other_load("4.00 3.00 2.00", ["4.50 3.0 2.0"], 2) == 4.0  # busy before it started
    assert bench.other_load("n/a", [], 2) == 0.0  # no load average on this platform


def test_reference_files_load_or_stop_with_their_name(bench, tmp_path):
    assert bench.load_reference(str(tmp_path / "absent.json")) is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"ratios": {\n  "a": }\n')
    with pytest.raises(SystemExit, match=rf"{bad}:2: not valid JSON"):
        bench.load_reference(str(bad))
    bad.write_text('{"times": {}}')
    with pytest.raises(SystemExit, match=rf"{bad}: no 'ratios' mapping"):
        bench.load_reference(str(bad))


def test_the_recorded_full_run_is_a_usable_reference(bench):
    # The committed result must stay readable by the guard: the same run against itself is unchanged.
    ref = bench.load_reference(bench.REFERENCES["full"])
    assert ref is not None and ref["ratios"]
    lines, slower = bench.compare_to_reference(copy.deepcopy(ref), ref, bench.NOISE["quiet"], "full")
    assert slower == []
    assert sum("+0.0%, within noise" in line for line in lines) == len(ref["ratios"])
