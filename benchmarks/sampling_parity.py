"""Does nexrl's engine sample like transformers' ``generate``? Mean reward of the untrained model.

The same prompts (the quickstart's training rows, through the chat template, no system prompt), temperature 1.0, top_p 1, no top_k,
<= 48 new tokens, SmolLM2-135M-Instruct fp32: ``--prompts`` prompts x ``--samples`` samples
through ``HFInferenceEngine`` (fast decoding path, inverse-CDF sampler) and through
``model.generate(do_sample=True)``. The two means should agree within their standard errors; a
sampler that drew from a different distribution (a wrong temperature, a truncation, a
mis-scaled logit) shows up here as a gap. This is what ``grpo_vs_trl.py``'s per-step rewards,
16 samples from two different random streams, cannot tell.

    python benchmarks/sampling_parity.py                 # 32 prompts x 8 samples, ~5 min
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import threading

QUICKSTART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "quickstart.yaml")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    from nexrl_core.builtins.dataloaders import ArithmeticDataLoader
    from nexrl_core.builtins.evaluators import NumericAnswerEvaluator
    from nexrl_core.evaluation import BaseEvaluationTarget
    from nexrl_core.launch.recipe import load_recipe
    from nexrl_core.runtime.inference import SamplingParams
    from nexrl_torch.models import load_causal_lm, resolve_model_path
    from nexrl_torch.rollout.engine import HFInferenceEngine

    evaluator = NumericAnswerEvaluator()
    model, tokenizer = load_causal_lm(resolve_model_path("smollm2-135m-instruct"))
    loader = ArithmeticDataLoader(load_recipe(QUICKSTART).data, is_validate=False)
    rows = [loader[i] for i in range(min(args.prompts, loader.num_rows()))]
    messages = [[{"role": "user", "content": row["prompt"]}] for row in rows]

    def reward(text: str, row: dict) -> float:
        return evaluator.evaluate(row, BaseEvaluationTarget(final_answer=text)).reward

    engine = HFInferenceEngine({"max_batch_size": 64}, model=model, tokenizer=tokenizer)
    results: dict[tuple[int, int], str] = {}

    def one(i: int, k: int) -> None:
        params = SamplingParams(temperature=1.0, max_tokens=args.max_new_tokens, seed=args.seed * 100_003 + 1000 * i + k)
        results[(i, k)] = engine.complete(messages[i], params).text

    for start in range(0, len(rows), 4):  # 4 prompts x samples per engine batch, as in a GRPO step
        threads = [threading.Thread(target=one, args=(i, k))
                   for i in range(start, min(start + 4, len(rows))) for k in range(args.samples)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    engine.close()
    engine_rewards = [reward(results[(i, k)], rows[i]) for i in range(len(rows)) for k in range(args.samples)]

    generate_rewards = []
    torch.manual_seed(args.seed)
    with torch.inference_mode():
        for row, message in zip(rows, messages):
            enc = tokenizer.apply_chat_template(message, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            out = model.generate(input_ids=enc["input_ids"].repeat(args.samples, 1),
                                 attention_mask=enc["attention_mask"].repeat(args.samples, 1), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id)
            for ids in out[:, enc["input_ids"].shape[1]:]:
                generate_rewards.append(reward(tokenizer.decode(ids, skip_special_tokens=True), row))

    n = len(engine_rewards)
    print(f"sampling_parity: {len(rows)} prompts x {args.samples} samples, temperature 1.0, "
          f"<= {args.max_new_tokens} new tokens, untrained SmolLM2-135M-Instruct")
    means = {}
    for name, rewards in (("nexrl engine", engine_rewards), ("transformers generate", generate_rewards)):
        means[name] = m = statistics.mean(rewards)
        print(f"  {name:<22} mean reward {m:.3f}  (standard error {math.sqrt(m * (1 - m) / n):.3f}, n={n})")
    diff = means["nexrl engine"] - means["transformers generate"]
    se = math.sqrt(sum(m * (1 - m) / n for m in means.values()))
    print(f"  difference {diff:+.3f} = {diff / se if se else 0.0:+.1f} standard errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
