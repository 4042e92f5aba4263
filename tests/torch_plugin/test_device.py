"""Device placement and the GPU decoding path, as far as the CPU runs them: the device logic, the
KV-cache budget arithmetic, the static-cache decode path (the code a GPU replays as CUDA graphs,
run eagerly here), the seed-and-index sampler it uses, and out-of-memory errors that name the keys
to lower. `benchmarks/gpu_check.py` runs the CUDA side on a lent GPU."""

from __future__ import annotations

import pytest
import torch

from nexrl_core import NexRLError
from nexrl_core.runtime.inference import SamplingParams
from nexrl_core.runtime.run_log import LOG_FILE, setup_logging
from nexrl_torch.models import auto_dtype, device_problem, resolve_device
from nexrl_torch.rollout.decoding import (
    FastLlama,
    HFDecoder,
    HFSession,
    StaticLlama,
    StaticSession,
    kv_budget_tokens,
    kv_token_bytes,
    make_session_factory,
    static_capacity,
    static_rows,
)
from nexrl_torch.rollout.engine import HFInferenceEngine, counter_uniform
from nexrl_torch.train.service import LocalTorchTrainService
from tests.torch_plugin.test_decoding import PROMPTS, SCRIPT, TOKENS, run_script, tiny

NO_CUDA = not torch.cuda.is_available()


def test_device_names_resolve_and_bad_ones_say_why():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None) == resolve_device("auto") == (torch.device("cuda", 0) if not NO_CUDA
                                                              else torch.device("cpu"))
    assert device_problem("gpu") == "'gpu' is not one of auto, cpu, cuda, cuda:N"
    assert device_problem("cuda:x") is not None
    with pytest.raises(ValueError, match="^device: 'tpu' is not one of"):
        resolve_device("tpu")
    if NO_CUDA:
        assert "no CUDA device is visible" in device_problem("cuda:0")
    else:
        assert "CUDA device(s) are visible" in device_problem(f"cuda:{torch.cuda.device_count()}")


def test_auto_device_is_said_once_in_the_run_log(tmp_path, tiny_model_dir, reset_loguru):
    setup_logging(str(tmp_path), level="INFO")
    service = LocalTorchTrainService({"model_path": tiny_model_dir, "device": "auto"})
    explicit = LocalTorchTrainService({"model_path": tiny_model_dir, "device": "cpu"})
    assert service.device == explicit.device == torch.device("cpu") or not NO_CUDA
    log = (tmp_path / LOG_FILE).read_text()
    assert log.count("train service device auto -> ") == 1
    if NO_CUDA:
        assert "train service device auto -> cpu (no CUDA device visible)" in log


def test_auto_precision_on_a_gpu_is_bf16_where_it_computes_it(monkeypatch):
    """The one branch the CPU cannot take: what the GPU reports is patched."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert auto_dtype("auto", cuda) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert auto_dtype("auto", cuda) == "float32"
    assert auto_dtype("float32", cuda) == "float32"


def test_kv_budget_arithmetic():
    """SmolLM2-135M's shape: 30 layers, 3 KV heads of 64, bf16: 23,040 bytes of keys and values a token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    assert kv_token_bytes(model) == 2 * 30 * 3 * 64 * 2 == 23040
    gib = 1 << 30
    # 0.3 of an 80 GiB card, less 0.25 GiB of weights and 0.5 GiB of workspace.
    assert kv_budget_tokens(80 * gib, 0.3, gib // 4, gib // 2, 23040) == int((24 - 0.75) * gib // 23040)
    assert kv_budget_tokens(gib, 0.1, gib, 0, 23040) == 0  # the weights alone exceed the share
    assert (static_rows(1), static_rows(5), static_rows(8), static_rows(9)) == (1, 8, 8, 16)
    assert (static_capacity(1), static_capacity(64), static_capacity(65)) == (64, 64, 128)
    assert StaticLlama.footprint(5, 70) == 8 * 128 and HFDecoder.footprint(5, 70) == 350


@pytest.mark.parametrize("kind,extra", [("llama", {}), ("llama", {"tie_word_embeddings": False}),
                                        ("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen2", {})])
def test_static_session_matches_model_forward(kind, extra):
    """Prefill, expansion to a GRPO group's samples, lazy drops, compaction, reordering: the static
    layout's logits equal the model's own forward."""
    model = tiny(kind, **extra)
    static = StaticLlama(model, rows_hint=4, kv_tokens=4096)
    session = static.session()
    assert isinstance(session, StaticSession) and static.enabled  # the self-check passed
    got = run_script(session, PROMPTS, SCRIPT, TOKENS)
    want = run_script(HFSession(model), PROMPTS, SCRIPT, TOKENS)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)


class _OnDevice:
    """A session fed the CPU tensors of the decoding scripts, moved to ``device`` first."""

    def __init__(self, session, device):
        self.session, self.device = session, device

    def prefill(self, ids, mask, pos, capacity=None):
        return self.session.prefill(ids.to(self.device), mask.to(self.device), pos.to(self.device), capacity)

    def select(self, rows):
        self.session.select(rows.to(self.device))

    def step(self, tokens, positions):
        return self.session.step(tokens.to(self.device), positions.to(self.device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [False, True])
def test_static_session_on_the_gpu_matches_model_forward(graphs):
    """What a GPU runs: the static layout's decode steps, eager and replayed as CUDA graphs (the
    next replay overwrites the graph's output), equal the model's own forward on the same card."""
    model = tiny("llama").cuda()
    static = StaticLlama(model, rows_hint=4, kv_tokens=4096, graphs=graphs)
    session = static.session()
    assert isinstance(session, StaticSession) and static.enabled and static.graphs == graphs
    got = run_script(_OnDevice(session, "cuda"), PROMPTS, SCRIPT, TOKENS)
    want = run_script(_OnDevice(HFSession(model), "cuda"), PROMPTS, SCRIPT, TOKENS)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_static_rows_move_in_place_without_a_second_copy():
    """The engine's selections (expand a prompt to its samples, keep an ascending subset) move row
    blocks inside the pool: the pool is the only KV storage, sized up front to the batch's footprint
    (not the whole budget), and the layout shrinks to the live rows."""
    model = tiny("llama")
    static = StaticLlama(model, kv_tokens=8 * 64)
    ids = torch.tensor([[3, 4, 5], [0, 6, 7]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        session = static.session(tokens=StaticLlama.footprint(6, 16))  # as the engine: 6 samples of 2 prompts
        session.prefill(ids, mask, pos, capacity=16)
        pool = static.pool.data_ptr()
        session.select(torch.tensor([0, 0, 0, 1, 1, 1]))  # 6 rows: 8 padded
        assert session.rows == 8 and session.starts[:6] == [0, 0, 0, 1, 1, 1]
        session.step(torch.arange(6) + 10, torch.tensor([3, 3, 3, 2, 2, 2]))
        session.select(torch.tensor([1, 2, 4]))  # 3 live rows of 8: compacted into a layout of 4
        assert session.rows == 4 and session.live is not None and session.starts[:3] == [0, 0, 1]
        assert static.pool.data_ptr() == pool
    with pytest.raises(ValueError, match="needs 1024 tokens of KV cache; the budget holds 512"):
        static.view(16, 64)


def test_the_static_pool_fits_the_batch_and_grows_keeping_its_rows():
    """A small batch under a large budget takes a small pool; a batch that outgrows it (no footprint
    given up front) gets a larger one with every row's keys where they were."""
    model = tiny("llama")
    static = StaticLlama(model, kv_tokens=1 << 20)
    static.session()  # the self-check's own small batch
    static.release()
    per_token = 2 * len(static.layers) * static.num_kv_heads * static.layers[0].head_dim
    with torch.inference_mode():
        session = static.session(tokens=StaticLlama.footprint(2, 16))
        assert static.pool.numel() == 128 * per_token  # 2 rows x 64 columns, not the budget
        ids, mask = torch.tensor([[3, 4, 5], [0, 6, 7]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
        session.prefill(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), capacity=16)
        before = session.blocks[:2].clone()
        session.select(torch.tensor([0, 0, 1, 1, 1]))  # 5 rows: 8 padded, 512 tokens
        assert static.pool.numel() == 512 * per_token
        torch.testing.assert_close(session.blocks[[0, 2]], before, atol=0, rtol=0)
        allocated = static.pool_allocations
        static.session(tokens=StaticLlama.footprint(4, 16))  # fits: the pool stays
        assert static.pool_allocations == allocated
        static.release()
        static.session(tokens=StaticLlama.footprint(4, 16))
        assert static.pool_allocations == allocated + 1 and static.graph_captures == 0  # no graphs on the CPU


def test_static_refresh_keeps_addresses_and_serves_new_weights():
    """Weights updated in place (an engine's load_weights) reach the fused matrices at the same
    addresses: what a captured CUDA graph keeps reading. float64: oneDNN does not prepack it, so the
    CPU runs the GPU's unpacked layout."""
    model = tiny("llama").double()
    static = StaticLlama(model, kv_tokens=4096)
    before = run_script(static.session(), PROMPTS, SCRIPT[:2], TOKENS[:2])
    addresses = [layer.qkv.weight.data_ptr() for layer in static.layers]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = run_script(static.session(), PROMPTS, SCRIPT[:2], TOKENS[:2])
    assert [layer.qkv.weight.data_ptr() for layer in static.layers] == addresses
    want = run_script(HFSession(model), PROMPTS, SCRIPT[:2], TOKENS[:2])
    assert not torch.allclose(before[-1], after[-1])
    for g, w in zip(after, want):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9)


def test_counter_uniforms_are_a_function_of_seed_and_index():
    seeds = torch.tensor([0, 1, 2**62 + 3, 2**63 - 1])
    u = torch.stack([counter_uniform(seeds, t) for t in range(2000)])
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(counter_uniform(seeds, 7), u[7])  # no hidden state
    assert torch.equal(counter_uniform(seeds[2:3], 7), u[7, 2:3])  # a row's draw ignores the others
    assert len(torch.unique(u)) == u.numel()
    # Each seed's stream is uniform: the deciles hold 10% each within sampling noise (200 +- ~50).
    for column in u.T:
        counts = torch.histc(column.float(), bins=10, min=0, max=1)
        assert bool((counts > 140).all() and (counts < 260).all()), counts
    assert abs(float(torch.corrcoef(torch.stack([u[:-1, 1], u[1:, 1]]))[0, 1])) < 0.1  # successive draws


def _engine(model, tokenizer, **config):
    engine = HFInferenceEngine({"max_batch_size": 16, "batch_wait_ms": 50, **config}, model=model,
                               tokenizer=tokenizer)
    engine.counter_rng = True  # the GPU's source of uniforms
    return engine


def _complete_all(engine, prompts, params):
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(engine.complete, prompts, params))
    finally:
        engine.close()


def test_engine_on_the_static_path_samples_what_the_model_forward_samples(tiny_model_and_tokenizer):
    """The engine's GPU configuration on the CPU: static cache, seed-and-index uniforms, a KV budget
    small enough that the batch is decoded in parts, the cache released when idle. Same tokens as
    the model's own forward with the same uniforms; log-probs to float tolerance."""
    model, tokenizer = tiny_model_and_tokenizer
    prompts = ["the quick brown fox", "hello", "count: one, two, three", "the quick brown fox"] * 2
    params = [SamplingParams(max_tokens=10, temperature=t, seed=i, top_p=0.95 if i % 3 else 1.0)
              for i, t in enumerate([1.0, 0.0, 0.8, 1.0, 1.2, 1.0, 0.0, 0.9])]
    reference = _complete_all(_engine(model, tokenizer, fast_path=False), prompts, params)
    engine = _engine(model, tokenizer, max_kv_tokens=4 * 64)
    prefills = []

    class Counted(StaticLlama):
        def _fast_session(self):
            session = super()._fast_session()
            if self._checked:  # not the self-check's sessions
                prefill = session.prefill
                session.prefill = lambda ids, *a, **k: prefills.append(len(ids)) or prefill(ids, *a, **k)
            return session

    engine.decoder = Counted(model, rows_hint=4, kv_tokens=engine.kv_tokens, release=True)
    got = _complete_all(engine, prompts, params)
    # 4 rows of 64 columns fill the budget: 8 requests take at least two parts.
    assert len(prefills) >= 2 and engine.decoder.pool is None  # released when idle
    for g, r in zip(got, reference):
        assert g.response_token_ids == r.response_token_ids
        assert g.response_logprobs == pytest.approx(r.response_logprobs, abs=1e-4)
    # A request that cannot fit the budget fails with the keys to change, the engine keeps serving.
    small = _engine(model, tokenizer, max_kv_tokens=8)
    from nexrl_core import InferenceError

    with pytest.raises(InferenceError, match="one request needs .* tokens of KV cache; the engine holds 8: raise "
                                             "service.inference_service.gpu_memory_utilization or max_kv_tokens"):
        small.complete("hello", SamplingParams(max_tokens=10, temperature=0))
    assert small.health_check()
    small.close()


def test_session_factory_choices():
    model = tiny("llama")
    assert type(make_session_factory(model, "auto", 4)) is FastLlama  # the CPU's fast path
    with pytest.raises(ValueError, match="cuda_graphs: true needs the fast decoding path .* on a CUDA device"):
        make_session_factory(model, "auto", 4, graphs=True)


class _OutOfMemoryModel(torch.nn.Module):
    """A model whose forward runs out of device memory (what a GPU does at a batch too large)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_out_of_memory_names_the_keys_to_lower(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    service = LocalTorchTrainService({"device": "cpu", "micro_batch_size": 8, "packing": False},
                                     model=_OutOfMemoryModel(model), tokenizer=tokenizer)
    batch = {"input_ids": torch.ones(2, 6, dtype=torch.long), "attention_mask": torch.ones(2, 6, dtype=torch.long),
             "responses": torch.ones(2, 3, dtype=torch.long), "response_mask": torch.ones(2, 3)}
    with pytest.raises(NexRLError) as caught:
        service.forward_backward(batch, lambda lp, mb: (lp.sum(), {}))
    message = str(caught.value)
    assert message.startswith("service.train_service: out of memory on cpu in forward_backward: lower "
                              "micro_batch_size (now 8), or set offload_optimizer: true")
    assert "Traceback" not in message and caught.value.__cause__ is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_offloaded_optimizer_state_waits_on_the_host_and_steps_as_on_the_device(tiny_model_dir, tmp_path, device):
    """``offload_optimizer``: AdamW's moments wait on the host between steps, the weights after two
    steps equal those of a service that keeps them on the device, and a checkpoint saved right
    after a step holds the moments that step made (the copies to the host are asynchronous)."""
    from safetensors.torch import load_file

    from tests.grpo_plugin.test_train_service import grpo_loss, random_batch

    services = {offload: LocalTorchTrainService({"model_path": tiny_model_dir, "lr": 1e-3, "seed": 0,
                                                 "device": device, "offload_optimizer": offload})
                for offload in (False, True)}
    for step in range(2):
        batch = random_batch(step, rows=8)
        for service in services.values():
            service.forward_backward(batch, grpo_loss())
            service.optim_step()
    kept, offloaded = services[False], services[True]
    moments = [v for state in offloaded.optimizer.state.values() for k, v in state.items() if k != "step"]
    assert moments and all(v.device.type == "cpu" for v in moments)
    for (name, a), (_, b) in zip(kept.model.named_parameters(), offloaded.model.named_parameters()):
        assert torch.equal(a, b), name
    offloaded.save_checkpoint(tmp_path / "offloaded")
    kept.save_checkpoint(tmp_path / "kept")
    saved = {name: load_file(tmp_path / name / "optimizer.safetensors") for name in ("kept", "offloaded")}
    assert saved["kept"].keys() == saved["offloaded"].keys()
    for key, value in saved["kept"].items():
        assert torch.equal(value, saved["offloaded"][key]), key
