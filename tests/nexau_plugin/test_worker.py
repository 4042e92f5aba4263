"""The `nexau` rollout worker on a scripted backend: trajectories, masks, rewards, failures."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from omegaconf import OmegaConf

from nexrl_core import ConfigError
from nexrl_core.launch.parts import build_module
from nexrl_core.launch.recipe import check_config, load_recipe
from nexrl_nexau import BaseNexAURolloutWorker, DefaultNexAURolloutWorker, NexAUEvaluationTarget
from nexrl_nexau.worker import _nexau_importable

from .scripted import EOS, Collect, ScriptedChat, decode, encode, render, tool_call


@pytest.fixture(autouse=True)
def _light_plugins(nexau_pm):
    return nexau_pm


MOCKS = {"trainer": {"type": "mock"}, "service": {"inference_service": {"backend": "mock"}}}

def make_worker(agent_path, client, cls=DefaultNexAURolloutWorker, **keys):
    config = OmegaConf.create({"type": "nexau", "nexau_agent_config_path": agent_path, "agent_runner": "builtin",
                               "evaluator": {"type": "numeric_answer"}, "seed": 3, "validate_temperature": 0,
                               **keys})
    worker = build_module(cls, config)
    pool, validator = Collect(), Collect()
    worker.set_module_references(pool, None, None, None, validator, client)
    return worker, pool, validator


def calculator_policy(messages, tools):
    """Calls add on the two numbers of the question, then answers with the tool's result."""
    last = messages[-1]
    if last["role"] == "user":
        a, b = map(int, re.findall(r"\d+", last["content"]))
        return f"I will add {a} and {b}.", [tool_call("add", {"a": a, "b": b}, "c0")]
    return f"The answer is {last['content']}."


def task(uid="u1", prompt="What is 2 + 3?", answer=5, **kw):
    return {"uid": uid, "sample_index": 0, "seq": 0, "prompt": prompt, "answer": answer, **kw}


def test_a_multi_turn_rollout_becomes_one_trajectory_trained_on_the_model_tokens_only(agent_factory):
    client = ScriptedChat(calculator_policy, version=4)
    worker, pool, _ = make_worker(agent_factory(["add"]), client, sampling={"temperature": 0.7})
    assert worker._run_task(task(), validating=False)
    (traj,) = pool.items
    assert traj["reward"] == 1.0 and traj["response"] == "The answer is 5."
    assert traj["stop_reason"] == "answered" and traj["num_llm_calls"] == 2 and traj["num_tool_calls"] == 1
    assert traj["model_version"] == 4 and traj["sampling"]["temperature"] == 0.7
    assert "segments" not in traj and traj["num_segments"] == 1 and traj["truncated"] is False
    # the exact tokens the backend produced: prompt of turn 0, then reply / tool turn / reply
    first, second = client.requests
    p0 = encode(render(first["messages"], first["tools"]))
    r0 = encode("I will add 2 and 3.") + [EOS]
    p1 = encode(render(second["messages"], second["tools"]))
    r1 = encode("The answer is 5.") + [EOS]
    assert p1[: len(p0) + len(r0)] == p0 + r0
    assert traj["prompt_token_ids"] == p0
    assert traj["response_token_ids"] == r0 + p1[len(p0) + len(r0):] + r1
    between = len(p1) - len(p0) - len(r0)
    assert traj["loss_mask"] == [1] * len(r0) + [0] * between + [1] * len(r1)
    lp = traj["response_logprobs"]
    assert all(v == 0.0 for v in lp[len(r0):len(r0) + between]) and all(v < 0 for v in lp[:len(r0)])
    # what sits under the mask is the tool's output rendered by the template, never the model's
    assert "<|im_start|>tool\n5<|im_end|>" in decode(traj["response_token_ids"][len(r0):len(r0) + between])
    assert traj["score"]["called_tool"] == 1.0 and traj["score"]["accuracy"] == 1.0
    # every model call sampled with the worker's sampling and a per-task seed
    assert [r["params"].temperature for r in client.requests] == [0.7, 0.7]


def test_validation_tasks_go_to_the_validator_greedily(agent_factory):
    client = ScriptedChat(calculator_policy)
    worker, pool, validator = make_worker(agent_factory(["add"]), client)
    worker._is_running_validate = True
    worker._run_task({**task(), "is_validation": True}, validating=True)
    assert not pool.items and validator.items[0]["is_validation"]
    assert client.requests[0]["params"].temperature == 0


def test_a_template_that_re_renders_history_gives_two_segments(agent_factory):
    class Rerender(ScriptedChat):
        def chat(self, messages, params, tools=None):
            # a template that strips the reply's trailing period when it renders history
            messages = [dict(m, content=m["content"].rstrip(".")) if m["role"] == "assistant" else m for m in messages]
            return super().chat(messages, params, tools)

    worker, pool, _ = make_worker(agent_factory(["add"]), Rerender(calculator_policy))
    worker._run_task(task(), validating=False)
    (traj,) = pool.items
    assert traj["num_segments"] == 2 and len(traj["segments"]) == 2
    first, second = traj["segments"]
    assert {k: traj[k] for k in first} == first  # the top level is the first segment
    assert sum(first["loss_mask"]) == len(first["response_token_ids"])  # each holds just one reply
    assert second["loss_mask"] == [1] * len(second["response_token_ids"])
    assert decode(second["response_token_ids"]) == "The answer is 5.<|im_end|>"


def test_a_custom_worker_overrides_the_query_and_the_loss_mask(agent_factory):
    class OnlyFinalReply(BaseNexAURolloutWorker):
        def format_task_query(self, data_item):
            return f"Q: {data_item['question']}"

        def get_train_loss_mask(self, trajectory_infos):
            return [i == len(trajectory_infos) - 1 for i in range(len(trajectory_infos))]

    client = ScriptedChat(calculator_policy)
    worker, pool, _ = make_worker(agent_factory(["add"]), client, cls=OnlyFinalReply)
    worker._run_task({"uid": "u", "sample_index": 0, "question": "7 plus 8", "answer": 15}, validating=False)
    (traj,) = pool.items
    assert client.requests[0]["messages"][1]["content"] == "Q: 7 plus 8"
    final = encode("The answer is 15.") + [EOS]
    assert traj["loss_mask"] == [0] * (len(traj["loss_mask"]) - len(final)) + [1] * len(final)
    assert traj["reward"] == 1.0


def test_the_evaluator_sees_the_whole_conversation(agent_factory):
    seen = []

    class Worker(DefaultNexAURolloutWorker):
        def evaluate(self, task, final_answer):
            seen.append(final_answer)
            return super().evaluate(task, final_answer)

    worker, _, _ = make_worker(agent_factory(["add"]), ScriptedChat(calculator_policy), cls=Worker)
    worker._run_task(task(), validating=False)
    (target,) = seen
    assert isinstance(target, NexAUEvaluationTarget) and target.stop_reason == "answered"
    assert [m["role"] for m in target.observation] == ["system", "user", "assistant", "tool", "assistant"]


def test_a_sequence_cut_at_max_sequence_length_gets_the_truncated_reward(agent_factory):
    path = agent_factory(["add"])
    worker, pool, _ = make_worker(path, ScriptedChat(calculator_policy))
    worker._run_task(task(), validating=False)
    limit = len(pool.items[0]["prompt_token_ids"]) + 10  # the prompt and the first 10 reply tokens
    worker, pool, _ = make_worker(path, ScriptedChat(calculator_policy), max_sequence_length=limit,
                                  truncated_reward=-0.5)
    worker._run_task(task(), validating=False)
    (traj,) = pool.items
    assert traj["truncated"] and traj["truncation_reason"] == "max_sequence_length" and traj["reward"] == -0.5
    assert len(traj["response_token_ids"]) == 10 and traj["loss_mask"] == [1] * 10
    assert len(traj["loss_mask"]) == len(traj["response_token_ids"]) == len(traj["response_logprobs"])
    assert traj["score"]["truncated"] == 1.0


def test_an_agent_that_never_answers_is_trained_with_its_reward(agent_factory):
    client = ScriptedChat(lambda m, t: ("once more", [tool_call("add", {"a": 1, "b": 1})]))
    worker, pool, _ = make_worker(agent_factory(["add"], max_iterations=3), client)
    worker._run_task(task(), validating=False)
    (traj,) = pool.items
    assert traj["stop_reason"] == "max_iterations" and traj["response"] == "" and traj["reward"] == 0.0
    assert traj["num_llm_calls"] == 3 and traj["score"]["answered"] == 0.0
    assert sum(traj["loss_mask"]) == 3 * len(encode("once more") + [EOS])


def test_an_inference_failure_is_a_failed_item_not_a_trajectory_to_train_on(agent_factory):
    class Broken(ScriptedChat):
        def chat(self, messages, params, tools=None):
            if len(self.requests) >= 1:
                raise ConnectionError("inference server went away")
            return super().chat(messages, params, tools)

    worker, pool, _ = make_worker(agent_factory(["add"]), Broken(calculator_policy))
    worker._run_task(task(), validating=False)
    (traj,) = pool.items
    assert traj["failed"] and traj["error_cause"] == "agent_error" and "went away" in traj["error"]


def test_a_backend_without_token_ids_fails_the_item_with_the_reason(agent_factory):
    class NoTokens(ScriptedChat):
        def chat(self, messages, params, tools=None):
            reply = super().chat(messages, params, tools)
            reply.response_token_ids = None
            return reply

    worker, pool, _ = make_worker(agent_factory(["add"]), NoTokens(calculator_policy))
    worker._run_task(task(), validating=False)
    (traj,) = pool.items
    assert traj["failed"] and traj["error_cause"] == "bad_trace" and "no response token ids" in traj["error"]


def test_traces_are_saved_when_asked(agent_factory, tmp_path):
    worker, _, _ = make_worker(agent_factory(["add"]), ScriptedChat(calculator_policy), save_trace=True,
                               trace_path=str(tmp_path / "traces"), task_name="sums")
    worker._run_task(task(), validating=False)
    (path,) = (tmp_path / "traces").iterdir()
    record = json.loads(path.read_text())
    assert path.name == "sums_u1_0_v0.json" and record["stop_reason"] == "answered"
    assert record["trace"][0]["type"] == "AGENT"


@pytest.mark.parametrize("keys,message", [
    ({"nexau_agent_config_path": None}, "rollout_worker.nexau_agent_config_path: required"),
    ({"agent_runner": "langchain"}, "rollout_worker.agent_runner: 'langchain' is not one of auto, builtin, nexau"),
    ({"sampling": {"temperture": 1}},
     "rollout_worker.sampling.temperture: unknown key; did you mean 'rollout_worker.sampling.temperature'?"),
    ({"tool_timeout": -1}, "rollout_worker.tool_timeout: expected a positive number, got -1"),
    ({"max_sequence_length": 1.5}, "rollout_worker.max_sequence_length: expected an integer"),
    ({"save_trace": True}, "rollout_worker.trace_path: required when save_trace is true"),
    ({"few_shot": [{"content": "x"}]}, "rollout_worker.few_shot: expected a list of chat messages"),
    ({"max_tool_ouput_chars": 10}, "rollout_worker.max_tool_ouput_chars: unknown key"),
])
def test_bad_worker_settings_are_one_line_each_in_validate_and_run(agent_factory, tmp_path, nexau_pm, keys, message):
    """The recipe check that `nexrl validate` and `nexrl run` share: one line naming the key."""
    worker = {"type": "nexau", "nexau_agent_config_path": agent_factory(["add"]), "agent_runner": "builtin",
              **keys}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"rollout_worker": worker, "data": {"type": "inline", "rows": [{"prompt": "x"}]},
                                    **MOCKS}))
    problems = check_config(load_recipe(str(path)), nexau_pm)
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_a_binding_that_does_not_import_is_reported_by_check_config(tmp_path):
    (tmp_path / "t.yaml").write_text("name: T\ndescription: d\n")
    (tmp_path / "agent.yaml").write_text("name: a\ntools: [{name: t, yaml_path: t.yaml, binding: nope_mod_q:f}]\n")
    problems = DefaultNexAURolloutWorker.check_config(
        OmegaConf.create({"nexau_agent_config_path": str(tmp_path / "agent.yaml")}))
    assert len(problems) == 1 and "cannot import nope_mod_q (ModuleNotFoundError" in problems[0]


def test_few_shot_turns_sit_between_the_system_prompt_and_the_query_and_are_never_trained(agent_factory):
    shots = [{"role": "user", "content": "What is 1 + 1?"},
             {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'},
             {"role": "tool", "content": "2"}, {"role": "assistant", "content": "2"}]
    client = ScriptedChat(lambda m, t: "9")
    worker, pool, _ = make_worker(agent_factory(["add"]), client, few_shot=shots)
    worker._run_task(task(prompt="What is 4 + 5?", answer=9), validating=False)
    sent = client.requests[0]["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert sent[1:5] == shots and sent[5]["content"] == "What is 4 + 5?"
    (traj,) = pool.items
    assert traj["loss_mask"] == [1, 1] and traj["reward"] == 1.0  # "9" + EOS: only the reply


def test_few_shot_must_be_chat_messages(agent_factory):
    with pytest.raises(ConfigError, match="rollout_worker.few_shot: expected a list of chat messages"):
        make_worker(agent_factory(["add"]), ScriptedChat(calculator_policy), few_shot=[{"content": "x"}])


def test_a_bad_sampling_value_in_the_agent_yaml_names_the_file_and_key(agent_factory, tmp_path, nexau_pm):
    agent = agent_factory(["add"], llm_config={"temperature": -1, "max_tokens": 20})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"rollout_worker": {"type": "nexau", "nexau_agent_config_path": agent,
                                                       "agent_runner": "builtin"},
                                    "data": {"type": "inline", "rows": [{"prompt": "x"}]}, **MOCKS}))
    (problem,) = check_config(load_recipe(str(path)), nexau_pm)
    assert problem.startswith(f"rollout_worker.nexau_agent_config_path: {agent}: llm_config.temperature: ")


@pytest.mark.skipif(_nexau_importable(), reason="NexAU is importable here: auto picks it")
def test_without_nexau_auto_runs_the_builtin_runner_and_says_so(agent_factory):
    from loguru import logger

    lines = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    try:
        worker, pool, _ = make_worker(agent_factory(["add"]), ScriptedChat(calculator_policy), agent_runner="auto")
    finally:
        logger.remove(sink)
    assert worker.runner_kind == "builtin"
    assert any("NexAU (github.com/nex-agi/NexAU, not on PyPI) is not importable" in line for line in lines)
    assert worker._run_task(task(), validating=False) and pool.items[0]["reward"] == 1.0
