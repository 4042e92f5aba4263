"""benchmarks/guard_slowdown.py's patch reaches the engine's decode steps (else its "deliberate
slowdown" would slow nothing): counted on a tiny model through the fast path and the transformers
forward. Nothing here times anything."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.support.torch_fixtures import *  # noqa: F401,F403

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "guard_slowdown.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("guard_slowdown", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fast_path", ["true", "false"])
def test_every_decode_step_after_the_prefill_is_counted(script, tiny_model_and_tokenizer, monkeypatch, fast_path):
    from nexrl_core.runtime.inference import SamplingParams
    from nexrl_torch.rollout.engine import HFInferenceEngine

    calls = script.slow_decode_steps(0.0, patch=monkeypatch.setattr)
    model, tokenizer = tiny_model_and_tokenizer
    engine = HFInferenceEngine({"fast_path": fast_path, "max_batch_size": 1}, model=model, tokenizer=tokenizer)
    try:
        engine.complete("warm", SamplingParams(max_tokens=2, temperature=0.0))  # the fast path's self-check decodes
        before = calls[0]
        results = [engine.complete("the quick brown fox", SamplingParams(max_tokens=n, temperature=0.0))
                   for n in (5, 9)]
    finally:
        engine.close()
    # the prefill gives the first token; each later one takes a decode step
    assert calls[0] - before == sum(len(r.response_token_ids) - 1 for r in results) > 0
