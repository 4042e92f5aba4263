"""A model of Qwen3-0.6B's exact shape (151,936 words, 28 layers, 596M parameters; random weights
built from its config, so nothing is downloaded) trained for 2 GRPO steps through the ordinary
``nexrl run recipes/quickstart.yaml``, three ways, alternated in one run of this script:

- ``full``: every weight trains (float32 masters, AdamW state for all 596M);
- ``lora``: rank-16 adapters (peft) on the frozen float32 base;
- ``lora_bf16``: the same adapters on a bfloat16 base (``lora.base_dtype``, under bf16 autocast).

Per run: the peak RSS of the ``nexrl run`` process (trainer and in-process engine together: the
engine holds its own float32 copy of the model), each step's wall time and its parts (generation
while waiting for the batch, the update, the weight push). The quickstart's data (16 samples of at
most 16 tokens a step) and SmolLM2's tokenizer. A random model never answers right, so the reward is
the reply's length (a TRL-style function): the advantages, and so the gradients, are not zero
(each run's ``grad_norm`` is recorded). The figures are of the work, not of learning.

    python benchmarks/qwen3_shape_lora.py [--rounds 1] [--out benchmarks/results/qwen3_shape_lora]
    python benchmarks/qwen3_shape_lora.py --plan-only   # nexrl plan's prediction for the recorded runs

Each run also records ``nexrl plan``'s prediction for the same recipe and overrides next to its
measured peak (target: within 20%).

Needs about 14 GB free for ``full``; run it on an otherwise idle machine.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _peaks import run_with_peaks  # noqa: E402

# Qwen/Qwen3-0.6B's config.json, less what only matters for its own tokenizer.
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, attention_bias=False,
                  hidden_act="silu", initializer_range=0.02)

CONFIGS = {
    "full": [],
    "lora": ["service.train_service.lr=2e-4", "+service.train_service.lora.rank=16",
             "+service.train_service.lora.alpha=32"],
    "lora_bf16": ["service.train_service.lr=2e-4", "+service.train_service.lora.rank=16",
                  "+service.train_service.lora.alpha=32", "+service.train_service.lora.base_dtype=bfloat16",
                  "service.train_service.dtype=bfloat16"],
}


def build_model(folder: Path, weights: bool = True) -> int:
    """Save a random model of Qwen3-0.6B's shape with SmolLM2's tokenizer into ``folder`` (only its
    config and tokenizer when not ``weights``: what ``nexrl plan`` reads); its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from nexrl_torch.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  **QWEN3_0_6B)
    tokenizer.save_pretrained(folder)
    if not weights:
        config.save_pretrained(folder)
        with torch.device("meta"):
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
CLI = [sys.executable, "-c", "import sys; from nexrl_core.cli import main; sys.exit(main())"]


def overrides_of(name: str, model_dir: Path, work: Path) -> list[str]:
    rewards = work / "rewards.py"
    rewards.write_text("def length(completions, **kwargs):\n    return [len(c) / 64.0 for c in completions]\n")
    return ["trainer.total_train_steps=2", "trainer.save_freq=0", "trainer.save_final=false",
            "rollout_worker.evaluator.type=reward_funcs", f"+rollout_worker.evaluator.functions=['{rewards}:length']",
            "validate.validate_before_train=false", "weight.validate_freq=0",
            f"service.train_service.model_path={model_dir}", f"service.inference_service.model_path={model_dir}",
            *CONFIGS[name]]


def planned_bytes(name: str, model_dir: Path, work: Path) -> int:
    """``nexrl plan``'s total for the CPU, for the same recipe and overrides as the run."""
    out = subprocess.run([*CLI, "plan", "recipes/quickstart.yaml", *overrides_of(name, model_dir, work), "--json"],
                         cwd=REPO, env=ENV, capture_output=True, text=True)
    if out.returncode not in (0, 1):
        raise SystemExit(f"{name}: nexrl plan exited {out.returncode}\n{out.stderr[-4000:]}")
    return int(json.loads(out.stdout)["devices"]["cpu"]["total"])


def run_once(name: str, model_dir: Path, work: Path) -> dict:
    run_dir = work / f"{name}-{time.monotonic_ns()}"
    overrides = [f"run_dir={run_dir}", *overrides_of(name, model_dir, work)]
    started = time.monotonic()
    peaks = run_with_peaks([*CLI, "run", "recipes/quickstart.yaml", *overrides], REPO, ENV)
    if peaks.returncode != 0:
        raise SystemExit(f"{name}: nexrl run exited {peaks.returncode}\n{peaks.output[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2], steps
    parts = {key: [round(r.get(f"timing/{key}", 0.0), 2) for r in steps] for key in PARTS}
    return {"config": name, "peak_rss_gb": round(peaks.main / 1e9, 2), "plan_gb": round(planned_bytes(name, model_dir,
                                                                                                   work) / 1e9, 2),
            "run_s": round(time.monotonic() - started, 1),
            "step_s": [round(sum(parts[k][i] for k in PARTS), 2) for i in range(len(steps))], **parts,
            "grad_norm": [round(r["train/grad_norm"], 4) for r in steps], "load": list(peaks.load)}


PARTS = ("wait_batch_s", "train_s", "weight_sync_s")  # generation while waiting for the batch, update, push


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


TARGET_PLAN_ERROR = 0.20  # nexrl plan within 20% of the measured peak (issue 43)


def plan_column(r: dict) -> str:
    error = r["plan_gb"] / r["peak_rss_gb"] - 1
    return f"{r['plan_gb']:>6.2f}GB {error:+6.1%} {'met' if abs(error) <= TARGET_PLAN_ERROR else 'MISSED'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="times each configuration runs, alternated")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which of " + ", ".join(CONFIGS))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "qwen3_shape_lora"))
    parser.add_argument("--plan-only", action="store_true",
                        help="run no training: recompute nexrl plan's prediction for the runs recorded in OUT.json "
                             "(their measured peaks kept) and rewrite OUT.txt/.json")
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="qwen3-shape-") as tmp:
        work = Path(tmp)
        if args.plan_only:
            recorded = json.loads(out.with_suffix(".json").read_text())
            params = build_model(work / "model", weights=False)
            machine, results = recorded["machine"], recorded["runs"]
            for r in results:
                r["plan_gb"] = round(planned_bytes(r["config"], work / "model", work) / 1e9, 2)
        else:
            params = build_model(work / "model")
            machine = f"{cpu_name()}, {os.cpu_count()} cores"
            results = [run_once(name, work / "model", work) for _ in range(args.rounds) for name in names]
    lines = [f"Qwen3-0.6B shape ({params / 1e6:.0f}M parameters, random weights), 2 GRPO steps of the quickstart "
             f"(16 samples, <= 16 tokens); {machine}; torch {__import__('torch').__version__}",
             f"{'config':<10} {'peak RSS':>9} {'step 1':>7} {'step 2':>7}  step 2 = generation + update + push (s)"
             f"  grad_norm     nexrl plan (target within {TARGET_PLAN_ERROR:.0%} of the peak)"]
    for r in results:
        split = " + ".join(f"{r[k][1]:.1f}" for k in PARTS)
        lines.append(f"{r['config']:<10} {r['peak_rss_gb']:>7.2f}GB {r['step_s'][0]:>6.1f}s {r['step_s'][1]:>6.1f}s  "
                     f"{split:<38} {r['grad_norm'][0]:.3g}, {r['grad_norm'][1]:.3g}   {plan_column(r)}")
    print("\n".join(lines))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "parameters": params, "runs": results},
                                                   indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
