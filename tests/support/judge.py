"""A loopback OpenAI-compatible judge that answers from a script carried by the text it judges."""

from __future__ import annotations

import re
import threading

from .openai_server import FakeOpenAIServer, RespondWithError

_DIRECTIVE = re.compile(r"<<(.*?)>>", re.DOTALL)


class ScriptedJudge:
    """Responder of the loopback server: a prompt that holds ``<<a|b|c>>`` is answered ``a`` the
    first time, ``b`` the second, ... (the last one repeats); ``HTTP-<status>`` answers with that
    HTTP error. The reply being judged carries the script, so each test (and each row of a run)
    says what the judge will answer."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, prompt_text: str) -> str:
        match = _DIRECTIVE.search(prompt_text)
        if match is None:
            return "no directive"
        script = match.group(1).split("|")
        with self.lock:
            n = self.calls.get(match.group(1), 0)
            self.calls[match.group(1)] = n + 1
        answer = script[min(n, len(script) - 1)]
        if answer.startswith("HTTP-"):
            raise RespondWithError(int(answer[5:]))
        return answer


def judge_service(server: FakeOpenAIServer, **extra) -> dict:
    """The evaluator's ``service`` mapping for the loopback judge. The backend's own retries are
    off: every request the server sees is one judge attempt."""
    return {"backend": "openai", "url": server.url, "model": server.model, "max_retries": 0, "timeout": 5,
            "request_logprobs": False, "return_token_ids": False, **extra}
