"""Tiny models for the torch backend and GRPO tests: a 2-layer Llama and a byte-level BPE tokenizer built offline
(fixtures, gathered by the conftest of each of those test folders)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from tests.support.tiny_lm import CHAT_TEMPLATE, CORPUS, build_model, build_tokenizer  # noqa: E402,F401

# The runtime monitor of an end-to-end run on the tiny model: a generous health timeout, since the
# suite's other worker shares the two cores.
TINY_RUN_MONITOR = {"stop_timeout": 10, "health_check": {"check_interval": 0.5, "timeout": 10.0},
                    "exception_handling": {"check_interval": 0.05}}


def tiny_services(model_dir, lr=1e-2):
    """The ``service`` section of a one-thread run on ``model_dir``: a train service at ``lr`` (None:
    its declared default) and the ``hf`` engine."""
    train = {"model_path": model_dir, "num_threads": 1} if lr is None else \
        {"model_path": model_dir, "lr": lr, "num_threads": 1}
    return {"train_service": train, "inference_service": {"backend": "hf", "model_path": model_dir, "num_threads": 1}}


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and OpenMP barriers stall badly when the
    other core is busy (tests often share the machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """An HF folder (safetensors + tokenizer) holding the tiny model, built once per session."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture()
def tiny_model_and_tokenizer(tiny_model_dir):
    from nexrl_torch.models import load_causal_lm

    return load_causal_lm(tiny_model_dir)


@pytest.fixture()
def build_tiny_model():
    """``build(tokenizer, seed)``: a fresh tiny model (different seeds give different weights)."""
    return build_model


@pytest.fixture
def cli(monkeypatch, capfd, reset_loguru):
    """``cli(*argv)`` -> (exit code, stdout, the ``error:`` lines, stderr) of ``nexrl`` with the GRPO
    plugin and the test letters installed."""
    import nexrl_core.plugins as plugins
    from nexrl_core.cli import main
    from tests.support.letters import grpo_plugin_manager

    monkeypatch.setattr(plugins, "_DEFAULT", grpo_plugin_manager())

    def call(*argv: str):
        code = main(list(argv))
        out, err = capfd.readouterr()
        return code, out, [line for line in err.splitlines() if line.startswith("error: ")], err
    return call
