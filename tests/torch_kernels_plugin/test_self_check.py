"""The fast path's self-check of the compiled CPU kernels (nexrl_torch.rollout.decoding): it decodes
batches across the kernels' blocking (33, 17 and 1 rows) and holds them to float32 rounding, so a
SiLU off by 0.03%, or a bug that appears only past 16 rows, drops the kernels; correct kernels stay."""

from __future__ import annotations

from typing import cast

import pytest
import torch

from nexrl_core.runtime.run_log import LOG_FILE, setup_logging
from nexrl_torch.rollout import decoding
from nexrl_torch.rollout.decoding import FastLlama
from nexrl_torch_kernels import DecodeKernels
from tests.support.kernels import compiled_kernels
from tests.torch_plugin.test_decoding import tiny


class _Wrapped:
    """The real kernels with one call changed."""

    def __init__(self, kernels):
        self.kernels = kernels

    def __getattr__(self, name):
        return getattr(self.kernels, name)


class _SiluOff(_Wrapped):
    """SiLU times up 0.03% high: below the old check's 1e-3 of the logits' scale."""

    def silu_mul(self, gate_up, out):
        self.kernels.silu_mul(gate_up, out)
        out.mul_(1.0003)


class _WrongPast16Rows(_Wrapped):
    """Right for the first 16 rows of a call, 0.03% off past them: invisible to a 2-row check."""

    def silu_mul(self, gate_up, out):
        self.kernels.silu_mul(gate_up, out)
        out[16:].mul_(1.0003)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_correct_kernels_pass_the_check_on_every_batch(kind, tmp_path, reset_loguru):
    setup_logging(str(tmp_path), "WARNING")
    fast = FastLlama(tiny(kind), rows_hint=4, kernels=compiled_kernels())
    fast.session()
    assert fast.enabled and fast.kernels is not None and fast.batch_invariant
    assert "disagrees" not in (tmp_path / LOG_FILE).read_text()


@pytest.mark.parametrize("wrong", [_SiluOff, _WrongPast16Rows])
def test_a_small_error_in_the_kernels_drops_them(wrong, tmp_path, reset_loguru):
    setup_logging(str(tmp_path), "WARNING")
    fast = FastLlama(tiny("llama"), rows_hint=4, kernels=cast(DecodeKernels, wrong(compiled_kernels())))
    fast.session()
    assert fast.enabled and fast.kernels is None  # the torch ops, not the transformers forward
    log = (tmp_path / LOG_FILE).read_text()
    assert "with the compiled CPU kernels disagrees with the model's own forward" in log
    assert "batches of 33/17/1 rows" in log


def test_the_old_check_missed_both(monkeypatch, tmp_path, reset_loguru):
    """What the check was (2 rows within 1e-3 of the logits' scale) lets both errors through: the
    reason for the batches and the float32 tolerance above."""
    setup_logging(str(tmp_path), "WARNING")
    monkeypatch.setattr(decoding, "KERNEL_CHECK_BATCHES", (2, 1))
    monkeypatch.setattr(decoding, "KERNEL_CHECK_ULPS", decoding.SELF_CHECK_TOLERANCE / torch.finfo(torch.float32).eps)
    for wrong in (_SiluOff, _WrongPast16Rows):
        fast = FastLlama(tiny("llama"), rows_hint=4, kernels=cast(DecodeKernels, wrong(compiled_kernels())))
        fast.session()
        assert fast.kernels is not None, wrong.__name__
