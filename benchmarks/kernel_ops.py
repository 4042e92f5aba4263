"""The compiled decode kernels called as torch ops (``torch.ops.nexrl_kernels``) against the same
kernels called through ``ctypes`` (nexrl-torch-kernels before it registered them), alternated in one
process.

Two figures: the fast path's decode step of a random SmolLM2-shaped model (float32, 30 layers of
576, 16 rows; or ``--shape tiny``, the tests' 3-layer model of 48, where the calls' dispatch is
most of a step; ms per step over ``--steps`` steps, ``--repeats`` times each way), and the time of
one call of each kernel on one row of a small layer (the dispatch, nearly; µs per call). A decode
step makes about five kernel calls per layer.

    python benchmarks/kernel_ops.py --old /path/to/old/nexrl_torch_kernels [--shape smollm2|tiny]
        [--repeats 5] [--steps 24] [--threads 1]

``--old`` is a copy of the package as it was (its ``__init__.py`` and ``csrc/``), built into the same
kernel cache. About 3 minutes for SmolLM2's shape on 2 idle cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
                    tie_word_embeddings=True),
    # the tests' tiny Llama (tests/torch_plugin/test_decoding.py): the calls' dispatch is most of a step
    "tiny": dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2),
}


def load_old(folder: Path):
    """The old package under another module name, so that both live in this process."""
    spec = importlib.util.spec_from_file_location("old_nexrl_torch_kernels", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def decode_ms(fast, vocab: int, rows: int, prompt: int, steps: int) -> float:
    """ms per decode step of a fresh batch of ``rows`` prompts of ``prompt`` tokens."""
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, prompt), generator=generator)
    mask = torch.ones_like(ids)
    positions = torch.arange(prompt).expand(rows, prompt)
    with torch.inference_mode():
        session = fast.session()
        logits = session.prefill(ids, mask, positions, capacity=prompt + steps + 1)
        tokens = logits.argmax(-1)
        start = time.perf_counter()
        for step in range(steps):
            tokens = session.step(tokens, torch.full((rows,), prompt + step)).argmax(-1)
        return (time.perf_counter() - start) / steps * 1e3


def one_row_calls(kernels) -> dict:
    """A call of each kernel on one row of a small layer: its work is tiny, so its time is the dispatch."""
    import torch

    heads, kv_heads, dim, hidden = 4, 2, 8, 16
    qkv, cos, sin = torch.randn(1, (heads + 2 * kv_heads) * dim), torch.rand(1, dim), torch.rand(1, dim)
    keys, values = torch.randn(1, kv_heads, 16, dim), torch.randn(1, kv_heads, 16, dim)
    starts, attention = torch.zeros(1, dtype=torch.long), torch.empty(1, heads * dim)
    x, weight, normed = torch.randn(1, hidden), torch.rand(hidden), torch.empty(1, hidden)
    gate_up, act = torch.randn(1, 2 * hidden), torch.empty(1, hidden)
    packed = kernels.pack_linear([torch.randn(hidden, hidden)])
    return {"attend": lambda: kernels.attend(qkv, cos, sin, keys, values, starts, 3, 0.3, attention),
            "add_rms_norm": lambda: kernels.add_rms_norm(x, x, weight, 1e-5, normed),
            "silu_mul": lambda: kernels.silu_mul(gate_up, act),
            "linear": lambda: kernels.linear(x, packed, hidden, None)}


def call_us(call, calls: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the old (ctypes) nexrl_torch_kernels package folder")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import nexrl_torch_kernels
    from nexrl_torch.rollout.decoding import FastLlama

    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = {"ctypes": load_old(args.old).decode_kernels(), "torch op": nexrl_torch_kernels.decode_kernels()}
    torch.manual_seed(0)
    shape = SHAPES[args.shape]
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    fast = {way: FastLlama(model, rows_hint=args.rows, kernels=k) for way, k in kernels.items()}
    for way, f in fast.items():  # warm-up: packing, the self-check, first allocations
        decode_ms(f, shape["vocab_size"], args.rows, args.prompt, 2)
        assert f.kernels is kernels[way], f"{way}: the self-check dropped the kernels"
    step: dict[str, list[float]] = {way: [] for way in kernels}
    calls = {way: one_row_calls(k) for way, k in kernels.items()}
    names = list(calls["torch op"])
    call: dict[tuple[str, str], list[float]] = {(name, way): [] for name in names for way in kernels}
    with torch.inference_mode():
        for repeat in range(args.repeats):
            for way in list(kernels)[::1 if repeat % 2 == 0 else -1]:  # ABBA: neither always runs second
                step[way].append(decode_ms(fast[way], shape["vocab_size"], args.rows, args.prompt, args.steps))
                for name, one in calls[way].items():
                    call[name, way].append(call_us(one))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
          f"{args.shape}-shaped float32, {args.rows} rows, {args.steps} steps after a {args.prompt}-token prompt, "
          f"{args.repeats} repeats alternated (ABBA)")
    for way in kernels:
        print(f"{way:<9} decode step: median {statistics.median(step[way]):7.2f} ms, best {min(step[way]):7.2f} ms "
              f"({', '.join(f'{s:.1f}' for s in step[way])})")
    for name in names:
        print(f"one {name} call on one row (best of {args.repeats}): "
              + ", ".join(f"{way} {min(call[name, way]):.2f} us" for way in kernels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
