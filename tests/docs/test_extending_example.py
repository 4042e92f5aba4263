"""docs/extending.md's worker that calls the model twice, run as printed (issue #45 item 7): the
public model call (``BaseRolloutWorker.complete``) and ``completion_trajectory``."""

from __future__ import annotations

import re
import threading
from pathlib import Path

from nexrl_core import hookimpl
from nexrl_core.builtins.mock import MockInferenceClient, _last_user_text
from nexrl_core.testing import trajectory_problem

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def _doc_example() -> str:
    text = DOC.read_text()
    after = text[text.index("is run by `tests/docs/test_extending_example.py`"):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


class RecordingClient(MockInferenceClient):
    """The mock model, remembering each request's last user message and seed."""

    requests: list[tuple[str, int | None, int]] = []
    lock = threading.Lock()

    def complete(self, prompt, params):
        with self.lock:
            type(self).requests.append((_last_user_text(prompt), params.seed, params.max_tokens))
        return super().complete(prompt, params)


def test_the_documented_two_call_worker_trains(nexrl_run):
    namespace: dict = {}
    exec(compile(_doc_example(), str(DOC), "exec"), namespace)
    worker_cls = namespace["DraftThenAnswer"]

    class Plugin:
        @hookimpl
        def nexrl_rollout_workers(self):
            return {"draft_then_answer": worker_cls}

        @hookimpl
        def nexrl_inference_backends(self):
            return {"recording": RecordingClient}

    RecordingClient.requests = []
    result = nexrl_run({"rollout_worker": {"type": "draft_then_answer", "sampling": {"max_tokens": 16}},
                        "service": {"inference_service": {"backend": "recording", "mode": "sum"}},
                        "trainer": {"total_train_steps": 2}}, Plugin())
    assert result.summary.global_step == 2 and result.errors == []
    requests = RecordingClient.requests
    trained = result.trajectories
    drafts = [r for r in requests if not r[0].startswith("Check your draft")]
    answers = [r for r in requests if r[0].startswith("Check your draft")]
    # two calls per sample (the workers may have begun the next step's samples when the run ended)
    assert len(trained) == 8 and len(drafts) == len(answers) >= len(trained)
    assert sorted(repr(d[0]) for d in drafts) == sorted(a[0].split("Check your draft for ")[1].split(";")[0]
                                                        for a in answers)
    assert {r[2] for r in drafts} == {64} and {r[2] for r in answers} == {16}  # the call's sampling over the recipe's
    # each call of a task has a seed of its own, and no two samples share one
    seeds = [r[1] for r in requests]
    assert None not in seeds and len(set(seeds)) == len(seeds)
    for trajectory in trained:
        assert trajectory_problem(trajectory, "self_hosted") is None
        prompt = trajectory["prompt"]
        assert [m["role"] for m in prompt][-3:] == ["user", "assistant", "user"]  # the draft is context
        question = prompt[-3]["content"]
        a, b = map(int, re.findall(r"-?\d+", question)[:2])
        # the trained tokens are the answer's (the mock answers the sum in the follow-up's text)
        assert trajectory["response_token_ids"] == list(trajectory["response"].encode())
        assert trajectory["response"] in (str(a + b), str(a + b + 1))
        assert trajectory["reward"] == float(trajectory["response"] == str(a + b))
        assert trajectory["sampling"]["max_tokens"] == 16 and trajectory["sampling"]["seed"] in seeds
    metrics = result.metrics[-1]
    assert metrics["rollout/draft_tokens"] > 0
