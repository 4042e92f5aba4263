"""The real ``tinker`` SDK against the local stand-in on loopback, backed by a tiny Llama."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The SDK's own usage reporting: a client a test leaves behind flushes it later, after that test's
# stand-in stopped, and the SDK logs the refused connection's traceback into whichever test then
# captures stderr (seen once in the suite). Nothing here tests it.
os.environ.setdefault("TINKER_TELEMETRY", "0")

import pytest
import torch

from tests.support.tiny_lm import build_model, build_tokenizer
from tests.tinker_plugin.helpers import API_KEY, MODEL


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, tokenizer):
    """The tiny model as an HF folder (tokenizer included)."""
    folder = tmp_path_factory.mktemp("tiny_tinker")
    build_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def make_standin(tmp_path, tokenizer):
    """``make_standin(**kwargs)`` -> a started StandinServer serving ``tiny`` (stopped at the end)."""
    from nexrl_tinker.standin import BaseModel, StandinServer

    servers = []

    def make(**kwargs):
        kwargs.setdefault("state_dir", str(tmp_path / f"state{len(servers)}"))
        kwargs.setdefault("try_again_polls", 1)  # every future answers "try again" once: the SDK polls
        server = StandinServer({MODEL: BaseModel(MODEL, build_model(tokenizer), tokenizer)}, **kwargs).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def standin(make_standin):
    return make_standin()


@pytest.fixture
def service_client(standin):
    import tinker

    client = tinker.ServiceClient(base_url=standin.url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=30)


@pytest.fixture(scope="session")
def run_env(tmp_path_factory) -> dict[str, str]:
    """Environment of ``nexrl`` subprocesses: offline, one torch thread, no Tinker credentials of the
    caller's, and the reliability suite's test plugin (evaluator ``letter_share``) installed as a
    distribution with an entry point."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    root = tmp_path_factory.mktemp("reltest_dist")
    info = root / "nexrl_reltest-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nexrl-reltest\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[nexrl]\nreltest = tests.reliability.reltest_plugin\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("NEXRL_LOAD_PLUGINS", "TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_CREDENTIAL_CMD")}
    env.update({"PYTHONPATH": os.pathsep.join([str(root), str(repo)]), "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "HOME": str(tmp_path_factory.mktemp("home"))})  # no key stored by `tinker auth login`
    return env
