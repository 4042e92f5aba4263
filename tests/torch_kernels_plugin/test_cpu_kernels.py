"""The compiled CPU decode kernels (nexrl_torch_kernels): each against torch, a row's bits against
its batch and the thread count, the build and its cache, and what the engine does without them."""

from __future__ import annotations

import os
import shlex
import stat

import pytest
import torch
import torch.nn.functional as F

import nexrl_torch_kernels as cpu_kernels
from nexrl_core.runtime.run_log import LOG_FILE, setup_logging
from nexrl_torch.rollout import decoding
from nexrl_torch.rollout.decoding import FastLlama, FastLlamaSession, _rotate, decode_attention, make_session_factory
from tests.support.kernels import compiled_kernels, compiler_or_skip
from tests.torch_plugin.test_decoding import PROMPTS, SCRIPT, TOKENS, run_script, tiny

# SmolLM2's attention (9 heads over 3 KV heads of 64), and a head of 24 (one block of 16 and a tail).
SHAPES = [(9, 3, 64), (4, 2, 24)]


def _attention_inputs(rows, heads, kv_heads, dim, dtype, capacity=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    angle = torch.rand(rows, dim // 2, generator=generator) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    keys = torch.randn(rows, kv_heads, capacity, dim, generator=generator).to(dtype)
    values = torch.randn(rows, kv_heads, capacity, dim, generator=generator).to(dtype)
    return qkv, cos, sin, keys, values


def _attention_reference(qkv, cos, sin, keys, values, starts, column, scaling, heads, kv_heads, dim):
    """The torch ops' decode step (rotary, cache write, attention per row), in float32."""
    rows = qkv.shape[0]
    q, k, v = qkv.float().split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    c, s = cos.float()[:, None, None], sin.float()[:, None, None]
    q = _rotate(q.view(rows, heads, 1, dim), c, s)
    keys, values = keys.clone(), values.clone()
    keys[:, :, column] = _rotate(k.view(rows, kv_heads, 1, dim), c, s)[:, :, 0].to(keys.dtype)
    values[:, :, column] = v.view(rows, kv_heads, dim).to(values.dtype)
    out = []
    for row, start in enumerate(starts.tolist()):
        grouped = q[row].reshape(kv_heads, heads // kv_heads, dim)
        part = decode_attention(grouped, keys[row, :, start:column + 1].float(), values[row, :, start:column + 1].float(),
                                scaling)
        out.append(part.reshape(heads * dim))
    return torch.stack(out), keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
def test_attention_matches_the_torch_ops(heads, kv_heads, dim, dtype):
    kernels = compiled_kernels()
    rows, column, scaling = 6, 30, dim ** -0.5
    qkv, cos, sin, keys, values = _attention_inputs(rows, heads, kv_heads, dim, dtype)
    starts = torch.tensor([0, 0, 3, 3, 17, 30])  # the last row's only key is the new one
    want, want_keys, want_values = _attention_reference(qkv, cos, sin, keys, values, starts, column, scaling, heads,
                                                        kv_heads, dim)
    out = torch.empty(rows, heads * dim, dtype=dtype)
    kernels.attend(qkv, cos, sin, keys, values, starts, column, scaling, out)
    assert torch.equal(values, want_values)  # the value is copied as it is
    if dtype == torch.float32:
        torch.testing.assert_close(keys, want_keys, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:  # one bf16 rounding apart at most
        torch.testing.assert_close(keys.float(), want_keys.float(), atol=0.02, rtol=2 ** -7)
        torch.testing.assert_close(out.float(), want, atol=0.02, rtol=2 ** -7)
    # The last row attends to its new key only: its output is that value, whatever the scores.
    torch.testing.assert_close(out[5].float().view(kv_heads, -1, dim),
                               values[5, :, column].float()[:, None].expand(kv_heads, heads // kv_heads, dim),
                               atol=1e-6, rtol=2 ** -7)
    # Some rows only, each at its own cache row (the live rows of a batch): the same bits.
    live = torch.tensor([4, 1])
    part = torch.empty(2, heads * dim, dtype=dtype)
    kernels.attend(qkv[live], cos[live], sin[live], keys, values, starts, column, scaling, part, cache_rows=live)
    assert torch.equal(part, out[live])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 45])
def test_norm_and_silu_match_the_torch_ops(hidden, dtype):
    kernels = compiled_kernels()
    generator = torch.Generator().manual_seed(hidden)
    x, delta = (torch.randn(5, hidden, generator=generator).to(dtype) for _ in range(2))
    weight = (1 + torch.randn(hidden, generator=generator) / 4).to(dtype)
    summed = x + delta  # rounded to the dtype, as the model's residual add
    want = weight * F.rms_norm(summed.float(), (hidden,), None, 1e-5).to(dtype)
    out = torch.empty_like(x)
    kernels.add_rms_norm(x, delta, weight, 1e-5, out)
    assert torch.equal(x, summed)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-6, rtol=2 ** -7)
    torch.testing.assert_close(out.float(), want.float(), **tolerance)
    kernels.add_rms_norm(x, None, weight, 1e-5, out)  # no residual: x unchanged
    assert torch.equal(x, summed)
    gate_up = torch.randn(5, 2 * hidden, generator=generator).to(dtype) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamps
    act = torch.empty(5, hidden, dtype=dtype)
    kernels.silu_mul(gate_up, act)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(act.float(), F.silu(gate) * up, **tolerance)


# (k, output sizes of the linears packed side by side): SmolLM2's q/k/v; sizes and a k that are not
# multiples of the 16-column panels, with sources meeting inside a panel; one weight of 49 columns.
LINEAR_SHAPES = [(576, (576, 192, 192)), (37, (5, 16, 21)), (24, (49,))]


@pytest.mark.parametrize("k,sizes", LINEAR_SHAPES)
def test_the_few_row_matmul_matches_torch(k, sizes):
    kernels = compiled_kernels()
    generator = torch.Generator().manual_seed(k)
    weights = [torch.randn(n, k, generator=generator) * k ** -0.5 for n in sizes]  # outputs of about 1
    n, full = sum(sizes), torch.cat(weights).double()
    bias = torch.randn(n, generator=generator)
    packed = kernels.pack_linear(weights)
    for rows in (1, 3, 16, 17, 40):  # one chunk of 16 rows, a part of one, several
        wide = torch.randn(rows, k + 3, generator=generator)
        for x in (wide[:, :k], wide[:, :k].contiguous()):  # rows apart by their stride, or packed
            for b in (None, bias):
                want = F.linear(x.double(), full, None if b is None else b.double())
                torch.testing.assert_close(kernels.linear(x, packed, n, b).double(), want, atol=1e-5, rtol=1e-5)
    # New values packed in place (what a weight push does): the same buffer, the new product.
    address = packed.data_ptr()
    assert kernels.pack_linear([2 * w for w in weights], packed) is packed and packed.data_ptr() == address
    x = torch.randn(5, k, generator=generator)
    torch.testing.assert_close(kernels.linear(x, packed, n, None).double(), 2 * F.linear(x.double(), full),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="packed weight holds"):
        kernels.pack_linear([*weights, torch.zeros(16, k)], packed)


def test_a_rows_matmul_bits_do_not_depend_on_its_batch_or_the_thread_count():
    kernels = compiled_kernels()
    k, sizes = LINEAR_SHAPES[0]
    generator = torch.Generator().manual_seed(3)
    packed = kernels.pack_linear([torch.randn(n, k, generator=generator) for n in sizes])
    own = torch.randn(k, generator=generator)
    threads = torch.get_num_threads()
    try:
        results = []
        for rows in (1, 2, 5, 8, 9, 16, 17, 33):  # every register layout of the kernel, and several chunks
            for where in sorted({0, rows // 2, rows - 1}):
                for count in (1, 2):
                    torch.set_num_threads(count)
                    x = torch.randn(rows, k, generator=generator)
                    x[where] = own
                    results.append(kernels.linear(x, packed, sum(sizes), None)[where])
        assert all(torch.equal(got, results[0]) for got in results[1:])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_thread_count(dtype):
    """A row computed beside 1 to 31 others, at any place, with one and two threads: the same bits."""
    kernels = compiled_kernels()
    heads, kv_heads, dim = SHAPES[0]
    column, scaling = 50, dim ** -0.5
    threads = torch.get_num_threads()
    try:
        qkv, cos, sin, keys, values = _attention_inputs(1, heads, kv_heads, dim, dtype, capacity=64, seed=1)
        start = torch.tensor([7])
        results = []
        for rows in (1, 2, 5, 16, 32):
            for where in sorted({0, rows // 2, rows - 1}):
                for count in (1, 2):
                    torch.set_num_threads(count)
                    batch = _attention_inputs(rows, heads, kv_heads, dim, dtype, capacity=64, seed=rows)
                    for part, own in zip(batch, (qkv, cos, sin, keys, values)):
                        part[where] = own[0]
                    starts = torch.randint(0, column, (rows,), generator=torch.Generator().manual_seed(rows))
                    starts[where] = start[0]
                    out = torch.empty(rows, heads * dim, dtype=dtype)
                    kernels.attend(*batch[:3], batch[3], batch[4], starts, column, scaling, out)
                    normed, act = torch.empty(rows, heads * dim, dtype=dtype), torch.empty(rows, dim, dtype=dtype)
                    kernels.add_rms_norm(out, batch[0][:, :heads * dim].contiguous(), values[0, 0, 0].repeat(heads),
                                         1e-5, normed)
                    kernels.silu_mul(batch[0][:, :2 * dim].contiguous(), act)
                    results.append((out[where], normed[where], act[where], batch[3][where, :, column]))
        for got in results[1:]:
            for part, first in zip(got, results[0]):
                assert torch.equal(part, first)
    finally:
        torch.set_num_threads(threads)


def test_the_engine_decodes_through_the_kernels_by_default():
    compiled_kernels()
    model = tiny("llama")
    assert make_session_factory(model, "auto", 4).kernels is not None
    assert make_session_factory(model, "auto", 4, cpu_kernels="auto").kernels is not None
    assert make_session_factory(model, "auto", 4, cpu_kernels=False).kernels is None  # a YAML boolean
    with pytest.raises(ValueError, match="cpu_kernels: true needs the fast decoding path"):
        make_session_factory(model, "false", 4, cpu_kernels="true")
    with pytest.raises(ValueError, match="cpu_kernels: 'often' is not one of auto, true, false"):
        make_session_factory(model, "auto", 4, cpu_kernels="often")
    # A model the kernels cannot run: auto decodes with torch ops, true says why.
    from transformers import LlamaConfig, LlamaForCausalLM

    gelu = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, hidden_act="gelu"))
    assert make_session_factory(gelu, "auto", 4).kernels is None
    with pytest.raises(ValueError, match="cpu_kernels: true, but .*activation GELUActivation"):
        make_session_factory(gelu, "auto", 4, cpu_kernels=True)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache and no kernels loaded in this process (restored afterwards)."""
    monkeypatch.setenv("NEXRL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setattr(cpu_kernels, "_problem", None)
    monkeypatch.setattr(decoding, "KERNEL_PROBLEMS_SAID", set())
    return tmp_path


def _script(path, text):
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_machine_without_a_compiler_decodes_with_torch_ops(fresh_build, monkeypatch, reset_loguru):
    setup_logging(str(fresh_build), "INFO")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(ValueError, match="cpu_kernels: true, but the compiled decode kernels cannot run: they cannot "
                                         "be built here: CXX='no-such-compiler-here' is not an executable"):
        make_session_factory(tiny("llama"), "auto", 4, cpu_kernels="true")
    decoder = make_session_factory(tiny("llama"), "auto", 4)
    assert decoder.kernels is None
    with torch.inference_mode():
        assert type(decoder.session()) is FastLlamaSession and decoder.enabled
    log = (fresh_build / LOG_FILE).read_text()
    said = [line for line in log.splitlines() if "cpu_kernels: they cannot be built here" in line]
    assert len(said) == 1 and "WARNING" in said[0] and "decoding with torch ops" in said[0], log
    assert not (fresh_build / "cache").exists()


@pytest.mark.parametrize("version,problem", [
    ("g++ (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0\nCopyright (C) 2021 Free Software Foundation, Inc.",
     "GCC 11.4.0 is older than GCC 12, which the kernels need"),
    ("g++ (Debian 12.2.0-14+deb12u1) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.", None),
    ("Debian clang version 14.0.6\nTarget: x86_64-pc-linux-gnu", None),
])
def test_the_compiler_version_is_checked_before_a_build(version, problem):
    assert cpu_kernels.compiler_version_problem(version) == problem


def test_a_compiler_too_old_is_named_once_and_the_engine_decodes_with_torch_ops(fresh_build, monkeypatch,
                                                                                reset_loguru):
    """g++ 11 cannot build the kernels: the build is not tried, the engine says so once, and the kernel
    tests of such a machine skip with that reason (tests/support/kernels.py) instead of failing."""
    setup_logging(str(fresh_build), "INFO")
    old = _script(fresh_build / "g++", 'case "$*" in --version) echo "g++ (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0"; '
                                        'exit 0;; esac\necho "compiled" >&2; exit 1\n')
    monkeypatch.setenv("CXX", old)
    with pytest.raises(cpu_kernels.CompilerUnusable, match="GCC 11.4.0 is older than GCC 12"):
        cpu_kernels.usable_compiler()
    with pytest.raises(pytest.skip.Exception, match="GCC 11.4.0 is older than GCC 12"):
        compiler_or_skip()
    first = make_session_factory(tiny("llama"), "auto", 4)
    again = make_session_factory(tiny("llama"), "auto", 4)
    assert first.kernels is None and again.kernels is None
    said = [line for line in (fresh_build / LOG_FILE).read_text().splitlines() if "older than GCC 12" in line]
    assert len(said) == 1 and "WARNING" in said[0], said
    assert not (fresh_build / "cache" / "kernels").exists() or list((fresh_build / "cache" / "kernels").iterdir()) == []


def test_a_failing_compiler_is_quoted_and_a_build_is_made_once(fresh_build, monkeypatch):
    compiler = shlex.join(compiler_or_skip())  # the real one, before CXX points elsewhere
    # A compiler that fails: its last lines make the error.
    monkeypatch.setenv("CXX", _script(fresh_build / "broken", 'case "$*" in --version) echo "g++ (fake) 12.2.0"; exit 0;; '
                                                              'esac\necho "decode_step.cpp:1: error: no" >&2; exit 3\n'))
    with pytest.raises(cpu_kernels.KernelBuildError, match=r"broken failed \(exit 3\): decode_step.cpp:1: error: no"):
        cpu_kernels.decode_kernels()
    with pytest.raises(cpu_kernels.KernelBuildError, match="exit 3"):  # said once per process, not retried
        cpu_kernels.decode_kernels()
    assert list((fresh_build / "cache" / "kernels").iterdir()) == []  # nothing half-written left
    # The real compiler through a wrapper that counts its compilations (not its --version calls),
    # behind a launcher (CXX may hold several words, as with ccache).
    count = fresh_build / "count"
    counting = _script(fresh_build / "counting", f'case "$*" in *decode_step.cpp*) echo x >> {count};; esac\n'
                                                  f'exec {compiler} "$@"\n')
    monkeypatch.setenv("CXX", f"env {counting}")
    for _ in range(2):
        monkeypatch.setattr(cpu_kernels, "_loaded", None)
        monkeypatch.setattr(cpu_kernels, "_problem", None)
        loaded = cpu_kernels.decode_kernels()
        assert loaded.path.parent == fresh_build / "cache" / "kernels"
    assert count.read_text() == "x\n"  # the second process-level load found the file
    assert os.access(loaded.path, os.R_OK)


class _Skewed:
    """Kernels whose SiLU is off by 1%: what a miscompiled build would look like."""

    def __init__(self, kernels):
        self.kernels = kernels

    def __getattr__(self, name):
        return getattr(self.kernels, name)

    def silu_mul(self, gate_up, out):
        self.kernels.silu_mul(gate_up, out)
        out.mul_(1.01)


def test_the_self_check_drops_kernels_that_disagree(tmp_path, reset_loguru):
    setup_logging(str(tmp_path), "WARNING")
    model = tiny("llama")
    fast = FastLlama(model, rows_hint=4, kernels=_Skewed(compiled_kernels()))
    got = run_script(fast.session(), PROMPTS, SCRIPT, TOKENS)
    assert fast.enabled and fast.kernels is None  # torch ops, not the transformers forward
    want = run_script(FastLlama(model, rows_hint=4).session(), PROMPTS, SCRIPT, TOKENS)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert "with the compiled CPU kernels disagrees with the model's own forward" in (tmp_path / LOG_FILE).read_text()
