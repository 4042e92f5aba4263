"""Fixtures of the nexrl-rewards tests."""

from __future__ import annotations

import pytest

from tests.support.judge import ScriptedJudge
from tests.support.openai_server import FakeOpenAIServer


@pytest.fixture(scope="module")
def _judge_server_once():
    with FakeOpenAIServer(responder=ScriptedJudge()) as server:
        yield server


@pytest.fixture
def judge_server(_judge_server_once):
    """The module's loopback judge, with its requests and script counters cleared."""
    _judge_server_once.reset()
    _judge_server_once.responder = ScriptedJudge()
    return _judge_server_once
