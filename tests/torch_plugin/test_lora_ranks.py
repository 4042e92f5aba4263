"""LoRA with several ranks (real gloo groups on the CPU, DDP and FSDP2): only the adapters' gradients
cross ranks, and 2 ranks reach the adapters, merged weights, PEFT-format checkpoint and export of
one process on the same global batches; a 2-rank resume equals the uninterrupted 2-rank run bit for
bit."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nexrl_torch.train.lora import ADAPTER_FOLDER
from nexrl_torch.train.service import LocalTorchTrainService, export_model_folder
from tests.grpo_plugin.test_distributed import loss_fn, make_batch

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
# float32 with a different summation order across ranks (and AdamW's fused kernel in one process)
TIGHT = {"atol": 1e-6, "rtol": 1e-5}


def lora_service(model_dir, **extra) -> LocalTorchTrainService:
    # Micro-batches of 2 over 5 rows: rank 1 gets fewer rows and runs an empty pass for the collectives.
    # eps well above rounding noise: lora_A's first gradients are near zero (B starts at zero), and
    # AdamW's step of about lr * sign(grad) would turn their summation-order noise into weight differences.
    return LocalTorchTrainService({"model_path": model_dir, "lr": 1e-2, "eps": 1e-4, "seed": 3, "device": "cpu",
                                   "packing": False, "micro_batch_size": 2, "lora": dict(LORA), **extra})


def step(service, batch) -> dict:
    metrics = service.forward_backward(batch, loss_fn)
    metrics["trained"] = sorted(n for n, p in service.model.named_parameters() if p.grad is not None)
    return {**metrics, **service.optim_step()}


def merged(service) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in service.export_weights().items()}


def adapter(service, folder: Path) -> dict[str, torch.Tensor]:
    service.export_adapter(folder)
    return load_file(str(folder / "adapter_model.safetensors"))


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, **TIGHT, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_the_adapters_of_one_and_resume_bit_exact(tiny_model_dir, tmp_path, parallel):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batches = [make_batch(seed=s) for s in range(3)]
    one = lora_service(tiny_model_dir)
    want = [step(one, b) for b in batches[:2]]
    assert all(m["grad_norm"] > 0 for m in want)  # a learning signal: equal weights below are trained ones
    one.save_checkpoint(tmp_path / "one", {"global_step": 2})

    two = lora_service(tiny_model_dir, world_size=2, parallel=parallel)
    try:
        got = [step(two, b) for b in batches[:2]]
        # Only the adapters have gradients (all that DDP all-reduces / FSDP2 reduce-scatters).
        assert got[0]["trained"] and all(".lora_A." in n or ".lora_B." in n for n in got[0]["trained"])
        for g, w in zip(got, want):
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
            # AdamW nearly hides a gradient's scale in the weights: the norm catches halved or unsummed ones.
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
        # forward first: the engine's version check scores with it before the next push exports
        torch.testing.assert_close(two.forward(batches[0]), one.forward(batches[0]), **TIGHT)
        assert_close(adapter(two, tmp_path / "two_adapter"), adapter(one, tmp_path / "one_adapter"))
        assert_close(merged(two), merged(one))  # what the engine is sent
        two.save_checkpoint(tmp_path / "two", {"global_step": 2})
        step(two, batches[2])
        uninterrupted = merged(two)
    finally:
        two.close()

    # The checkpoint: PEFT's adapter (PeftModel.from_pretrained loads it) beside the merged model, both
    # the one-process run's; `nexrl export` of it too (adapter by default, merged with the flag).
    ckpt = tmp_path / "two"
    assert_close(load_file(str(ckpt / ADAPTER_FOLDER / "adapter_model.safetensors")),
                 load_file(str(tmp_path / "one" / ADAPTER_FOLDER / "adapter_model.safetensors")))
    assert_close(load_file(str(ckpt / "model.safetensors")), load_file(str(tmp_path / "one" / "model.safetensors")))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True),
                                        str(ckpt / ADAPTER_FOLDER))
    merged_model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)
    ids = torch.tensor([[5, 9, 17, 33, 2, 41]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged_model(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    for flag in (False, True):
        exported = {}
        for name in ("one", "two"):
            out = tmp_path / f"export_{name}_{flag}"
            out.mkdir()
            export_model_folder(tmp_path / name, out, merged=flag)
            exported[name] = out
        weights = "model.safetensors" if flag else "adapter_model.safetensors"
        assert sorted(p.name for p in exported["two"].iterdir()) == sorted(p.name for p in exported["one"].iterdir())
        assert_close(load_file(str(exported["two"] / weights)), load_file(str(exported["one"] / weights)))

    resumed = lora_service(tiny_model_dir, world_size=2, parallel=parallel)
    try:
        assert resumed.load_checkpoint(ckpt) == {"global_step": 2}
        step(resumed, batches[2])
        again = merged(resumed)
    finally:
        resumed.close()
    assert set(again) == set(uninterrupted)
    assert all(torch.equal(again[k], uninterrupted[k]) for k in again), \
        [k for k in again if not torch.equal(again[k], uninterrupted[k])][:3]



def optimizer_state(service: LocalTorchTrainService) -> dict[str, torch.Tensor]:
    """A one-process service's AdamW state by parameter name (exp_avg, exp_avg_sq, step)."""
    by_param = dict(zip(service._params, service._param_names))
    return {f"{by_param[p]}.{key}": value.clone() for p, state in service.optimizer.state.items()
            for key, value in state.items()}


def saved_adapter(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / ADAPTER_FOLDER / "adapter_model.safetensors"))


def within(seconds: float, call, *args):
    """``call(*args)`` in a thread; fails when it is still running after ``seconds`` (a wait on a
    collective that never completes)."""
    result: dict = {}

    def run():
        try:
            result["value"] = call(*args)
        except BaseException as exc:  # noqa: BLE001 - raised again below
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(call, '__name__', call)} still running after {seconds}s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# FSDP2 only: its sharded checkpoint is the case that changes with the world size (DDP writes the
# one-process format, which the one-rank resumes above already read); ~100 s a case on 2 cores.
@pytest.mark.parametrize("parallel", ["fsdp"])
def test_a_checkpoint_resumes_on_another_world_size(tiny_model_dir, tmp_path, parallel):
    """Saved by 2 ranks, resumed by 1, and 1 -> 2: the adapter and AdamW's state come back bit for bit
    (whatever the shards), so the next step is the uninterrupted run's within the summation-order noise
    of a batch split over ranks (TIGHT, as 2 ranks against 1 above); not bit-exact, as the log warns."""
    batches = [make_batch(seed=s) for s in range(3)]
    one = lora_service(tiny_model_dir)
    for b in batches[:2]:
        step(one, b)
    one.save_checkpoint(tmp_path / "one", {"global_step": 2})
    one_state = optimizer_state(one)
    assert any(k.endswith(".exp_avg_sq") and float(v.abs().max()) > 0 for k, v in one_state.items())
    want_one = step(one, batches[2])

    two = lora_service(tiny_model_dir, world_size=2, parallel=parallel)
    try:
        for b in batches[:2]:
            step(two, b)
        two.save_checkpoint(tmp_path / "two", {"global_step": 2})
        want_two = step(two, batches[2])
        after_two = merged(two)

        # 2 -> 1, while the 2 ranks' process group lives in this process (a run's other model): one
        # process reads the shards alone (it waited for ranks that never came)
        alone = lora_service(tiny_model_dir)
        assert within(120, alone.load_checkpoint, tmp_path / "two") == {"global_step": 2}
        assert same(adapter(alone, tmp_path / "alone_adapter"), saved_adapter(tmp_path / "two"))
        assert all(v.item() == 2 for k, v in optimizer_state(alone).items() if k.endswith(".step"))
        got = step(alone, batches[2])
        assert got["loss"] == pytest.approx(want_two["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want_two["grad_norm"], rel=1e-5)
        assert_close(merged(alone), after_two)

        # 1 -> 2
        assert two.load_checkpoint(tmp_path / "one") == {"global_step": 2}
        two.save_checkpoint(tmp_path / "spread", {"global_step": 2})  # read back by one process below
        got = step(two, batches[2])
        assert got["loss"] == pytest.approx(want_one["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want_one["grad_norm"], rel=1e-5)
        assert_close(merged(two), merged(one))
    finally:
        two.close()

    # 1 -> 2 -> 1: every bit of the adapter and of AdamW's state survived being sharded and gathered
    back = lora_service(tiny_model_dir)
    back.load_checkpoint(tmp_path / "spread")
    assert same(optimizer_state(back), one_state)
    assert same(adapter(back, tmp_path / "back_adapter"), saved_adapter(tmp_path / "one"))
