"""``nexrl migrate`` on each of NexRL 1.x's public recipe layouts (issue 46, items 1 and 4): a task
folder with ``common.yaml`` and ``self_hosted.yaml`` / ``tinker.yaml`` that name it in a Hydra
defaults list (math, pig_latin), the NexAU agent folders with their workspace (``agent_workspace/``:
agent YAML, tools YAML, tool module, ``evaluator.py``, a custom worker; ``*.env.sh`` next to the
recipe), and the on-policy distillation recipe (one file, a student and a teacher train service).

The recipes are written here, in the shape of NexRL 1.4's (the same keys, sections and
interpolations, values of our own). Each one migrates to a recipe that passes ``nexrl validate``
up to what only the machine that runs it supplies (exit 0, those listed), and passes it entirely
once that machine's environment variables, data files, model folders and keys are there."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import yaml

from nexrl_core import BaseEvaluationTarget
from nexrl_core.cli import main
from nexrl_core.plugins import PluginManager

DISTRIBUTIONS = ("nexrl-grpo", "nexrl-torch", "nexrl-tinker", "nexrl-nexau", "nexrl-rewards", "nexrl-vllm")
# What NexRL's launcher and its users set; unset while a recipe is migrated, as on a fresh machine.
MACHINE_ENV = ("NEXRL_DATA_PATH", "NEXRL_MODEL_PATH", "EXPERIMENT_PATH", "INFERENCE_BASE_URL", "API_SERVER_URL",
               "TINKER_API_KEY", "FEISHU_WEBHOOK_URL", "NEXRL_PATH", "TINKER_BASE_URL")
MODEL = "Org/Tiny-Chat"  # under $NEXRL_MODEL_PATH, as NexRL's recipes name Qwen/Qwen3-8B there


@pytest.fixture
def pm():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXRL_LOAD_PLUGINS", ",".join(DISTRIBUTIONS))
        manager = PluginManager()
    missing = set(DISTRIBUTIONS) - {r.distribution for r in manager.records.values()}
    if missing:
        pytest.skip(f"not installed: {', '.join(sorted(missing))}")
    return manager


@pytest.fixture
def cli(pm, monkeypatch, capfd, reset_loguru, tmp_path):
    import nexrl_core.plugins as plugins

    monkeypatch.setattr(plugins, "_DEFAULT", pm)
    monkeypatch.chdir(tmp_path)
    for name in MACHINE_ENV:
        monkeypatch.delenv(name, raising=False)

    def call(*argv: str):
        code = main(list(argv))
        out, err = capfd.readouterr()
        return code, out, err
    return call


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())


def _migrate(cli, recipe: Path, out: Path):
    code, _, err = cli("migrate", str(recipe), "-o", str(out), "--force")
    return code, yaml.safe_load(out.read_text()), err


def _section(err: str, title: str) -> list[str]:
    """The report's lines under ``title:`` (up to the next section)."""
    lines = err.splitlines()
    if f"{title}:" not in lines:
        return []
    rest = lines[lines.index(f"{title}:") + 1:]
    return [line.strip() for line in rest[:next((i for i, line in enumerate(rest) if not line.startswith("  ")),
                                                len(rest))]]


def _machine_lines(err: str) -> list[str]:
    lines = err.splitlines()
    start = next(i for i, line in enumerate(lines) if "up to what only the machine that runs it supplies" in line)
    return [line.strip() for line in lines[start + 1:] if line.startswith("  ")]


@pytest.fixture
def machine(tmp_path, tiny_model_dir, monkeypatch):
    """``machine(data_files, **env)``: the machine that runs the migrated recipe: the data files
    under $NEXRL_DATA_PATH, the model under $NEXRL_MODEL_PATH, a Tinker key, its environment."""
    def provide(data: dict[str, str], **env: str) -> None:
        root = tmp_path / "machine"
        _write(root / "data", data)
        (root / "models" / MODEL).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(tiny_model_dir, root / "models" / MODEL)
        defaults = {"NEXRL_DATA_PATH": str(root / "data"), "NEXRL_MODEL_PATH": str(root / "models"),
                    "EXPERIMENT_PATH": str(root / "experiment"), "INFERENCE_BASE_URL": "http://127.0.0.1:30000",
                    "TINKER_API_KEY": "tml-migrated-layout-test"}
        for name, value in {**defaults, **env}.items():
            monkeypatch.setenv(name, value)
    return provide


# -- the shapes of NexRL 1.x's recipes, written for these tests -------------------------------------

def _yaml(recipe: dict) -> str:
    return yaml.safe_dump(recipe, sort_keys=False, width=120)


def _common(task: str, worker: str, *, worker_keys: dict | None = None, validate_type: str = "mock",
            prompt_key: str = "prompt", repeat: int = 4, temperature: float = 1.0, llm: bool = True) -> dict:
    """``recipe/<task>/common.yaml``: every section, ``service: null``, ``trainer.algorithm: null``,
    ``${oc.env:...}`` data paths, keys naming each other with ``${...}``."""
    return {
        "project_name": f"layout-{task}", "experiment_name": f"{task}-experiment", "launch_mode": "local",
        "multi_model": "false",
        "logger": {"backend": ["console", "wandb"], "enable_feishu_logging": False,
                   "feishu_url": "${oc.env:FEISHU_WEBHOOK_URL,}"},
        "environment": {"setup_script": "", "require_setup_script": False},
        "resume": {"mode": "disable", "resume_path": "", "resume_dataloader": True},
        "data": {"type": "torch", "seed": 7, "data_files": [f"${{oc.env:NEXRL_DATA_PATH}}/{task}/train.jsonl"],
                 "batch_size": 4, "keep_batch_order": True, "rollout_repeat_n": repeat, "prompt_key": prompt_key,
                 "filter_prompts": False, "max_prompt_length": 1024,
                 "max_response_length": "${rollout_worker.max_response_length}", "tokenizer_path": "",
                 "shuffle": True, "drop_last": True},
        "rollout_worker": {"type": worker, "num_workers": 8, "need_llm_inference": llm, "temperature": temperature,
                           **(worker_keys or {}),
                           "max_prompt_length": "${data.max_prompt_length}", "max_response_length": 256,
                           "max_sequence_length": 2048, "tokenizer": "${data.tokenizer_path}",
                           "resource": {"num_workers": 0, "agents_per_worker": 16}},
        "trajectory_pool": {"type": "default", "batch_size": 16 if repeat > 1 else 4, "group_size": 1,
                            "key_list": [], "check_batch_ready_function": "loaded_batch_finished"},
        "trainer": {"total_train_steps": 12, "save_freq": 0, "algorithm": None},
        "service": None,
        "weight": {"type": "default", "sync_mode": "sync", "staleness_threshold": 0,
                   "validate_freq": "${validate.eval.validate_freq}"},
        "validate": {"validate_before_train": False,
                     "data": {"type": validate_type, "seed": "${data.seed}",
                              "data_files": [f"${{oc.env:NEXRL_DATA_PATH}}/{task}/test.jsonl"], "batch_size": 4,
                              "prompt_key": prompt_key, "filter_prompts": False,
                              "max_prompt_length": "${data.max_prompt_length}",
                              "tokenizer_path": "${data.tokenizer_path}", "shuffle": True, "drop_last": False},
                     "eval": {"type": "default", "validate_freq": 0}},
        "runtime_monitor": {"exception_handling": {"enabled": True, "check_interval": 1.0, "policy": "stop_on_error"},
                            "health_check": {"enabled": True, "check_interval": 10.0, "timeout": 5.0},
                            "rollout_progress_monitor": {"enabled": True, "update_interval": 1.0, "log_interval": 10,
                                                         "use_tqdm": True}},
    }


GRPO = {"type": "grpo", "do_old_log_prob_compute": True, "use_kl_in_reward": False, "kl_penalty": "kl",
        "kl_ctrl": {"type": "fixed", "kl_coef": 0.002, "kl_reward_coef": "${trainer.algorithm.kl_ctrl.kl_coef}"}}
GRPO_ACTOR = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size": 2, "clip_ratio": 0.2, "clip_ratio_low": 0.2,
              "clip_ratio_high": 0.25, "clip_ratio_c": 3.0, "loss_func_type": "NX_20250515", "entropy_coeff": "1e-4",
              "use_kl_loss": False, "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.0, "ppo_epochs": 1,
              "ulysses_sequence_parallel_size": 1,
              "rollout": {"temperature": "${rollout_worker.temperature}", "n": "${data.rollout_repeat_n}"}}


def _self_hosted(task: str, trainer: str, *, inference: bool = True, actor: dict | None = None,
                 script: str = "", data: dict | None = None) -> dict:
    """``recipe/<task>/self_hosted.yaml``: the SGLang server NexRL's launcher starts, the train
    service as ``main_actor``, ``weight.sync_method: disk`` with ``sync_weight_path``."""
    model = "${service.inference_service.model_path}" if inference else f"${{oc.env:NEXRL_MODEL_PATH}}/{MODEL}"
    recipe: dict = {"defaults": ["common", "_self_"], "project_name": "layout-self-hosted",
                    "experiment_name": f"self-hosted-{task}"}
    if script:
        recipe["environment"] = {"setup_script": script, "require_setup_script": True}
    recipe["data"] = {"tokenizer_path": model, **(data or {})}
    recipe["trainer"] = {"type": trainer, "checkpoint_path": "${oc.env:EXPERIMENT_PATH}/ckpt",
                         "sync_weight_path": "${oc.env:EXPERIMENT_PATH}/sync_weight", "remove_previous_ckpt": False,
                         **({"algorithm": GRPO} if trainer == "self_hosted_grpo" else {})}
    recipe["weight"] = {"sync_method": "disk", "sync_weight_path": "${trainer.sync_weight_path}"}
    recipe["service"] = {}
    if inference:
        recipe["service"]["inference_service"] = {
            "identifier": "default", "api_key": "EMPTY", "base_url": "${oc.env:INFERENCE_BASE_URL}",
            "model": f"layout-{task}-rollout", "model_path": f"${{oc.env:NEXRL_MODEL_PATH}}/{MODEL}",
            "max_tokens": "${data.max_response_length}", "tokenizer": "${data.tokenizer_path}", "backend": "sglang",
            "max_retries": 2, "freeze_for_weight_sync": True, "weight_type": "sglang_nckpt",
            "resource": {"replicas": 2, "gpus_per_replica": 1, "backend": "sglang", "extra_args": ""}}
    recipe["service"]["train_service"] = {"main_actor": {
        "identifier": "default", "role": "actor", "backend": "direct-zmq",
        "url": "http://${oc.env:API_SERVER_URL}:8000",
        "resource": {"world_size": 1, "gpus_per_pod": 4, "memory_per_gpu": 80},
        "actor": {"checkpoint_manager": "dcp", "model": {"path": model, "use_remove_padding": True},
                  "grad_clip": 0.8, "loss_agg_mode": "token-mean",
                  "optim": {"lr": "3e-6", "lr_warmup_steps_ratio": 0.05, "warmup_style": "constant"},
                  "fsdp_config": {"param_offload": False, "fsdp_size": -1}, **(actor or {})}}}
    return recipe


def _tinker(task: str, trainer: str, loss: str, script: str = "") -> dict:
    """``recipe/<task>/tinker.yaml``: the Tinker model named in ``service.inference_service.model``,
    ``service.tinker_service`` with the key from the environment, the optimizer in
    ``main_actor.config``."""
    recipe: dict = {"defaults": ["common", "_self_"], "project_name": "layout-tinker",
                    "experiment_name": f"tinker-{task}"}
    if script:
        recipe["environment"] = {"setup_script": script, "require_setup_script": True}
    recipe |= {
        "data": {"tokenizer_path": "${service.inference_service.model}"},
        "trainer": {"type": trainer},
        "weight": {"sync_method": "tinker", "sync_weight_path": ""},
        "service": {
            "inference_service": {"identifier": "default", "model": MODEL, "max_tokens": "${data.max_response_length}",
                                  "tokenizer": None, "backend": "tinker", "max_retries": 2,
                                  "freeze_for_weight_sync": True, "weight_type": ""},
            "tinker_service": {"base_url": None, "lora_rank": 16, "api_key": "${oc.env:TINKER_API_KEY}"},
            "train_service": {"main_actor": {
                "identifier": "default", "role": "actor", "backend": "tinker",
                "config": {"loss_fn": loss, "learning_rate": "5e-5", "beta1": 0.9, "beta2": 0.98, "eps": "1e-8"}}}},
    }
    return recipe


MATH_WORKER = {"agent_cls": "single_turn_math", "agent": {"math": {"judge_mode": "rule"}}}


def _math_row(question: str, answer: str) -> str:
    """A row of NexRL's (verl's) math data: the answer under reward_model.ground_truth."""
    return json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}],
                       "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
                       "extra_info": {"split": "train", "index": 0}}) + "\n"


MATH_ROWS = {"math/train.jsonl": _math_row("2 + 3?", "5"), "math/test.jsonl": _math_row("4 + 4?", "8")}
# NexRL's rule scoring (bp_math): the last \\boxed{} against reward_model.ground_truth, 1 / 0.1 when wrong / 0
MATH_EVALUATOR = {"type": "math_rule", "answer_key": "reward_model.ground_truth", "extract_order": ["boxed"],
                  "wrong_answer_reward": 0.1, "after_thinking": True}
# NexRL's simple worker: the first <answer>...</answer> equal to reward_model.ground_truth
SIMPLE_EVALUATOR = {"type": "exact_match", "answer_key": "reward_model.ground_truth",
                    "extract_pattern": "<answer>(.*?)</answer>"}


def _math(root: Path) -> None:
    _write(root, {"common.yaml": _yaml(_common("math", "agent", worker_keys=MATH_WORKER)),
                  "self_hosted.yaml": _yaml(_self_hosted("math", "self_hosted_grpo", actor=GRPO_ACTOR)),
                  "tinker.yaml": _yaml(_tinker("math", "remote_api_grpo", "importance_sampling"))})


def _pig_latin(root: Path) -> None:
    common = _common("pig_latin", "pig_latin", prompt_key="input", repeat=1, temperature=0.0, llm=False)
    _write(root, {"common.yaml": _yaml(common),
                  "self_hosted.yaml": _yaml(_self_hosted("pig_latin", "self_hosted_cross_entropy", inference=False,
                                                         actor={"micro_batch_size": 2})),
                  "tinker.yaml": _yaml(_tinker("pig_latin", "remote_api_cross_entropy", "cross_entropy"))})


# -- a NexAU agent folder -----------------------------------------------------------------------------

AGENT_YAML = """
    type: agent
    name: {name}
    max_context_tokens: 4096
    max_iterations: 4
    system_prompt: "Answer the question. Put the final answer in <answer></answer>."
    system_prompt_type: string
    tool_call_mode: openai
    llm_config:
      temperature: 0.7
      max_tokens: 256
      api_type: openai_chat_completion
    {tools}
    tracers:
      - import: nexau.archs.tracer.adapters.in_memory:InMemoryTracer
"""
TOOLS = """tools:
      - name: lookup
        yaml_path: ./tools/Lookup.yaml
        binding: lookup_tool:lookup
"""
TOOL_YAML = """
    type: tool
    name: Lookup
    description: Look a word up.
    input_schema:
      type: object
      properties:
        word:
          type: string
          description: the word
      required:
        - word
      additionalProperties: false
"""
TOOL_PY = '''
    def lookup(word: str) -> str:
        return f"{word}: a word"
'''
EVALUATOR = '''
    import re

    from nexrl.rollout_worker import EvaluationRunResult, Evaluator, NexAUEvaluationTarget


    class {name}(Evaluator):
        def evaluate(self, data, evaluation_target: NexAUEvaluationTarget) -> EvaluationRunResult:
            found = re.findall(r"<answer>(.*?)</answer>", evaluation_target.final_answer or "", re.DOTALL)
            hit = bool(found) and found[-1].strip() == str(data.get("answer", ""))
            return EvaluationRunResult(reward=float(hit), ground_truth=str(data.get("answer", "")), metrics={{}})
'''
WORKER = '''
    from typing import Any

    from nexau.archs.tracer.adapters import InMemoryTracer

    from nexrl.rollout_worker.base_nexau_rollout_worker import BaseNexAURolloutWorker


    class HeadlineWorker(BaseNexAURolloutWorker):
        """Asks about one headline at a time."""

        def format_task_query(self, data_item: dict[str, Any]) -> str:
            return "Headline: " + str(data_item.get("title", ""))

        tracer = InMemoryTracer
'''
ENV_SH = """
    #!/bin/bash
    set -e
    export {first}="set-me"
    export LLM_MODEL=${{SERVED_MODEL_NAME}}
    export LLM_API_KEY="EMPTY"
"""
AGENT_ROWS = {"{task}/train.jsonl": '{{"prompt": "What is a cat?", "title": "Cats", "answer": "animal"}}\n',
              "{task}/test.jsonl": '{{"prompt": "What is a dog?", "title": "Dogs", "answer": "animal"}}\n'}


def _agent_rows(task: str) -> dict[str, str]:
    return {k.format(task=task): v.format() for k, v in AGENT_ROWS.items()}


def _headlines(root: Path) -> None:
    """recipe/nexau_news's shape: a worker class of its own, the agent YAML, the evaluator."""
    worker = {"custom_rollout_worker_module_path": "agent_workspace/headline_worker.py",
              "custom_rollout_worker_class_name": "HeadlineWorker",
              "nexau_agent_config_path": "agent_workspace/agent_config.yaml",
              "evaluator_module_path": "agent_workspace/evaluator.py:HeadlineEvaluator", "task_name": "headlines"}
    common = _common("headlines", "nexau", worker_keys=worker, validate_type="torch", temperature=0.7)
    common["validate"]["validate_before_train"] = True
    loop = {"max_prompt_length": "${rollout_worker.max_prompt_length}"}  # and rollout_worker's names data's
    _write(root, {"common.yaml": _yaml(common),
                  "self_hosted.yaml": _yaml(_self_hosted("headlines", "self_hosted_grpo", actor=GRPO_ACTOR,
                                                         script="self_hosted.env.sh", data=loop)),
                  "tinker.yaml": _yaml(_tinker("headlines", "remote_api_grpo", "importance_sampling",
                                               script="tinker.env.sh")),
                  "self_hosted.env.sh": ENV_SH.format(first="LANGFUSE_PUBLIC_KEY"),
                  "tinker.env.sh": ENV_SH.format(first="TINKER_API_KEY"),
                  "agent_workspace/agent_config.yaml": AGENT_YAML.format(name="headline_agent", tools=""),
                  "agent_workspace/evaluator.py": EVALUATOR.format(name="HeadlineEvaluator"),
                  "agent_workspace/headline_worker.py": WORKER})


def _lookup(root: Path) -> None:
    """recipe/nexau_deepsearch's shape: the nexau worker on a workspace with a tool (its YAML and
    module) and the evaluator."""
    worker = {"nexau_agent_config_path": "agent_workspace/agent_config.yaml",
              "evaluator_module_path": "agent_workspace/evaluator.py:LookupEvaluator",
              "nexau_agent_workspace": "agent_workspace", "task_name": "lookup"}
    common = _common("lookup", "nexau", worker_keys=worker, temperature=0.7)
    _write(root, {"common.yaml": _yaml(common),
                  "self_hosted.yaml": _yaml(_self_hosted("lookup", "self_hosted_grpo", actor=GRPO_ACTOR,
                                                         script="self_hosted.env.sh")),
                  "tinker.yaml": _yaml(_tinker("lookup", "remote_api_grpo", "importance_sampling",
                                               script="tinker.env.sh")),
                  "self_hosted.env.sh": ENV_SH.format(first="SEARCH_API_KEY"),
                  "tinker.env.sh": ENV_SH.format(first="TINKER_API_KEY"),
                  "agent_workspace/agent_config.yaml": AGENT_YAML.format(name="lookup_agent", tools=TOOLS),
                  "agent_workspace/tools/Lookup.yaml": TOOL_YAML,
                  "agent_workspace/lookup_tool.py": TOOL_PY,
                  "agent_workspace/evaluator.py": EVALUATOR.format(name="LookupEvaluator")})


# -- math ------------------------------------------------------------------------------------------------

def test_math_self_hosted(cli, pm, tmp_path, machine):
    """The agent worker with agent_cls single_turn_math, self_hosted_grpo on SGLang with the disk
    weight sync: the simple worker and math_rule, a vLLM server at the same URL with vllm_disk."""
    _math(tmp_path / "math")
    out = tmp_path / "new" / "math.yaml"
    code, recipe, err = _migrate(cli, tmp_path / "math" / "self_hosted.yaml", out)
    assert code == 0, err
    assert recipe["rollout_worker"] == {"type": "simple", "num_workers": 8,
                                        "sampling": {"temperature": 1.0, "max_tokens": 256},
                                        "evaluator": MATH_EVALUATOR}
    assert recipe["trajectory_pool"] == {"batch_size": 16, "check_batch_ready_function": "loaded_batch_finished",
                                         "group_size": 4, "key_list": ["uid"]}  # data.rollout_repeat_n
    assert recipe["trainer"] == {"total_train_steps": 12, "save_freq": 0, "type": "self_hosted_grpo",
                                 "checkpoint_path": "${oc.env:EXPERIMENT_PATH}/ckpt", "remove_previous_ckpt": False}
    assert recipe["weight"] == {"sync_mode": "sync", "staleness_threshold": 0, "validate_freq": 0,
                                "backend": "vllm_disk", "sync_dir": "${oc.env:EXPERIMENT_PATH}/sync_weight"}
    assert recipe["service"] == {
        "inference_service": {"api_key": "EMPTY", "model": "layout-math-rollout", "backend": "vllm", "max_retries": 2,
                              "url": "${oc.env:INFERENCE_BASE_URL}"},
        "train_service": {"backend": "local_torch", "model_path": f"${{oc.env:NEXRL_MODEL_PATH}}/{MODEL}",
                          "lr": 3e-6, "grad_clip": 0.8, "warmup_ratio": 0.05, "micro_batch_size": 2}}
    assert recipe["algorithm"] == {"type": "grpo", "use_kl_in_reward": False, "kl_penalty": "kl",
                                   "clip_ratio_low": 0.2, "clip_ratio_high": 0.25, "loss_agg_mode": "token-mean",
                                   "use_kl_loss": False, "kl_loss_type": "low_var_kl", "ppo_epochs": 1,
                                   # NexRL's math worker scored a response cut off at max_tokens 0
                                   "reward_processing": {"overlong": "score", "overlong_reward": 0.0}}
    assert recipe["data"]["path"] == ["${oc.env:NEXRL_DATA_PATH}/math/train.jsonl"]  # oc.env kept as written
    carried = _section(err, "carried over")
    assert "weight.sync_method: disk -> weight.backend: vllm_disk (the trainer writes the weights to " \
           "weight.sync_dir and the server reloads them, as NexRL's disk sync did)" in carried
    assert any(line.startswith("service.inference_service.backend: sglang -> vllm (") for line in carried)
    assert any(line.startswith("service.inference_service.model_path -> service.train_service.model_path (the "
                               "model is named once") for line in carried)
    assert any(line.startswith("service.train_service.main_actor -> service.train_service") for line in carried)
    dropped = _section(err, "not carried over")
    assert all(": " in line and len(line.split(": ", 1)[1]) > 10 for line in dropped)  # each with its reason
    machine_lines = _machine_lines(err)
    assert machine_lines[0].startswith("environment variables EXPERIMENT_PATH, INFERENCE_BASE_URL, NEXRL_DATA_PATH, "
                                       "NEXRL_MODEL_PATH: not set here")
    assert "data.path: '$NEXRL_DATA_PATH/math/train.jsonl': data file not found" in machine_lines
    assert any(line.startswith(f"service.train_service.model_path: '$NEXRL_MODEL_PATH/{MODEL}' is not a model folder")
               for line in machine_lines)
    assert "rollout_worker.evaluator -> math_rule, answer_key reward_model.ground_truth, extract_order boxed, " \
           "wrong_answer_reward 0.1, after_thinking true (rollout_worker.agent_cls single_turn_math: NexRL scored the " \
           "last \\boxed{} of the reply (after its `</think>`; none while `<think>` is open) against " \
           "reward_model.ground_truth: 1 when equal, 0.1 when it is not, 0 without one (NexRL's rule judge_mode); " \
           "the rows stay as they are)" in _section(err, "set from the rest of the recipe")
    # NexRL's kl_ctrl did nothing with use_kl_in_reward false; nexrl refuses it there, and says so
    why = "does nothing without algorithm.use_kl_in_reward: true (set that, or delete algorithm.kl_ctrl)"
    assert {f"algorithm.kl_ctrl.type: {why}", f"algorithm.kl_ctrl.kl_coef: {why}"} <= set(dropped)
    machine(MATH_ROWS)  # the machine that runs it: now it passes whole
    code, _, err = cli("validate", str(out))
    assert code == 0, err
    # NexRL's rows, unchanged, score by their own answer through the migrated evaluator
    options = {k: v for k, v in recipe["rollout_worker"]["evaluator"].items() if k != "type"}
    evaluator = pm.components("evaluator")["math_rule"].cls(**options)
    row = {"uid": "0:0", **json.loads(MATH_ROWS["math/train.jsonl"])}
    # what NexRL's bp_math gave: 1 for the right boxed answer, 0.1 for a wrong one, 0 without one
    assert evaluator.evaluate(row, BaseEvaluationTarget("2 + 3 = \\boxed{5}")).reward == 1.0
    assert evaluator.evaluate(row, BaseEvaluationTarget("2 + 3 = \\boxed{6}")).reward == 0.1
    assert evaluator.evaluate(row, BaseEvaluationTarget("2 + 3 = 5")).reward == 0.0  # NexRL read only \\boxed{}
    # a thinking model's reply: only what follows </think> answers; an unclosed <think> answers nothing
    assert evaluator.evaluate(row, BaseEvaluationTarget("<think>\\boxed{6}?</think> \\boxed{5}")).reward == 1.0
    assert evaluator.evaluate(row, BaseEvaluationTarget("<think>\\boxed{5}?</think> so 5")).reward == 0.0
    assert evaluator.evaluate(row, BaseEvaluationTarget("<think>it is \\boxed{5}")).reward == 0.0
    # and the migrated recipe trains 2 steps on those rows (the in-process engine in place of the server)
    rows = _train(cli, out, tmp_path)
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2]
    assert all(r["train/num_failed"] == 0 for r in rows if "train/reward_mean" in r)  # scored, not failed


def _train(cli, out: Path, tmp_path: Path, *extra: str) -> list[dict]:
    """Run the migrated self-hosted recipe 2 steps with the model served in this process (hf, the
    in-process weight sync) in place of the vLLM server; the metrics rows."""
    run_dir = tmp_path / "run"
    code, _, err = cli("run", str(out), f"run_dir={run_dir}", "trainer.total_train_steps=2", "trainer.save_freq=0",
                       "+service.train_service.num_threads=1",
                       "service.inference_service={backend: hf, model_path: ${service.train_service.model_path}, "
                       "num_threads: 1}", *(f"~service.inference_service.{key}" for key in
                                            ("url", "api_key", "model", "max_retries")),
                       "weight.backend=in_process", "~weight.sync_dir", "trajectory_pool.batch_size=4",
                       "rollout_worker.num_workers=2", "rollout_worker.sampling.max_tokens=8",
                       "logger.backend=[console]", "logger.level=WARNING", *extra)
    assert code == 0, err
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_math_tinker(cli, tmp_path, machine, tiny_model_dir):
    """remote_api_grpo: the Tinker model named once (base_model), the key from the environment,
    the tokenizer folder left to the machine (???)."""
    _math(tmp_path / "math")
    out = tmp_path / "math.nexrl.yaml"
    code, recipe, err = _migrate(cli, tmp_path / "math" / "tinker.yaml", out)
    assert code == 0, err
    assert recipe["trainer"] == {"total_train_steps": 12, "save_freq": 0, "type": "remote_api_grpo"}
    assert recipe["algorithm"] == {"loss_fn": "importance_sampling",
                                   "reward_processing": {"overlong": "score", "overlong_reward": 0.0}}
    assert recipe["weight"]["backend"] == "tinker" and "sync_method" not in recipe["weight"]
    assert recipe["service"] == {
        "inference_service": {"backend": "tinker", "max_retries": 2, "tokenizer_path": "???",
                              "api_key": "${service.train_service.api_key}"},
        "train_service": {"backend": "tinker", "lora_rank": 16, "api_key": "${oc.env:TINKER_API_KEY}",
                          "base_url": None, "lr": 5e-5, "eps": 1e-8, "betas": [0.9, 0.98], "base_model": MODEL}}
    assert recipe["rollout_worker"]["sampling"] == {"temperature": 1.0, "max_tokens": 256}
    assert _section(err, "changed to a value nexrl accepts") == []  # NexRL sampled at 1.0 already
    assert any(line.startswith("service.inference_service.tokenizer_path -> ??? (nexrl tokenizes prompts here, from "
                               f"a local folder with {MODEL}'s tokenizer") for line in _section(err, "set from the "
                                                                                                    "rest of the recipe"))
    assert "service.inference_service.tokenizer_path: a value is required here (the recipe has '???')" in \
        _machine_lines(err)
    machine(MATH_ROWS)
    code, _, err = cli("validate", str(out), f"service.inference_service.tokenizer_path={tiny_model_dir}")
    assert code == 0, err


# -- pig_latin ---------------------------------------------------------------------------------------------

# NexRL's pig-latin rows: the English input and its translation (NexRL trained on the row's output)
PIG_ROWS = {"pig_latin/train.jsonl": "".join(
    json.dumps({"input": text, "output": target}) + "\n"
    # hyphenated, unlike nexrl's own pig_latin(): what is trained shows where it came from
    for text, target in (("hello world", "ello-hay orld-way"), ("the quick fox", "e-thay uick-qay ox-fay"),
                         ("pig latin", "ig-pay atin-lay"), ("nexrl migrates", "exrl-nay igrates-may")))}


def test_pig_latin_self_hosted_migrates_and_trains(cli, tmp_path, machine):
    """self_hosted_cross_entropy with no inference service (the worker samples nothing): the
    in-process engine takes the trained weights; the worker reads data.prompt_key's field. On the
    machine with the data and the (tiny) model, the migrated recipe trains."""
    _pig_latin(tmp_path / "pig")
    out = tmp_path / "pig.yaml"
    code, recipe, err = _migrate(cli, tmp_path / "pig" / "self_hosted.yaml", out)
    assert code == 0, err
    assert recipe["rollout_worker"] == {"type": "pig_latin", "num_workers": 8, "prompt_key": "input",
                                        "target_key": "output"}
    assert recipe["trainer"]["type"] == "self_hosted_cross_entropy"
    assert recipe["weight"]["backend"] == "in_process"
    assert recipe["service"] == {
        "train_service": {"backend": "local_torch", "model_path": f"${{oc.env:NEXRL_MODEL_PATH}}/{MODEL}", "lr": 3e-6,
                          "grad_clip": 0.8, "warmup_ratio": 0.05, "micro_batch_size": 2},
        "inference_service": {"backend": "hf", "model_path": "${service.train_service.model_path}"}}
    assert recipe["trajectory_pool"]["group_size"] == 1
    assert "weight.sync_method: disk -> weight.backend: in_process (inference backend hf: no files are written)" in \
        _section(err, "carried over")
    assert "rollout_worker.temperature (as rollout_worker.sampling.temperature): unknown key in nexrl (rollout " \
           "worker 'pig_latin' accepts: prompt_key, instruction, target_key)" in _section(err, "not carried over")
    machine(PIG_ROWS)
    code, _, err = cli("validate", str(out))
    assert code == 0, err
    run_dir = tmp_path / "run"
    code, _, err = cli("run", str(out), f"run_dir={run_dir}", "trainer.total_train_steps=1", "logger.backend=[console]",
                       "logger.level=WARNING", "+service.train_service.num_threads=1",
                       "+service.inference_service.num_threads=1")
    assert code == 0, err
    assert (run_dir / "metrics.jsonl").read_text().count('"train/') >= 1
    # trained on the rows' own translations, as NexRL did
    targets = {json.loads(line)["output"] for line in PIG_ROWS["pig_latin/train.jsonl"].splitlines()}
    trained = [json.loads(line)["response"] for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert trained and set(trained) <= targets, trained


def test_pig_latin_tinker(cli, tmp_path, machine, tiny_model_dir):
    _pig_latin(tmp_path / "pig")
    out = tmp_path / "pig.yaml"
    code, recipe, err = _migrate(cli, tmp_path / "pig" / "tinker.yaml", out)
    assert code == 0, err
    assert recipe["trainer"]["type"] == "remote_api_cross_entropy" and "algorithm" not in recipe
    assert recipe["service"]["train_service"]["base_model"] == MODEL
    assert "service.train_service.config.loss_fn: the loss of trainer remote_api_cross_entropy, which takes no " \
           "algorithm.loss_fn" in _section(err, "not carried over")
    machine(PIG_ROWS)
    code, _, err = cli("validate", str(out), f"service.inference_service.tokenizer_path={tiny_model_dir}")
    assert code == 0, err


# -- the NexAU agent folders ------------------------------------------------------------------------------

def _texts(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): f.read_text() for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("variant", ["self_hosted", "tinker"])
def test_nexau_with_a_worker_of_its_own(cli, tmp_path, machine, tiny_model_dir, variant):
    """recipe/nexau_news's shape: the worker class of the workspace (on nexrl-nexau's worker keys),
    its evaluator, the env script; with Tinker, NexRL's temperature 0.7 becomes 1.0, said in one line.
    The workspace's files import NexRL: the new recipe uses copies beside it with nexrl's imports
    (the originals untouched), so it passes as it is written."""
    root = tmp_path / "headlines"
    _headlines(root)
    originals = _texts(root)
    out = tmp_path / "new" / "headlines.yaml"
    code, recipe, err = _migrate(cli, root / f"{variant}.yaml", out)
    assert code == 0, err
    assert _texts(root) == originals
    copy = "headlines_workspace/agent_workspace"
    worker = recipe["rollout_worker"]
    assert worker == {"num_workers": 8,  # read from the current folder by the worker: placed by ${recipe_dir}
                      "nexau_agent_config_path": f"${{recipe_dir}}/{copy}/agent_config.yaml",
                      "task_name": "headlines", "max_sequence_length": 2048,
                      "sampling": {"temperature": 0.7 if variant == "self_hosted" else 1.0, "max_tokens": 256},
                      "evaluator": {"type": "python", "path": f"{copy}/evaluator.py", "class": "HeadlineEvaluator"},
                      "type": "python", "path": f"{copy}/headline_worker.py", "class": "HeadlineWorker"}
    copied = _texts(tmp_path / "new" / "headlines_workspace")
    assert set(copied) == {".nexrl-migrate", "agent_workspace/agent_config.yaml", "agent_workspace/evaluator.py",
                           "agent_workspace/headline_worker.py"}
    assert copied["agent_workspace/agent_config.yaml"] == originals["agent_workspace/agent_config.yaml"]
    assert "from nexrl_core import EvaluationRunResult, Evaluator\nfrom nexrl_nexau import NexAUEvaluationTarget\n" \
        in copied["agent_workspace/evaluator.py"]
    assert "from nexrl_nexau import BaseNexAURolloutWorker\n" in copied["agent_workspace/headline_worker.py"]
    assert "from nexrl." not in "".join(copied.values())
    assert _section(err, "copied next to the new recipe, which uses the copies (the originals are unchanged)") == [
        f"headlines/agent_workspace -> new/{copy}",
        f"new/{copy}/evaluator.py: 3 imported names rewritten",
        f"new/{copy}/headline_worker.py: 1 imported name rewritten"]
    assert _section(err, "left to rewrite") == []
    dropped = _section(err, "not carried over")
    for key in ("rollout_worker.need_llm_inference", "rollout_worker.tokenizer", "rollout_worker.max_prompt_length"):
        assert any(line.startswith(key + ":") or line.startswith(key + " (") for line in dropped), key
    changed = _section(err, "changed to a value nexrl accepts")
    if variant == "tinker":
        assert changed == ["rollout_worker.sampling.temperature: 0.7 -> 1.0 (the Tinker service scores tokens at "
                           "temperature 1 only, so at another temperature the importance ratio of its loss would "
                           "compare two different distributions)"]
    else:
        assert changed == []
        assert "max_prompt_length" not in str(recipe)  # the two max_prompt_length naming each other are gone
        # NexRL's kl_ctrl with use_kl_in_reward false: refused for that reason, not as an unknown key
        assert "algorithm.kl_ctrl.kl_coef: does nothing without algorithm.use_kl_in_reward: true (set that, or " \
               "delete algorithm.kl_ctrl)" in dropped
    script = f"{variant}.env.sh"
    exported = "TINKER_API_KEY" if variant == "tinker" else "LANGFUSE_PUBLIC_KEY"
    note = (f"before nexrl run, source ../headlines/{script} (it exports {exported}, LLM_MODEL, LLM_API_KEY): NexRL's "
            f"launcher sourced this environment.setup_script; nexrl reads the environment it is started in")
    assert _section(err, "for the machine that runs it") == [note]
    assert f"# {note}\n" in out.read_text()
    imports = _section(err, "imports of NexRL in the files the recipe names, and nexrl's")
    assert any(line.startswith("../headlines/agent_workspace/headline_worker.py:5: from nexrl.rollout_worker."
                               "base_nexau_rollout_worker import BaseNexAURolloutWorker -> from nexrl_nexau import "
                               "BaseNexAURolloutWorker (it runs the agent itself; a subclass overrides "
                               "format_task_query") for line in imports), imports
    machine_lines = _machine_lines(err)
    if not importable("nexau"):  # the worker file imports NexAU's tracer: the package that machine installs
        assert any("No module named 'nexau'" in line for line in machine_lines), machine_lines
    machine(_agent_rows("headlines"))
    overrides = [f"service.inference_service.tokenizer_path={tiny_model_dir}"] if variant == "tinker" else []
    code, _, err = cli("validate", str(out), *overrides)
    if importable("nexau"):
        assert code == 0, err
    else:
        assert code == 2 and "No module named 'nexau'" in err and err.count("error: ") == 1, err


def test_the_copy_is_replaced_only_when_migrate_wrote_it(cli, tmp_path):
    """Migrating again with --force replaces the copy (edits made to the originals since come
    across); a folder of that name that migrate did not write is never touched."""
    root = tmp_path / "headlines"
    _headlines(root)
    out = tmp_path / "headlines.nexrl.yaml"
    assert _migrate(cli, root / "self_hosted.yaml", out)[0] == 0
    evaluator = root / "agent_workspace" / "evaluator.py"
    evaluator.write_text(evaluator.read_text() + "\nEDITED = True\n")
    code, _, err = cli("migrate", str(root / "self_hosted.yaml"), "-o", str(out))
    assert code == 2 and "-o: '" in err and "exists (--force replaces it)" in err
    assert _migrate(cli, root / "self_hosted.yaml", out)[0] == 0
    copy = tmp_path / "headlines.nexrl_workspace" / "agent_workspace" / "evaluator.py"
    assert copy.read_text().endswith("\nEDITED = True\n") and "from nexrl_core import" in copy.read_text()

    mine = tmp_path / "mine"
    (mine / "headlines.nexrl_workspace").mkdir(parents=True)
    (mine / "headlines.nexrl_workspace" / "notes.txt").write_text("the user's")
    code, _, err = cli("migrate", str(root / "self_hosted.yaml"), "-o", str(mine / "headlines.nexrl.yaml"), "--force")
    assert code == 2 and "was not written by nexrl migrate" in err, err
    assert _texts(mine) == {"headlines.nexrl_workspace/notes.txt": "the user's"}  # nor the recipe written


def test_nexau_workspace_rewritten_in_place_needs_no_copy(cli, tmp_path):
    """The user who rewrites the originals (``--code DIR --write``, with the recipe in the same
    command) gets a recipe that names them, and no copy; without -o (the recipe on stdout) nothing
    is copied, and the command still to run is named, with exit 2."""
    root = tmp_path / "lookup"
    _lookup(root)
    code, out_text, err = cli("migrate", str(root / "self_hosted.yaml"))
    assert code == 2
    assert yaml.safe_load(out_text)["rollout_worker"]["nexau_agent_workspace"] == \
        "${recipe_dir}/lookup/agent_workspace"  # placed for ./migrated.yaml
    assert _section(err, "left to rewrite") == [
        "nexrl migrate --code lookup/agent_workspace --write  (rewrites the originals in place; the recipe goes to "
        "stdout (with -o NEW.yaml, migrate copies them next to it with the imports rewritten))"]
    assert "No module named 'nexrl'" in err.splitlines()[-1]
    out = tmp_path / "lookup.nexrl.yaml"
    code, _, err = cli("migrate", str(root / "self_hosted.yaml"), "-o", str(out), "--code",
                       str(root / "agent_workspace"), "--write")
    assert code == 0, err
    assert "from nexrl_core import EvaluationRunResult" in (root / "agent_workspace" / "evaluator.py").read_text()
    assert not (tmp_path / "lookup.nexrl_workspace").exists()
    assert yaml.safe_load(out.read_text())["rollout_worker"]["evaluator"]["path"] == "lookup/agent_workspace/evaluator.py"


@pytest.mark.parametrize("variant", ["self_hosted", "tinker"])
def test_nexau_workspace_with_a_tool(cli, tmp_path, machine, tiny_model_dir, variant):
    """recipe/nexau_deepsearch's shape: the nexau worker on its workspace (agent YAML, tools YAML,
    tool module, evaluator), copied whole beside the new file (the YAML files name each other by
    relative paths) with the evaluator's imports rewritten."""
    root = tmp_path / "lookup"
    _lookup(root)
    out = tmp_path / "elsewhere" / "lookup.nexrl.yaml"  # not the current folder
    code, recipe, err = _migrate(cli, root / f"{variant}.yaml", out)
    assert code == 0, err
    worker = recipe["rollout_worker"]
    copy = "lookup.nexrl_workspace/agent_workspace"
    assert worker["type"] == "nexau"
    assert worker["nexau_agent_workspace"] == f"${{recipe_dir}}/{copy}"
    assert worker["nexau_agent_config_path"] == f"${{recipe_dir}}/{copy}/agent_config.yaml"
    assert worker["evaluator"] == {"type": "python", "path": f"{copy}/evaluator.py", "class": "LookupEvaluator"}
    assert worker["sampling"]["temperature"] == (0.7 if variant == "self_hosted" else 1.0)
    assert set(_texts(tmp_path / "elsewhere" / "lookup.nexrl_workspace")) == {
        ".nexrl-migrate", "agent_workspace/agent_config.yaml", "agent_workspace/tools/Lookup.yaml",
        "agent_workspace/lookup_tool.py", "agent_workspace/evaluator.py"}
    assert "from nexrl." in (root / "agent_workspace" / "evaluator.py").read_text()  # the original as it was
    machine(_agent_rows("lookup"))
    overrides = [f"service.inference_service.tokenizer_path={tiny_model_dir}"] if variant == "tinker" else []
    code, _, err = cli("validate", str(out), *overrides)
    assert code == 0, err


def test_the_migrated_nexau_workspace_trains_without_nexau(cli, pm, tmp_path, machine):
    """recipe/nexau_deepsearch's shape, migrated, trains 2 steps on a tiny model in this process
    (the in-process engine in place of the vLLM server): the agent runs on nexrl's built-in runner
    where NexAU is not installed (docs/agents.md), with the workspace's copied evaluator."""
    from tests.support.tiny_lm import build_model, build_tokenizer

    root = tmp_path / "lookup"
    _lookup(root)
    out = tmp_path / "lookup.nexrl.yaml"
    code, recipe, _ = _migrate(cli, root / "self_hosted.yaml", out)
    assert code == 0
    # the workspace's own evaluator (its copy, imports rewritten) scores the rows as it did under NexRL
    options = {k: v for k, v in recipe["rollout_worker"]["evaluator"].items() if k != "type"}
    evaluator = pm.components("evaluator")["python"].cls(**options)
    row = json.loads(_agent_rows("lookup")["lookup/train.jsonl"]) | {"uid": "0:0"}
    assert evaluator.evaluate(row, BaseEvaluationTarget("It is an <answer>animal</answer>")).reward == 1.0
    assert evaluator.evaluate(row, BaseEvaluationTarget("It is a <answer>plant</answer>")).reward == 0.0
    machine(_agent_rows("lookup"))
    model = tmp_path / "long_context_tiny"  # the agent's tool schemas make prompts longer than 256 tokens
    tokenizer = build_tokenizer()
    build_model(tokenizer, max_positions=2048).save_pretrained(model)
    tokenizer.save_pretrained(model)
    run_dir = tmp_path / "run"
    code, _, err = cli("run", str(out), f"run_dir={run_dir}", "trainer.total_train_steps=2",
                       f"service.train_service.model_path={model}", "+service.train_service.num_threads=1",
                       "service.inference_service={backend: hf, model_path: ${service.train_service.model_path}, "
                       "num_threads: 1}", *(f"~service.inference_service.{key}" for key in
                                            ("url", "api_key", "model", "max_retries")),
                       "weight.backend=in_process", "~weight.sync_dir", "trajectory_pool.batch_size=4",
                       "rollout_worker.num_workers=2", "rollout_worker.sampling.max_tokens=8",
                       "logger.backend=[console]", "logger.level=INFO")
    assert code == 0, err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2]
    assert all(r["train/num_failed"] == 0 for r in rows if "train/reward_mean" in r)  # the copied evaluator scored
    if not importable("nexau"):
        assert "agents run on nexrl's built-in runner" in (run_dir / "run.log").read_text()


def importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# -- on-policy distillation -------------------------------------------------------------------------------

OPD = f"""
project_name: "layout-opd"
experiment_name: "opd-small-from-large"
launch_mode: "local"
multi_model: "false"
logger:
  backend: ['console']
resume:
  mode: disable
  resume_path: ""
  resume_dataloader: true
data:
  type: "torch"
  seed: 11
  data_files:
    - "${{oc.env:NEXRL_DATA_PATH}}/opd/train.jsonl"
  batch_size: 8
  keep_batch_order: true
  rollout_repeat_n: 1
  prompt_key: "prompt"
  filter_prompts: false
  max_prompt_length: 1024
  max_response_length: ${{rollout_worker.max_response_length}}
  tokenizer_path: ${{service.inference_service.model_path}}
  shuffle: true
  drop_last: true
rollout_worker:
  type: "agent"
  num_workers: 8
  need_llm_inference: true
  temperature: 0.8
  use_distillation_clipping: ${{trainer.use_distillation_clipping}}
  train_token_start_pct: ${{trainer.algorithm.train_token_start_pct}}
  agent_cls: "single_turn_math"
  agent:
    math:
      judge_mode: "rule"
  max_prompt_length: ${{data.max_prompt_length}}
  max_response_length: 512
  max_sequence_length: 2048
trajectory_pool:
  type: "default"
  batch_size: ${{data.batch_size}}
  group_size: 1
  key_list: []
  check_batch_ready_function: "loaded_batch_finished"
trainer:
  type: "self_hosted_opd"
  use_distillation_clipping: false
  distillation_cliprange: 0.3
  distillation_cliprange_low: 0.3
  distillation_cliprange_high: 0.3
  do_old_student_log_prob_compute: false
  train_token_start_pct: 0.0
  train_token_end_pct: 0.9
  advantage_start_pct: 0.1
  advantage_end_pct: 1.0
  algorithm:
    type: "distillation"
    distillation_coeff: 0.5
    entropy_coeff: 0.0
    temperature: ${{rollout_worker.temperature}}
    loss_agg_mode: "token-mean"
    distillation_epochs: 1
    use_distillation_clipping: ${{trainer.use_distillation_clipping}}
    distillation_cliprange: ${{trainer.distillation_cliprange}}
    distillation_cliprange_low: ${{trainer.distillation_cliprange_low}}
    distillation_cliprange_high: ${{trainer.distillation_cliprange_high}}
    do_old_student_log_prob_compute: ${{trainer.do_old_student_log_prob_compute}}
    train_token_start_pct: ${{trainer.train_token_start_pct}}
    train_token_end_pct: ${{trainer.train_token_end_pct}}
    advantage_start_pct: ${{trainer.advantage_start_pct}}
    advantage_end_pct: ${{trainer.advantage_end_pct}}
  total_train_steps: 20
  save_freq: 5
  checkpoint_path: "${{oc.env:EXPERIMENT_PATH}}/ckpt"
  sync_weight_path: "${{oc.env:EXPERIMENT_PATH}}/sync_weight"
  remove_previous_ckpt: false
weight:
  type: "default"
  sync_mode: "sync"
  staleness_threshold: 0
  sync_method: "network"
  sync_weight_path: ${{trainer.sync_weight_path}}
  validate_freq: ${{validate.eval.validate_freq}}
validate:
  validate_before_train: false
  max_response_length: 1024
  data:
    type: "torch"
    seed: ${{data.seed}}
    data_files:
      - "${{oc.env:NEXRL_DATA_PATH}}/opd/test.jsonl"
    batch_size: 8
    prompt_key: "prompt"
    shuffle: true
    drop_last: false
  eval:
    type: "default"
    validate_freq: 5
service:
  inference_service:
    identifier: "student"
    api_key: "EMPTY"
    base_url: http://${{oc.env:INFERENCE_BASE_URL}}
    model: "layout-opd-student"
    model_path: "${{oc.env:NEXRL_MODEL_PATH}}/{MODEL}"
    max_tokens: ${{data.max_response_length}}
    tokenizer: ${{service.inference_service.model_path}}
    backend: sglang
    max_retries: 3
    freeze_for_weight_sync: true
    weight_type: "sglang_nckpt"
  train_service:
    student:
      identifier: "student"
      role: "actor"
      backend: http
      url: "http://${{oc.env:API_SERVER_URL}}:8000"
      actor:
        model:
          path: "${{service.inference_service.model_path}}"
        ppo_micro_batch_size: 2
        grad_clip: 1.0
        entropy_coeff: ${{trainer.algorithm.entropy_coeff}}
        ppo_epochs: ${{trainer.algorithm.distillation_epochs}}
        optim:
          lr: 2e-6
    teacher:
      identifier: "teacher"
      role: "teacher"
      model_path: "${{oc.env:NEXRL_MODEL_PATH}}/{MODEL}"
      backend: http
      url: "http://${{oc.env:API_SERVER_URL}}:8000"
      actor:
        model:
          path: ${{service.train_service.teacher.model_path}}
        ppo_micro_batch_size: 4
"""


def test_on_policy_distillation(cli, pm, tmp_path, machine):
    """A student and a teacher train service, NexRL's distillation keys: trainer self_hosted_opd
    with the teacher as the reference service."""
    if "self_hosted_opd" not in pm.components("trainer"):
        pytest.xfail("trainer self_hosted_opd is not registered here (nexrl-grpo's on-policy distillation)")
    (tmp_path / "opd").mkdir()
    (tmp_path / "opd" / "opd_small_from_large.yaml").write_text(OPD)
    out = tmp_path / "opd.nexrl.yaml"
    code, recipe, err = _migrate(cli, tmp_path / "opd" / "opd_small_from_large.yaml", out)
    assert code == 0, err
    assert recipe["trainer"] == {"type": "self_hosted_opd", "total_train_steps": 20, "save_freq": 5,
                                 "checkpoint_path": "${oc.env:EXPERIMENT_PATH}/ckpt", "remove_previous_ckpt": False}
    assert recipe["algorithm"] == {"loss_agg_mode": "token-mean", "ppo_epochs": 1, "kl_coef": 0.5,
                                   "token_range": {"start": 0.0, "end": 0.9},
                                   "kl_quantile_range": {"start": 0.1, "end": 1.0}}
    # NexRL's clip range acts from a second update of a batch on, which the recipe never makes
    why = "does nothing without algorithm.ppo_epochs > 1 (set that, or delete algorithm.clip)"
    assert {f"algorithm.use_distillation_clipping (as algorithm.clip.enabled): {why}",
            f"algorithm.distillation_cliprange_low (as algorithm.clip.ratio_low): {why}",
            f"algorithm.distillation_cliprange_high (as algorithm.clip.ratio_high): {why}",
            f"algorithm.distillation_cliprange (as algorithm.clip.ratio_low, algorithm.clip.ratio_high): {why}"} <= \
        set(_section(err, "not carried over"))
    assert recipe["service"]["reference_service"] == {"backend": "hf",
                                                      "model_path": f"${{oc.env:NEXRL_MODEL_PATH}}/{MODEL}"}
    assert recipe["service"]["train_service"] == {"backend": "local_torch", "micro_batch_size": 2, "grad_clip": 1.0,
                                                  "lr": 2e-6, "model_path": f"${{oc.env:NEXRL_MODEL_PATH}}/{MODEL}"}
    assert recipe["service"]["inference_service"]["url"] == "http://${oc.env:INFERENCE_BASE_URL}"
    assert recipe["weight"]["backend"] == "vllm_disk"
    assert recipe["rollout_worker"] == {"type": "simple", "num_workers": 8,
                                        "sampling": {"temperature": 0.8, "max_tokens": 512},
                                        "evaluator": MATH_EVALUATOR}
    assert any(line.startswith("weight.sync_method: network -> weight.backend: vllm_disk (NexRL's network sync "
                               "needs its internal north_checkpoint package") for line in _section(err, "carried over"))
    machine({"opd/train.jsonl": MATH_ROWS["math/train.jsonl"], "opd/test.jsonl": MATH_ROWS["math/test.jsonl"]},
            INFERENCE_BASE_URL="127.0.0.1:30000")
    code, _, err = cli("validate", str(out))
    assert code == 0, err


def _opd_tinker() -> dict:
    """recipe/on_policy_distill's remote-API shape (NexRL's trainer remote_api_opd), on Tinker: one
    file, the teachers in trainer.teachers, the distillation keys in the train service's config."""
    recipe = yaml.safe_load(OPD)
    for key in ("use_distillation_clipping", "train_token_start_pct", "agent_cls", "agent"):
        recipe["rollout_worker"].pop(key)
    recipe["rollout_worker"]["type"] = "simple"
    recipe["data"]["tokenizer_path"] = MODEL  # a name: NexRL fetched the tokenizer
    recipe["trainer"] = {"type": "remote_api_opd", "max_prompt_length": "${data.max_prompt_length}",
                         "max_response_length": "${data.max_response_length}",
                         "teachers": [{"base_model": "Org/Tiny-Teacher", "checkpoint": None},
                                      {"base_model": "Org/Other-Teacher", "api_key": "${oc.env:OTHER_KEY}"}],
                         "total_train_steps": 20, "save_freq": 5, "checkpoint_path": "${oc.env:EXPERIMENT_PATH}/ckpt",
                         "sync_weight_path": "${oc.env:EXPERIMENT_PATH}/sync_weight", "remove_previous_ckpt": False}
    recipe["weight"].update(sync_method="tinker")
    recipe["service"] = {
        "inference_service": {"identifier": "student", "model": MODEL, "max_tokens": "${data.max_response_length}",
                              "tokenizer": None, "backend": "tinker", "max_retries": 3,
                              "freeze_for_weight_sync": True, "weight_type": ""},
        "tinker_service": {"base_url": None, "lora_rank": 32, "api_key": "${oc.env:TINKER_API_KEY}"},
        "train_service": {"main_actor": {"identifier": "default", "role": "actor", "backend": "tinker", "config": {
            "loss_fn": "importance_sampling", "learning_rate": "1e-4", "beta1": 0.9, "beta2": 0.95,
            "weight_decay": "1e-2", "eps": "1e-8", "grad_clip_norm": 1.0, "kl_penalty_coef": 1.0,
            "kl_discount_factor": 0.0, "entropy_coeff": "1e-4"}}}}
    return recipe


def test_on_policy_distillation_on_tinker(cli, pm, tmp_path, machine, tiny_model_dir, monkeypatch):
    """NexRL's remote_api_opd on Tinker becomes nexrl's: the first teacher a Tinker sampling client
    (service.reference_service), kl_penalty_coef the distillation weight, NexRL's temperature 0.8
    the 1.0 Tinker scores at (said in one line)."""
    if "remote_api_opd" not in pm.components("trainer"):
        pytest.xfail("trainer remote_api_opd is not registered here (nexrl-tinker with nexrl-grpo)")
    (tmp_path / "opd").mkdir()
    (tmp_path / "opd" / "tinker_opd.yaml").write_text(_yaml(_opd_tinker()))
    out = tmp_path / "opd.nexrl.yaml"
    code, recipe, err = _migrate(cli, tmp_path / "opd" / "tinker_opd.yaml", out)
    assert code == 0, err
    assert recipe["trainer"] == {"type": "remote_api_opd", "total_train_steps": 20, "save_freq": 5,
                                 "checkpoint_path": "${oc.env:EXPERIMENT_PATH}/ckpt", "remove_previous_ckpt": False}
    assert recipe["algorithm"] == {"kl_coef": 1.0}
    # NexRL's simple worker scored the <answer> tag against reward_model.ground_truth: so does the migrated one
    assert recipe["rollout_worker"]["evaluator"] == SIMPLE_EVALUATOR
    evaluator = pm.components("evaluator")["exact_match"].cls(
        **{k: v for k, v in SIMPLE_EVALUATOR.items() if k != "type"})
    row = {"uid": "0:0", **json.loads(MATH_ROWS["math/train.jsonl"])}
    assert evaluator.evaluate(row, BaseEvaluationTarget("2 + 3 makes <answer>5</answer>")).reward == 1.0
    assert evaluator.evaluate(row, BaseEvaluationTarget("2 + 3 makes <answer>6</answer>")).reward == 0.0
    assert evaluator.evaluate(row, BaseEvaluationTarget("2 + 3 makes 5")).reward == 0.0
    assert recipe["service"] == {
        "inference_service": {"backend": "tinker", "max_retries": 3, "tokenizer_path": "???",
                              "api_key": "${service.train_service.api_key}"},
        "train_service": {"backend": "tinker", "lora_rank": 32, "api_key": "${oc.env:TINKER_API_KEY}", "base_url": None,
                          "lr": 1e-4, "eps": 1e-8, "weight_decay": 1e-2, "grad_clip": 1.0, "betas": [0.9, 0.95],
                          "base_model": MODEL},
        "reference_service": {"backend": "tinker", "base_model": "Org/Tiny-Teacher",
                              "tokenizer_path": "${service.inference_service.tokenizer_path}",
                              "api_key": "${service.train_service.api_key}"}}  # NexRL's base_url null: Tinker's
    assert recipe["weight"]["backend"] == "tinker"
    assert _section(err, "changed to a value nexrl accepts") == [
        "rollout_worker.sampling.temperature: 0.8 -> 1.0 (the Tinker service scores tokens at temperature 1 only, so "
        "at another temperature the importance ratio of its loss would compare two different distributions)"]
    dropped = _section(err, "not carried over")
    for line in ("service.train_service.config.kl_discount_factor: each token's advantage is its own reverse KL "
                 "(NexRL's kl_discount_factor 0); no discounted sum of the later tokens' KL",
                 "service.train_service.config.entropy_coeff: nexrl's losses have no entropy term",
                 "service.train_service.config.loss_fn: the loss of trainer remote_api_opd (importance_sampling on "
                 "each token's KL advantage), which takes no algorithm.loss_fn",
                 "trainer.max_prompt_length: prompts are not cut"):
        assert line in dropped, dropped
    assert any(line.startswith("trainer.teachers -> service.reference_service") for line in _section(err, "carried over"))
    assert "service.inference_service.tokenizer_path: a value is required here (the recipe has '???')" in \
        _machine_lines(err)  # the teacher's names the student's (the two share one vocabulary)
    machine({"opd/train.jsonl": MATH_ROWS["math/train.jsonl"], "opd/test.jsonl": MATH_ROWS["math/test.jsonl"]})
    code, _, err = cli("validate", str(out), f"service.inference_service.tokenizer_path={tiny_model_dir}")
    assert code == 0, err
    # and it trains, 2 steps, on the local stand-in of the Tinker service (a student and a teacher)
    from nexrl_tinker.standin import BaseModel as StandinModel
    from nexrl_tinker.standin import StandinServer
    from tests.support.tiny_lm import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    models = {name: StandinModel(name, build_model(tokenizer, seed=seed), tokenizer)
              for name, seed in ((MODEL, 0), ("Org/Tiny-Teacher", 1))}
    with StandinServer(models, state_dir=str(tmp_path / "standin")) as server:
        monkeypatch.setenv("TINKER_BASE_URL", server.url)  # the migrated recipe's base_url is null: the SDK's
        run_dir = tmp_path / "run"
        code, _, err = cli("run", str(out), f"run_dir={run_dir}", "trainer.total_train_steps=2", "trainer.save_freq=0",
                           f"service.inference_service.tokenizer_path={tiny_model_dir}",
                           "rollout_worker.sampling.max_tokens=6", "weight.validate_freq=0",
                           "logger.backend=[console]", "logger.level=WARNING")
    assert code == 0, err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/num_failed"] == 0 for r in rows if "train/num_failed" in r)  # NexRL's rows scored
    kl = [r["train/opd_reverse_kl"] for r in rows if "train/opd_reverse_kl" in r]
    assert len(kl) == 2 and all(k > 0 for k in kl), rows


# -- the pieces --------------------------------------------------------------------------------------------

def test_a_reference_loop_in_the_seed_is_taken_out(pm):
    """NexRL's own recipe may hold two keys naming each other (NexRL never resolves them); nexrl
    would refuse the loop."""
    from nexrl_core.cli.migrate import migrate_recipe

    m = migrate_recipe({"seed": "${rollout_worker.seed}", "rollout_worker": {"seed": "${seed}"},
                        "trainer": {"type": "mock"}}, pm)
    assert m.recipe == {"rollout_worker": {"seed": "${seed}"}, "trainer": {"type": "mock"}}  # the run's seed now
    assert m.dropped()["seed"] == "a reference loop (seed -> rollout_worker.seed -> seed): it has no value"


def _migrate_recipe(seed: dict, pm):
    from nexrl_core.cli.migrate import migrate_recipe

    m = migrate_recipe(seed, pm)
    return m.recipe, {c.seed: c for c in m.changes}, m.dropped()


def test_a_kl_controller_nexrl_refuses_is_listed_with_the_checks_reason(pm):
    """NexRL's kl_ctrl with use_kl_in_reward false did nothing; nexrl refuses it there: each key is
    listed with that reason, not as unknown. With use_kl_in_reward true it is carried over."""
    seed = {"trainer": {"type": "self_hosted_grpo",
                        "algorithm": {"type": "grpo", "use_kl_in_reward": False, "kl_penalty": "kl",
                                      "kl_ctrl": {"type": "fixed", "kl_coef": 0.002, "kl_reward_coef": 0.002}}}}
    _, _, dropped = _migrate_recipe(seed, pm)
    why = "does nothing without algorithm.use_kl_in_reward: true (set that, or delete algorithm.kl_ctrl)"
    assert dropped["algorithm.kl_ctrl.type"] == why and dropped["algorithm.kl_ctrl.kl_coef"] == why
    seed["trainer"]["algorithm"]["use_kl_in_reward"] = True
    recipe, _, dropped = _migrate_recipe(seed, pm)
    assert recipe["algorithm"]["kl_ctrl"] == {"type": "fixed", "kl_coef": 0.002}
    assert [k for k in dropped if "kl_ctrl" in k] == ["algorithm.kl_ctrl.kl_reward_coef"]
    assert dropped["algorithm.kl_ctrl.kl_reward_coef"] == "the reward penalty's coefficient is algorithm.kl_ctrl.kl_coef"


def test_numbers_nexrls_loader_reads_as_numbers(pm):
    from nexrl_core.cli.migrate import migrate_recipe

    m = migrate_recipe({"service": {"train_service": {"actor": {"optim": {"lr": "2e-6"}}}},
                        "trainer": {"type": "self_hosted_grpo"}}, pm)
    assert m.recipe["service"]["train_service"]["lr"] == 2e-6
