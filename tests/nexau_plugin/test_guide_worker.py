"""The seed guide's "NexAU Worker with Custom Query Formatting", rewritten as the migration page
says (BaseNexAURolloutWorker from nexrl_nexau), loaded from a file next to the recipe
(``rollout_worker.type: python``, what NexRL's custom_rollout_worker_module_path becomes): the
nexau worker's keys are checked as for ``type: nexau``, and its query reaches the model."""

from __future__ import annotations

import re
import textwrap

import yaml
from omegaconf import OmegaConf

from nexrl_core.launch.recipe import check_config, load_recipe
from nexrl_core.testing import build_module

from .scripted import Collect, ScriptedChat, tool_call

WORKER = textwrap.dedent('''
    from typing import Any

    from nexrl_nexau import BaseNexAURolloutWorker


    class MyNexAUWorker(BaseNexAURolloutWorker):
        def format_task_query(self, data_item: dict[str, Any]) -> str:
            context, question = data_item.get("context", ""), data_item.get("question", "")
            return f"Context: {context}\\n\\nQuestion: {question}\\n\\nAnswer:"

        def get_train_loss_mask(self, trajectory_infos: list[dict]) -> list[bool]:
            return [True] * len(trajectory_infos)  # every model reply is trained
''')


def _policy(messages, tools):
    last = messages[-1]
    if last["role"] == "user":
        a, b = map(int, re.findall(r"\d+", last["content"]))
        return "Adding.", [tool_call("add", {"a": a, "b": b}, "c0")]
    return f"The answer is {last['content']}."


def test_the_guides_nexau_worker_from_a_file(agent_factory, tmp_path, nexau_pm):
    (tmp_path / "my_worker.py").write_text(WORKER)
    section = {"type": "python", "path": "my_worker.py", "class": "MyNexAUWorker",
               "nexau_agent_config_path": agent_factory(["add"]), "agent_runner": "builtin",
               "evaluator": {"type": "numeric_answer"}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"rollout_worker": section,
                                    "data": {"type": "inline", "rows": [{"prompt": "x"}]},
                                    "trainer": {"type": "mock"}, "service": {"inference_service": {"backend": "mock"}}}))
    cfg = load_recipe(str(path))
    assert check_config(cfg, nexau_pm) == []
    bad = load_recipe(str(path), ["+rollout_worker.agent_runnr=builtin"])
    assert any(p.startswith("rollout_worker.agent_runnr: unknown key") for p in check_config(bad, nexau_pm))

    cls = nexau_pm.resolve_section("rollout_worker", cfg.rollout_worker, "rollout_worker")
    worker = build_module(cls, OmegaConf.create({**OmegaConf.to_container(cfg.rollout_worker), "seed": 3}),
                          pm=nexau_pm)
    client, pool = ScriptedChat(_policy), Collect()
    worker.set_module_references(pool, None, None, None, Collect(), client)
    worker._run_task({"uid": "u", "sample_index": 0, "context": "two numbers", "question": "7 plus 8",
                      "answer": 15}, validating=False)
    (trajectory,) = pool.items
    assert client.requests[0]["messages"][1]["content"] == "Context: two numbers\n\nQuestion: 7 plus 8\n\nAnswer:"
    assert trajectory["reward"] == 1.0 and trajectory["rollout_worker"] == "rollout worker MyNexAUWorker"
