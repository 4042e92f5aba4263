"""``nexrl plan`` (issue #43 item 3): the memory a run holds per device, before it starts, from the
model's config alone. Parameter counts match the real model and a real peft wrap; the prediction
agrees with the peaks measured by benchmarks/qwen3_shape_lora.py within 20%; a run that does not
fit says so (exit 1) with what to change."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from nexrl_core.runtime.memory_plan import parse_size

REPO = Path(__file__).resolve().parents[2]


def _recipe(tmp_path, model_dir, engine=None, **train):
    recipe = {
        "run_dir": str(tmp_path / "run"),
        "data": {"type": "inline", "rows": [{"prompt": "what is one plus one?", "answer": "2"},
                                            {"prompt": "a longer question, about letters and words", "answer": "x"}]},
        "rollout_worker": {"num_workers": 4, "sampling": {"max_tokens": 8}, "evaluator": {"type": "exact_match"}},
        "trajectory_pool": {"batch_size": 8, "group_size": 4},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": 1},
        "weight": {"backend": "in_process"},
        "service": {"train_service": {"model_path": model_dir, **train},
                    "inference_service": {"backend": "hf", "model_path": model_dir, **(engine or {})}},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def _plan(cli, *argv):
    code, out, errors, err = cli("plan", *argv, "--json")
    assert code in (0, 1), err
    return code, json.loads(out)["devices"]


def _items(devices):
    return {f"{i['role']}: {i['what'].split(' (')[0]}": i["bytes"] for i in devices["cpu"]["items"]}


def test_counts_are_those_of_the_real_model_and_a_real_peft_wrap(cli, tmp_path, tiny_model_dir,
                                                                 tiny_model_and_tokenizer):
    from nexrl_torch.train.lora import LoraSettings, add_adapters

    model, _ = tiny_model_and_tokenizer
    params = sum(p.numel() for p in model.parameters())
    _, full = _plan(cli, _recipe(tmp_path, tiny_model_dir))
    items = _items(full)
    assert items["train service: weights"] == 4 * params
    assert items["train service: gradients"] == 4 * params and items["train service: AdamW state"] == 8 * params
    assert items["inference engine: weights"] == 4 * params
    add_adapters(model, LoraSettings(rank=4))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    _, lora = _plan(cli, _recipe(tmp_path, tiny_model_dir, lora={"rank": 4}))
    items = _items(lora)
    assert items["train service: gradients"] == 4 * adapters and items["train service: AdamW state"] == 8 * adapters
    assert items["train service: weights"] == 4 * (params + adapters)


def test_the_engine_plans_the_decode_paths_copies_of_the_weights(cli, tmp_path, tiny_model_dir,
                                                                  tiny_model_and_tokenizer):
    """On the CPU the fast decoding path keeps every linear and the LM head prepacked beside the
    engine's own weights: the plan counts the bytes a real FastLlama packs, through oneDNN (which packs
    anew at each weight push, the old matrix held until then: the largest one, a concatenation's
    source included, counted once more) or the compiled kernels (packed in place: nothing more); with
    fast_path: false, nothing."""
    from nexrl_torch.rollout.decoding import FastLlama, cpu_decode_kernels

    model, _ = tiny_model_and_tokenizer

    def packed(kernels):
        fast = FastLlama(model, 16, kernels=kernels)
        fast._pack_if_stale()
        linears = [fast.lm_head] + [lin for layer in fast.layers for lin in (layer.qkv, layer.o, layer.gate_up,
                                                                             layer.down)]
        return sum(lin.weight.numel() * lin.weight.element_size() for lin in linears)

    onednn = _items(_plan(cli, _recipe(tmp_path, tiny_model_dir, engine={"cpu_kernels": False}))[1])
    assert onednn["inference engine: decode path's weight copies"] == packed(None) > 0
    layer = model.model.layers[0]
    largest = max(model.lm_head.weight.numel(), 2 * (layer.mlp.gate_proj.weight.numel() +
                                                      layer.mlp.up_proj.weight.numel()),
                  2 * sum(getattr(layer.self_attn, n).weight.numel() for n in ("q_proj", "k_proj", "v_proj")))
    assert onednn["inference engine: repacking at a weight push"] == largest * 4
    off = _items(_plan(cli, _recipe(tmp_path, tiny_model_dir, engine={"fast_path": False}))[1])
    assert not [k for k in off if "decode path" in k or "repacking" in k]
    kernels = cpu_decode_kernels(model, "auto")
    if kernels is not None:  # they build here
        compiled = _items(_plan(cli, _recipe(tmp_path, tiny_model_dir))[1])
        assert compiled["inference engine: decode path's weight copies"] == pytest.approx(packed(kernels), rel=0.01)
        assert "inference engine: repacking at a weight push" not in compiled


def test_a_run_that_does_not_fit_says_what_to_change(cli, tmp_path, tiny_model_dir):
    recipe = _recipe(tmp_path, tiny_model_dir)
    _, devices = _plan(cli, recipe)
    total = devices["cpu"]["total"]
    code, out, errors, err = cli("plan", recipe, f"--device-memory={total // 2}")
    assert code == 1, err
    assert "does NOT fit in" in out
    lora = [line for line in out.splitlines() if "service.train_service.lora" in line]
    engine = [line for line in out.splitlines() if "service.inference_service.dtype: bfloat16" in line]
    assert len(lora) == 1 and len(engine) == 1 and "MiB" in engine[0], out
    code, out, errors, err = cli("plan", recipe, f"--device-memory={total * 2}")
    assert code == 0 and "fits in" in out, out
    code, out, errors, err = cli("plan", recipe, "--device-memory=lots")
    assert code == 2 and errors == ["error: --device-memory: 'lots' is not a memory size (e.g. 24GiB, 80GB, 512MiB)"]


def test_memory_sizes():
    assert parse_size("24GiB") == 24 << 30 and parse_size("80GB") == 80 * 10**9 and parse_size("512 MiB") == 512 << 20
    assert parse_size("1e9") == 10**9
    with pytest.raises(ValueError, match="'24 gigs' is not a memory size"):
        parse_size("24 gigs")


def test_the_plan_is_within_20_percent_of_the_measured_qwen3_shape_peaks(tmp_path):
    """The three runs of benchmarks/results/qwen3_shape_lora.json (full fine-tune, LoRA, LoRA on a
    bf16 base; peak RSS of `nexrl run` on this kind of machine), planned from the same recipe and
    overrides with a config-only model folder of the same shape, by `nexrl plan` in a fresh process
    as a user runs it (one process for the three plans: the model is built on the meta device once)."""
    import subprocess

    try:
        from nexrl_torch.models import resolve_model_path

        resolve_model_path("smollm2-135m-instruct")  # the benchmark's tokenizer
    except Exception as exc:
        pytest.skip(f"the quickstart's model is not installed: {exc}")
    recorded = json.loads((REPO / "benchmarks" / "results" / "qwen3_shape_lora.json").read_text())["runs"]
    assert {r["config"] for r in recorded} == {"full", "lora", "lora_bf16"}
    script = f"""
import contextlib, io, json, sys
sys.path.insert(0, {str(REPO / "benchmarks")!r})
import qwen3_shape_lora as bench
from pathlib import Path
from nexrl_core.cli import main
work = Path({str(tmp_path)!r})
bench.build_model(work / "model", weights=False)
out = {{}}
for name in {[r["config"] for r in recorded]!r}:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        main(["plan", "recipes/quickstart.yaml", *bench.overrides_of(name, work / "model", work), "--json"])
    out[name] = json.loads(text.getvalue())["devices"]["cpu"]["total"]
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = json.loads(proc.stdout.strip().splitlines()[-1])
    for run in recorded:
        error = planned[run["config"]] / 1e9 / run["peak_rss_gb"] - 1
        assert abs(error) <= 0.20, (run["config"], planned[run["config"]], run["peak_rss_gb"])


def test_activation_checkpointing_is_planned_and_offered(cli, tmp_path, tiny_model_dir):
    """Checkpointing keeps each layer's input and one layer's activations: the plan counts that, and
    a run without it is told what turning it on saves."""

    def plan(recipe):
        code, out, errors, err = cli("plan", recipe, "--json")
        assert code in (0, 1), err
        data = json.loads(out)
        advice = [s["bytes"] for s in data["savings"] if "activation_checkpointing" in s["change"]]
        return _items(data["devices"])["train service: activations kept for the backward"], advice

    kept, advice = plan(_recipe(tmp_path, tiny_model_dir))
    assert len(advice) == 1 and 0 < advice[0] < kept
    kept_checkpointed, advice_checkpointed = plan(_recipe(tmp_path, tiny_model_dir, activation_checkpointing=True))
    assert kept_checkpointed == kept - advice[0] and not advice_checkpointed


def test_lora_on_two_fsdp_ranks_plans_one_ranks_share_and_what_it_gathers(cli, tmp_path, tiny_model_dir,
                                                                           tiny_model_and_tokenizer):
    """world_size 2, FSDP2, LoRA: each rank holds half the frozen base, the adapters, their gradients
    and moments, and half the merged weights (its shards); it trains half the prompt groups; it
    gathers the root's parameters and two layers' for the forward and backward, and one weight
    whole when exporting (benchmarks/lora_fsdp_plan.py measures such a run against the plan)."""
    model, _ = tiny_model_and_tokenizer
    lora = {"rank": 4}
    one = _items(_plan(cli, _recipe(tmp_path, tiny_model_dir, lora=lora))[1])
    two = _items(_plan(cli, _recipe(tmp_path, tiny_model_dir, lora=lora, world_size=2, parallel="fsdp"))[1])
    for shared in ("weights", "gradients", "AdamW state", "merged weights built at each push",
                   "activations kept for the backward"):
        assert two[f"train service: {shared}"] == one[f"train service: {shared}"] // 2, shared
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - len(model.model.layers) * layer
    assert two["train service: parameters FSDP2 gathers"] == (root + 2 * layer) * 4 // 2
    assert two["train service: a weight gathered whole"] == max(p.numel() for p in model.parameters()) * 4
    assert not {"train service: parameters FSDP2 gathers", "train service: a weight gathered whole"} & set(one)
    ddp = _items(_plan(cli, _recipe(tmp_path, tiny_model_dir, lora=lora, world_size=2, parallel="ddp"))[1])
    assert ddp["train service: weights"] == one["train service: weights"]  # replicated
    assert ddp["train service: activations kept for the backward"] == two["train service: activations kept for "
                                                                          "the backward"]


def test_the_lora_fsdp_plan_against_the_measured_peaks_of_its_ranks(tmp_path):
    """benchmarks/results/lora_fsdp_plan.json: LoRA on 2 FSDP2 ranks (and on one, for reference), each
    process's peak RSS, replanned by the benchmark's --plan-only as a user's `nexrl plan` would, each
    within 20%: rank 1's process holds the train service's share alone (and the runtime), rank 0's
    also the in-process engine with the decode path's prepacked copies of the weights (the one-rank
    run likewise). Rank 0's peak varies from run to run (7.0-8.7 GB measured on 2026-12-02): the
    quickstart's keep_freed_memory keeps what the process frees, and how much of it the next
    allocations reuse depends on their order (6.6 GB without it)."""
    import shutil
    import subprocess

    try:
        from nexrl_torch.models import resolve_model_path

        resolve_model_path("smollm2-135m-instruct")  # the benchmark's tokenizer
    except Exception as exc:
        pytest.skip(f"the quickstart's model is not installed: {exc}")
    shutil.copy(REPO / "benchmarks" / "results" / "lora_fsdp_plan.json", tmp_path / "record.json")
    proc = subprocess.run([sys.executable, "benchmarks/lora_fsdp_plan.py", "--plan-only", "--out",
                           str(tmp_path / "record")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {run["world_size"]: run for run in json.loads((tmp_path / "record.json").read_text())["runs"]}
    two = runs[2]
    for run in runs.values():
        for rank, peak in run["peak_rss_gb"].items():
            assert run["plan_gb"][rank] == pytest.approx(peak, rel=0.20), run
    assert two["plan_gb"]["rank1"] < two["plan_gb"]["rank0"] and two["peak_rss_gb"]["rank1"] > 0
