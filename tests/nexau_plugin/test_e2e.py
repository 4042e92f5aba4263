"""End to end on a real (tiny) model: `nexrl run` with the `nexau` worker, the in-process engine
and the self-hosted GRPO trainer.

A random tiny model never calls a tool, so the module first teaches one (a few dozen SFT steps on
two sequences, in-process): asked "What is 2 + 3?" with the `add` tool offered, it writes a
<tool_call> for add(2, 3); shown the tool's "5", it answers "5". Then `nexrl run` (the CLI's
code, in this process): the engine samples every turn (tools through the system message, calls
read from its text), the runner executes the tool, the worker lays the turns into one token
sequence with a loss mask, and GRPO trains on exactly the masked-in tokens. What is checked is the
plumbing of tokens, log-probs and masks on real engine output, and that the trainer counts and
trains the model's tokens only.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from nexrl_core import SamplingParams, tools_system_prompt
from nexrl_core.cli import main as nexrl_main
from nexrl_core.testing import make_recipe, write_recipe
from nexrl_grpo.trainers import SelfHostedGrpoTrainer
from nexrl_nexau import AgentRunner, load_agent_spec
from nexrl_torch.rollout.engine import HFInferenceEngine
from tests.support.tiny_lm import TOOL_CORPUS, build_byte_tokenizer, build_model

from .conftest import write_agent

QUESTION = "What is 2 + 3?"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TOOL_TURN = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
GROUP = 4
STEPS = 2


def teach(model, targets: list[tuple[list[int], list[int]]], max_steps: int = 200) -> None:
    """SFT on prompt -> target pairs until every target token has probability > 0.97 (so sampling
    at temperature 1 mostly follows the taught path; greedy decoding always does)."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(max_steps):
        worst = 0.0
        for prompt, target in targets:
            logits = model(input_ids=torch.tensor([prompt + target])).logits[0, len(prompt) - 1:-1]
            nll = torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="none")
            nll.mean().backward()
            worst = max(worst, float(nll.detach().max()))
        if worst < 0.03:
            break
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """(agent YAML, model folder) of a tiny model that calls add(2, 3) and then answers 5."""
    root = tmp_path_factory.mktemp("nexau_e2e")
    agent = write_agent(root / "agent", ["add"], module="e2e_agent_tools",
                        system_prompt="You add.", max_iterations=3)
    spec = load_agent_spec(agent)
    tools = [t.openai_schema() for t in spec.tools]
    system = AgentRunner(spec).system_prompt()
    # Merges over the tools section too: shorter prompts, a faster test.
    tokenizer = build_byte_tokenizer(TOOL_CORPUS + [f"{system}\n\n{tools_system_prompt(tools)}"] * 4, 600)
    torch.set_num_threads(1)
    model = build_model(tokenizer, max_positions=1024)
    engine = HFInferenceEngine({}, model=model, tokenizer=tokenizer)
    try:
        first = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
        call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        second = first + [{"role": "assistant", "content": CALL, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "c", "name": "add", "content": "5"}]
        eos = tokenizer.eos_token_id
        turns = [(first, tokenizer(CALL, add_special_tokens=False).input_ids + [eos]),
                 (second, tokenizer("5", add_special_tokens=False).input_ids + [eos])]
        teach(model, [(engine.encode_chat(messages, tools), target) for messages, target in turns])
        for messages, target in turns:  # greedy decoding now gives each target
            out = engine.chat(messages, SamplingParams(max_tokens=len(target) + 2, temperature=0), tools)
            assert out.response_token_ids == target, "the tiny model did not learn its two turns"
    finally:
        engine.close()
    folder = root / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return agent, str(folder)


def recipe(run_dir: Path, agent: str, model_dir: str) -> dict:
    return make_recipe(
        None, run_dir=str(run_dir), seed=3, logger={"backend": [], "level": "WARNING"},
        data={"type": "inline", "rows": [{"prompt": QUESTION, "answer": 5}]},
        validate={"validate_before_train": True,
                  "data": {"type": "inline", "rows": [{"prompt": QUESTION, "answer": 5}]}},
        rollout_worker={"type": "nexau", "num_workers": GROUP, "nexau_agent_config_path": agent,
                        "agent_runner": "builtin", "validate_temperature": 0,
                        "sampling": {"max_tokens": 40, "temperature": 1.0}, "evaluator": {"type": "numeric_answer"}},
        trajectory_pool={"batch_size": GROUP, "group_size": GROUP, "key_list": ["uid"]},
        trainer={"type": "self_hosted_grpo", "total_train_steps": STEPS},
        weight={"sync_mode": "sync", "backend": "in_process", "rollout_limit": "batch"},
        service={"train_service": {"model_path": model_dir, "lr": 1e-3, "num_threads": 1},
                 "inference_service": {"backend": "hf", "model_path": model_dir, "num_threads": 1}},
        runtime_monitor={"stop_timeout": 10, "health_check": {"check_interval": 0.5, "timeout": 10.0},
                         "exception_handling": {"check_interval": 0.05}})


@pytest.fixture(scope="module")
def run(taught, tmp_path_factory):
    """`nexrl run recipe.yaml` in this process; the trainer's batches are recorded on the way."""
    agent, model_dir = taught
    root = tmp_path_factory.mktemp("nexau_run")
    path = write_recipe(recipe(root / "run", agent, model_dir), root / "recipe.yaml")
    batches = []
    train = SelfHostedGrpoTrainer.train

    def recording_train(self, trajectories):
        batches.append(trajectories)
        return train(self, trajectories)

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXRL_LOAD_PLUGINS", "nexrl-grpo,nexrl-torch,nexrl-nexau")
        mp.setattr("nexrl_core.plugins._DEFAULT", None, raising=False)
        mp.setattr(SelfHostedGrpoTrainer, "train", recording_train)
        try:
            code = nexrl_main(["run", str(path)])
        finally:
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"code": code, "batches": batches, "rows": rows, "model_dir": model_dir}


def test_the_run_finishes_and_validation_reports_the_agent(run):
    assert run["code"] == 0
    val = next(r for r in run["rows"] if "val/reward" in r)
    assert val["val/reward"] == 1.0 and val["val/called_tool"] == 1.0 and val["val/num_llm_calls"] == 2.0
    assert val["val/answered"] == 1.0 and val["val/num_samples"] == 1
    assert len(run["batches"]) == STEPS


def test_trajectories_hold_the_engines_tokens_with_tool_tokens_masked(run):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run["model_dir"])
    trained = [t for batch in run["batches"] for t in batch]
    assert len(trained) == STEPS * GROUP
    two_turn = [t for t in trained if t["num_llm_calls"] == 2 and t["num_segments"] == 1]
    assert two_turn, "no rollout followed the taught path (call, then answer)"
    for traj in two_turn:
        mask, response = traj["loss_mask"], traj["response_token_ids"]
        assert len(mask) == len(response) == len(traj["response_logprobs"])
        # model tokens, then the tool turn (masked), then model tokens: one 1-run, one 0-run, one 1-run
        runs = [mask[0]] + [m for a, m in zip(mask, mask[1:]) if m != a]
        assert runs == [1, 0, 1]
        start = mask.index(0)
        end = start + mask[start:].index(1)
        assert tokenizer.decode(response[start:end]) == TOOL_TURN
        assert all(lp == 0.0 for lp in traj["response_logprobs"][start:end])
        assert all(lp <= 0 for lp in traj["response_logprobs"])
        assert traj["sampling"]["temperature"] == 1.0 and traj["reward"] in (0.0, 1.0)


def test_the_trainer_counts_and_trains_only_the_model_tokens(run):
    steps = [r for r in run["rows"] if "train/trained_tokens" in r]
    assert len(steps) == STEPS
    for row, batch in zip(steps, run["batches"]):
        assert row["train/trained_tokens"] == sum(sum(t["loss_mask"]) for t in batch)
        untrained = sum(len(t["loss_mask"]) - sum(t["loss_mask"]) for t in batch) / len(batch)
        assert row["train/untrained_response_tokens_mean"] == pytest.approx(untrained)
        # the agent's counts of the batch, as rollout/* means
        for name in ("called_tool", "num_llm_calls", "answered"):
            assert row[f"rollout/{name}"] == pytest.approx(sum(t["score"][name] for t in batch) / len(batch))
    assert any(r["train/untrained_response_tokens_mean"] > 0 for r in steps)  # tool turns were in the batches
