"""The packed training forward's group attention (nexrl_torch.logprobs: per group block, a dense
mask or the split layout, through torch's sdpa) against the same mask as a FlexAttention BlockMask
(``torch.nn.attention.flex_attention``, compiled), on the CPU, alternated in one process.

One attention layer of SmolLM2-135M's shape (9 query heads, 3 KV heads of 64) over a packed
sequence of 4 GRPO groups x 8 responses (a prompt, then its responses back to back; a response
sees its prompt and its own earlier tokens), at several response lengths. Measured: forward and
backward (what a training step runs 30 times, once per layer), and the forward alone under
no_grad (the trainer's log-prob pass): medians of wall and CPU time (all threads) per call.
FlexAttention's outputs are checked against today's first.

    python benchmarks/packed_attention_flex.py            # ~10 min on 2 busy cores
    python benchmarks/packed_attention_flex.py --quick    # one small layout, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from nexrl_torch.logprobs import _group_sdpa, _GroupBlock, _packed_forward, _PackedForward

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
GROUPS, RESPONSES, PROMPT = 4, 8, 48


class _Attention(torch.nn.Module):
    """What transformers' attention interface reads from the calling module."""

    scaling = HEAD_DIM ** -0.5
    is_causal = True
    num_key_value_groups = HEADS // KV_HEADS


def layout(response_lengths: list[int]) -> list[_GroupBlock]:
    """The group blocks of one packed sequence: GROUPS groups, each a prompt and these responses."""
    blocks, start = [], 0
    for _ in range(GROUPS):
        blocks.append(_GroupBlock(start, PROMPT, list(response_lengths)))
        start = blocks[-1].end
    return blocks


def todays(blocks: list[_GroupBlock]):
    module = _Attention()

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        token = _packed_forward.set(_PackedForward(blocks))
        try:  # [1, heads, T, d] in, [1, T, heads, d] out, as transformers calls it
            return _group_sdpa(module, q, k, v, None, dropout=0.0, scaling=module.scaling)[0]
        finally:
            _packed_forward.reset(token)
    return attend


def flex(blocks: list[_GroupBlock]):
    """The same mask as a BlockMask: a token sees the earlier tokens of its own group that are its
    prompt's or its own response's. Built once per packed sequence (every layer reuses it)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    group, segment = [], []
    for index, block in enumerate(blocks):
        group += [index] * (block.end - block.start)
        segment += [-1] * block.prompt + [r for r, n in enumerate(block.responses) for _ in range(n)]
    group_of, segment_of = torch.tensor(group), torch.tensor(segment)

    def sees(batch, head, q, kv):
        return (kv <= q) & (group_of[q] == group_of[kv]) & ((segment_of[kv] == segment_of[q]) | (segment_of[kv] < 0))

    tokens = len(group)
    started = time.perf_counter()
    mask = create_block_mask(sees, None, None, tokens, tokens, device="cpu")
    build = time.perf_counter() - started
    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return compiled(q, k, v, block_mask=mask, scale=_Attention.scaling, enable_gqa=True).transpose(1, 2)
    return attend, build, mask.sparsity()


def flex_backward_problem() -> str | None:
    """Why FlexAttention cannot run a backward here (None: it can). Asked of the uncompiled function:
    a compiled one that failed once runs uncompiled (its slow reference path) from then on."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = inputs(128, True)
    try:
        flex_attention(q, k, v, enable_gqa=True).sum().backward()
    except NotImplementedError as exc:  # torch 2.13: no FlexAttention backward on the CPU
        return str(exc)
    return None


def inputs(tokens: int, grad: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, tokens, HEAD_DIM, generator=g).requires_grad_(grad)
                 for heads in (HEADS, KV_HEADS, KV_HEADS))


def timed(attend, tokens: int, backward: bool) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds (all threads: less moved by other jobs' load)."""
    q, k, v = inputs(tokens, backward)
    grad = torch.randn(1, tokens, HEADS, HEAD_DIM)
    started, cpu = time.perf_counter(), time.process_time()
    if backward:
        (attend(q, k, v) * grad).sum().backward()
    else:
        with torch.no_grad():
            attend(q, k, v)
    return time.perf_counter() - started, time.process_time() - cpu


def cpu_model() -> str:
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[48, 128, 256], help="response lengths")
    parser.add_argument("--rounds", type=int, default=7, help="alternations of A and B per measurement")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "packed_attention_flex.json"))
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.rounds = [48], 3
    torch.manual_seed(0)
    load_before = os.getloadavg()
    report = {"machine": f"{cpu_model()}, {os.cpu_count()} cores",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "load_before": load_before,
              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "groups": GROUPS,
                        "responses": RESPONSES, "prompt": PROMPT},
              "layouts": []}

    for length in args.lengths:
        blocks = layout([length] * RESPONSES)
        tokens = blocks[-1].end
        today = todays(blocks)
        row: dict = {"response_length": length, "tokens": tokens,
                     "today_layout": "split" if blocks[0].split else "square"}
        flex_attend, build, sparsity = flex(blocks)
        row["flex_mask_build_s"], row["flex_mask_sparsity_pct"] = build, sparsity
        q, k, v = inputs(tokens, False)
        with torch.no_grad():
            reference = today(q, k, v)
            started = time.perf_counter()
            row["flex_max_abs_diff"] = float((flex_attend(q, k, v) - reference).abs().max())
            row["flex_compile_and_first_call_s"] = time.perf_counter() - started
        row["flex_backward"] = flex_backward_problem()
        for backward in (True, False):
            timed(today, tokens, backward)  # warm
            a, b = [], []
            for _ in range(args.rounds):
                a.append(timed(today, tokens, backward))
                if row["flex_backward"] is None or not backward:
                    b.append(timed(flex_attend, tokens, backward))
            kind = "forward_backward" if backward else "forward_no_grad"
            for name, times in (("today", a), ("flex", b)):
                row[f"{name}_{kind}_ms"] = 1000 * statistics.median(t for t, _ in times) if times else None
                row[f"{name}_{kind}_cpu_ms"] = 1000 * statistics.median(c for _, c in times) if times else None
        report["layouts"].append(row)
        print(json.dumps(row), flush=True)
    report["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
