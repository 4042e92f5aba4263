"""The NexRL (and ROLL) -> nexrl table: recipe keys, values, imports and metric names.

One table, three readers: ``nexrl migrate`` rewrites a recipe with it (:mod:`nexrl_core.cli.migrate`),
``nexrl validate`` / ``nexrl run`` name the nexrl key when a recipe still holds a seed key
(:func:`seed_key_hint`), and ``docs/migrating.md`` is generated from it (``scripts/gen_docs.py``),
so the three never disagree. The option checks (below this layer) get :func:`seed_key_hint` and
:func:`seed_key_suffix` registered when this module loads (importing nexrl_core loads it).

A key rule moves a value from the seed's key to nexrl's (``convert`` turns one value into the
keys it becomes, or returns the reason it cannot); a rule with no ``nexrl`` key says why nothing
carries the key over, and applies only where nexrl rejects the key. ``<loader>`` stands for each
data-loader section, ``data`` and ``validate.data``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config.options import SEED_KEY_WORDS

POINTER = "nexrl migrate RECIPE.yaml rewrites a NexRL or ROLL recipe"
LOADERS = ("data", "validate.data")

# convert(value, seed recipe, context) -> {nexrl key: value} | the reason it cannot be carried over
Convert = Callable[[Any, Mapping[str, Any], "Context"], "dict[str, Any] | str"]


class Context:
    """What a conversion may ask: the recipe as rewritten so far (``current``) and what the
    installation registers (the engine supplies it)."""

    current: Mapping[str, Any] = {}

    def declares(self, kind: str, name: str, *keys: str) -> bool:
        """A component ``name`` of ``kind`` is registered and declares every one of ``keys``."""
        return False

    def registered(self, kind: str, name: str) -> bool:
        """A component ``name`` of ``kind`` is registered."""
        return False

    def pushes_weights(self, trainer: str) -> bool:
        """Trainer ``trainer`` trains new weights in this process, which a weight-sync backend must
        bring to the inference service (NexRL's self-hosted trainers)."""
        return False


@dataclass(frozen=True)
class KeyRule:
    seed: str                    # the seed's key, dotted
    nexrl: str | None            # where it goes (a description for rules with convert); None: nowhere
    why: str = ""                # what changes on the way, or why nothing carries it over
    source: str = "NexRL"        # NexRL | ROLL
    convert: Convert | None = field(default=None, compare=False)
    replaces: tuple[str, ...] = ()  # nexrl keys the converted value replaces (others already set win)


@dataclass(frozen=True)
class ValueRule:
    key: str                     # a nexrl key (after the key rules)
    seed: Any                    # the seed's value
    nexrl: Any                   # nexrl's
    why: str = ""
    # only where this holds of the seed recipe (the why says when); the first rule that applies wins
    when: Callable[[Mapping[str, Any], Context], bool] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Adjustment:
    """A NexRL value nexrl refuses, replaced by the nearest one it accepts (the report says so in
    one line): where ``nexrl validate`` reports a problem matching ``problem`` on ``key``."""

    key: str
    problem: str                 # a regular expression of the problem's text
    nexrl: Any                   # the value written instead
    why: str


@dataclass(frozen=True)
class Layout:
    """One of NexRL 1.x's public recipe layouts and what ``nexrl migrate`` makes of it."""

    name: str                    # NexRL's recipe folder and files
    shape: str                   # what marks the layout
    becomes: str                 # the nexrl recipe


@dataclass(frozen=True)
class ImportRule:
    seed: str                    # the seed's import, module.Name
    nexrl: str | None            # nexrl's, module.Name; None: none
    why: str = ""


@dataclass(frozen=True)
class MetricRule:
    seed: str
    nexrl: str | None
    why: str = ""
    source: str = "NexRL"


# -- conversions ----------------------------------------------------------------------------------

def get_key(values: Any, dotted: str) -> Any:
    """The value at a dotted key (None when absent)."""
    for part in dotted.split("."):
        if not isinstance(values, Mapping) or part not in values:
            return None
        values = values[part]
    return values


def _evaluator_module(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    path, sep, cls = str(value).rpartition(":")
    if not sep or not path or not cls:
        return f"expected 'path/to/file.py:ClassName', got {value!r}"
    if not ctx.declares("evaluator", "python", "path", "class"):
        return "no evaluator here loads a class from a file (the python evaluator with path and class)"
    return {"rollout_worker.evaluator": {"type": "python", "path": path, "class": cls}}


def _custom_worker(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    cls = get_key(recipe, "rollout_worker.custom_rollout_worker_class_name")
    if not cls:
        return "custom_rollout_worker_class_name is missing"
    return {"rollout_worker.type": "python", "rollout_worker.path": value, "rollout_worker.class": cls}


def _worker_class_name(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    if not get_key(recipe, "rollout_worker.custom_rollout_worker_module_path"):
        return "custom_rollout_worker_module_path is missing"
    done = _custom_worker(get_key(recipe, "rollout_worker.custom_rollout_worker_module_path"), recipe, ctx)
    return done if isinstance(done, str) else {}  # carried with custom_rollout_worker_module_path


def _sync_dir(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    backend = get_key(ctx.current, "weight.backend") or \
        WEIGHT_BACKENDS.get(str(get_key(ctx.current, "service.inference_service.backend")))
    if backend == "vllm_disk":
        return {"weight.sync_dir": value}
    return (f"only weight.backend vllm_disk passes weights through files (this recipe's weight.backend: "
            f"{backend or 'version_only'})")


def _both_clip_ratios(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    return {"algorithm.clip_ratio_low": value, "algorithm.clip_ratio_high": value}


def _target_kl(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    if value is None:
        return {}
    return {"algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.target_kl": value}


def _rollout_batch_size(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    group = get_key(recipe, "num_return_sequences_in_group") or 1
    if not isinstance(value, int) or not isinstance(group, int):
        return f"expected integers, got rollout_batch_size {value!r}, num_return_sequences_in_group {group!r}"
    return {"trajectory_pool.batch_size": value * group}


def _reward_norm(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    mean, std = get_key(recipe, "norm_mean_type"), get_key(recipe, "norm_std_type")
    if mean is not None and std is not None and mean != std:
        return f"norm_mean_type {mean!r} and norm_std_type {std!r} differ; nexrl normalises both over one set"
    kind = mean if mean is not None else std
    if kind is None:
        return {}
    return {"algorithm.reward_processing.norm": kind, "algorithm.reward_processing.norm_mean": mean is not None,
            "algorithm.reward_processing.norm_std": std is not None}


def _pretrain(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    return {"service.train_service.model_path": value, "service.inference_service.model_path": value}


def _resume(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    if value is True:
        return {"resume.mode": "auto"}
    if value is False or value is None:
        return {"resume.mode": "disable"}
    return {"resume.mode": "from_path", "resume.resume_path": value}


def _keep_checkpoints(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    if value in (0, 1):
        return {"trainer.remove_previous_ckpt": value == 1}
    return f"nexrl keeps every checkpoint or only the newest (trainer.remove_previous_ckpt), not {value!r}"


def _track_with(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    names = {"stdout": "console", "wandb": "wandb", "tensorboard": "tensorboard"}
    if value not in names:
        return f"no metrics sink for {value!r} (console, wandb and tensorboard are built in)"
    return {"logger.backend": [names[value]]}


def _flag(target: str, when_true: Any) -> Convert:
    def convert(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
        return {target: when_true} if value is True else {}
    return convert


def _to(target: str) -> Convert:
    """The value, unchanged, at ``target`` (a key whose documentation depends on the plugins installed)."""
    def convert(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
        return {target: value}
    return convert


# -- NexRL 1.x layouts (recipe/<task>/{common,self_hosted,tinker}.yaml) ----------------------------

def _rollout_repeat_n(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        return f"expected a positive integer, got {value!r}"
    group = get_key(ctx.current, "trajectory_pool.group_size")
    if group not in (None, 1, value):
        return f"trajectory_pool.group_size is already {group!r} (kept)"
    out: dict[str, Any] = {"trajectory_pool.group_size": value}
    if value > 1 and get_key(ctx.current, "trajectory_pool.key_list") == []:
        out["trajectory_pool.key_list"] = ["uid"]  # NexRL grouped by uid in its trainer; nexrl's pool does
    return out


def _agent_cls(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    if value == "single_turn_math":
        return {}  # rollout_worker.type agent -> simple (Values), the math evaluator (Set from the rest)
    return (f"NexRL's agent class {value!r} has no counterpart: rollout_worker.type simple runs single-turn "
            f"tasks, nexau tool-using agents")


def _judge_mode(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    if value == "rule":
        return {}  # read with agent_cls: the rule-based math evaluator
    return (f"judge_mode {value!r}: the migrated recipe scores with the rule-based math evaluator; an LLM judge "
            f"is rollout_worker.evaluator type llm_judge with its own service (docs/rewards.md)")


def _tinker_loss(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    if get_key(recipe, "trainer.type") == "remote_api_opd":
        return ("the loss of trainer remote_api_opd (importance_sampling on each token's KL advantage), which takes "
                "no algorithm.loss_fn")
    if value in ("importance_sampling", "ppo"):
        return {"algorithm.loss_fn": value}
    if value == "cross_entropy":
        return "the loss of trainer remote_api_cross_entropy, which takes no algorithm.loss_fn"
    return f"the Tinker trainers' losses are importance_sampling and ppo (algorithm.loss_fn), not {value!r}"


def _betas(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    beta2 = get_key(recipe, "service.train_service.config.beta2")
    return {"service.train_service.betas": [value, 0.999 if beta2 is None else beta2]}


def _beta2(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    if get_key(recipe, "service.train_service.config.beta1") is not None:
        return {}  # carried with beta1
    return {"service.train_service.betas": [0.9, value]}


def _teachers(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    """NexRL's remote_api_opd teachers (a list: NexRL scored with the first only) as the reference
    service: a Tinker sampling client of the first teacher's base model (or its checkpoint), with
    the student's tokenizer and the train service's connection unless it names its own."""
    first = value[0] if isinstance(value, list) and value else None
    if not isinstance(first, Mapping) or not first.get("base_model"):
        return f"expected a list of teachers, the first with a base_model; got {value!r}"
    teacher: dict[str, Any] = {"backend": "tinker", "base_model": first["base_model"]}
    if first.get("checkpoint"):
        teacher["model_path"] = first["checkpoint"]
    teacher["tokenizer_path"] = "${service.inference_service.tokenizer_path}"
    for key in ("api_key", "base_url"):
        if first.get(key):
            teacher[key] = first[key]
        elif get_key(recipe, f"service.tinker_service.{key}") is not None:
            teacher[key] = "${service.train_service." + key + "}"
    return {"service.reference_service": teacher}


def _not_carried(why: str) -> Convert:
    """Taken out with ``why`` (inside a section whose other keys have another reason)."""
    def convert(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
        return why
    return convert


def _opd_clip_range(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
    return {"algorithm.clip.ratio_low": value, "algorithm.clip.ratio_high": value}


# -- keys -----------------------------------------------------------------------------------------

def _move_up(loader: str) -> Convert:
    """``<loader>.data_config``: the keys the chosen loader declares move up into its section."""
    def convert(value: Any, recipe: Mapping[str, Any], ctx: Context) -> dict[str, Any] | str:
        if not isinstance(value, Mapping):
            return f"expected a mapping, got {value!r}"
        kind = get_key(ctx.current, f"{loader}.type") or "file"
        up = {k: v for k, v in value.items() if ctx.declares("dataloader", str(kind), str(k))}
        rest = {k: v for k, v in value.items() if k not in up}
        return {**{f"{loader}.{k}": v for k, v in up.items()}, **({f"{loader}.data_config": rest} if rest else {})}
    return convert


def _loader_rules(loader: str) -> tuple[KeyRule, ...]:
    return (
        KeyRule(f"{loader}.data_config.dataset_paths", f"{loader}.path"),
        KeyRule(f"{loader}.data_files", f"{loader}.path", "NexRL's repository recipes name the files so"),
        KeyRule(f"{loader}.data_config", loader, "its keys move up where the data loader declares them",
                convert=_move_up(loader)),
        KeyRule(f"{loader}.data_config.split_type", None,
                "nexrl reads every row of the files: keep training and validation rows in their own files"),
        KeyRule(f"{loader}.batch_size", None, "rows go to the rollout workers one at a time "
                                              "(rollout_worker.tasks_per_call sets how many per call); a training "
                                              "step is trajectory_pool.batch_size trajectories"),
        KeyRule(f"{loader}.drop_last", None, "rows are handed out one at a time: there is no last partial batch"),
        KeyRule(f"{loader}.tokenizer_path", None, "prompts are tokenized by the inference service, with its model's "
                                                  "tokenizer"),
        KeyRule(f"{loader}.max_prompt_length", None, "prompts are not cut"),
        KeyRule(f"{loader}.filter_prompts", None, "prompts are not cut, so none is filtered for length"),
    )


_NO_ENTROPY = "nexrl's losses have no entropy term"
_OWN_KL = ("each token's advantage is its own reverse KL (NexRL's kl_discount_factor 0); no discounted sum of the later "
           "tokens' KL")

KEY_RULES: tuple[KeyRule, ...] = (
    # whole sections first: the rules after them name nexrl's sections
    KeyRule("dataloader", "data"),
    KeyRule("validate_dataloader", "validate.data"),
    KeyRule("weight_sync_controller", "weight"),
    KeyRule("trainer.algorithm", "algorithm", "NexRL's repository recipes nest it in trainer"),
    KeyRule("validator", None, "nexrl has one validator; its metrics are nexrl_core.runtime.eval_core's (docs/evaluation.md)"),
    # data loaders
    *(rule for loader in LOADERS for rule in _loader_rules(loader)),
    KeyRule("validate.data.shuffle", None, "a validation pass goes through the rows in order"),
    KeyRule("validate.data.seed", None, "a validation pass goes through the rows in order; only loaders that "
                                        "generate rows (arithmetic) take a seed"),
    # rollout workers
    KeyRule("rollout_worker.evaluator_module_path", "rollout_worker.evaluator: {type: python, path, class}",
            "the evaluator class is loaded from the file as before; its imports change (see Imports)",
            convert=_evaluator_module),
    KeyRule("rollout_worker.custom_rollout_worker_module_path", "rollout_worker: {type: python, path, class}",
            "the worker class is loaded from the file as before (it replaces the worker type); its "
            "imports change (see Imports)", convert=_custom_worker,
            replaces=("rollout_worker.type",)),
    KeyRule("rollout_worker.custom_rollout_worker_class_name", "rollout_worker.class",
            "with custom_rollout_worker_module_path", convert=_worker_class_name),
    KeyRule("rollout_worker.temperature", "rollout_worker.sampling.temperature"),
    KeyRule("rollout_worker.max_response_length", "rollout_worker.sampling.max_tokens"),
    KeyRule("rollout_worker.max_prompt_length", None, "prompts are not cut"),
    # trajectory pool, trainer, algorithm
    KeyRule("trajectory_pool.type", None, "nexrl has one trajectory pool"),
    KeyRule("trainer.sync_weight_path", "weight.sync_dir", "with weight.backend vllm_disk; the other backends "
                                                           "move weights without files", convert=_sync_dir),
    KeyRule("algorithm.adv_estimator", "algorithm.type", "verl's and ROLL's name for the advantage estimator"),
    KeyRule("algorithm.critic.kl_ctrl", "algorithm.kl_ctrl",
            "nexrl's algorithm.critic is the value model (gae)"),
    KeyRule("algorithm.kl_ctrl.kl_reward_coef", None, "the reward penalty's coefficient is algorithm.kl_ctrl.kl_coef"),
    KeyRule("algorithm.do_old_log_prob_compute", None,
            "nexrl computes old log-probs whenever they can differ from the current ones (algorithm.ppo_epochs > 1, "
            "or KL in the reward); with one update per batch the ratio is exactly 1"),
    KeyRule("algorithm.batch_size", None, "a step trains on trajectory_pool.batch_size trajectories; "
                                          "service.train_service.micro_batch_size splits the forward passes"),
    KeyRule("algorithm.inference_service", None,
            "a KL reference on its own inference service is declared as service.reference_service (a backend and "
            "its keys, e.g. hf with model_path), not by a model_tag; without one the trainer holds the initial "
            "model"),
    # weight sync
    KeyRule("weight.type", None, "the weight-sync backend is weight.backend (set from the inference backend)"),
    KeyRule("weight.sync_method", None, "the weight-sync backend is weight.backend, set from the inference backend "
                                        "(see Set from the rest of the recipe)"),
    KeyRule("weight.sync_weight_path", "weight.sync_dir", "with weight.backend vllm_disk", convert=_sync_dir),
    KeyRule("weight.checkpoint_manager", None, "checkpoints are the trainer's: trainer.checkpoint_path, "
                                               "trainer.save_freq"),
    # validation
    KeyRule("validate.eval.validate_freq", "weight.validate_freq", "NexRL's repository recipes put it here"),
    KeyRule("validate.eval", None, "nexrl has one validator; its metrics are nexrl_core.runtime.eval_core's "
                                   "(docs/evaluation.md)"),
    # services
    KeyRule("service.inference_service.freeze_for_weight_sync", None,
            "the weight-sync backend (weight.backend) decides how requests wait for a weight push (with the vllm "
            "backends, weight.pause_mode)"),
    KeyRule("service.inference_service.identifier", None, "one inference service per run: model_tag names it"),
    KeyRule("service.inference_service.weight_type", None, "the weight-sync backend (weight.backend) chooses the "
                                                           "format"),
    KeyRule("service.train_service.url", None, "the train service runs in this process (local_torch) or is the "
                                               "Tinker API; it has no URL"),
    KeyRule("service.train_service.model_tag", None, "one policy per run"),
    KeyRule("service.train_service.identifier", None, "one policy per run"),
    KeyRule("service.train_service.actor.model.path", "service.train_service.model_path"),
    KeyRule("service.train_service.actor.optim.lr", "service.train_service.lr"),
    KeyRule("service.train_service.actor.grad_clip", "service.train_service.grad_clip"),
    KeyRule("service.train_service.actor.ppo_micro_batch_size", "service.train_service.micro_batch_size"),
    KeyRule("service.train_service.actor.ppo_epochs", "algorithm.ppo_epochs"),
    KeyRule("service.train_service.actor.clip_ratio_low", "algorithm.clip_ratio_low"),
    KeyRule("service.train_service.actor.clip_ratio_high", "algorithm.clip_ratio_high"),
    KeyRule("service.train_service.actor.clip_ratio_c", "algorithm.clip_ratio_c", "with algorithm.policy_loss "
                                                                                  "dual_clip"),
    KeyRule("service.train_service.actor.loss_agg_mode", "algorithm.loss_agg_mode"),
    KeyRule("service.train_service.actor.use_kl_loss", "algorithm.use_kl_loss"),
    KeyRule("service.train_service.actor.kl_loss_type", "algorithm.kl_loss_type"),
    KeyRule("service.train_service.actor.kl_loss_coef", "algorithm.kl_loss_coef"),
    KeyRule("service.train_service.actor", None, "the rest of NexTrainer's actor settings (FSDP, sequence "
                                                 "parallelism, offload) have no counterpart in local_torch"),
    KeyRule("multi_model", None, "one policy per run"),
    # NexRL 1.x's layouts (recipe/<task>/common.yaml + self_hosted.yaml / tinker.yaml)
    KeyRule("data.rollout_repeat_n", "trajectory_pool.group_size",
            "samples per prompt; key_list [] becomes [uid] (nexrl's pool groups them for GRPO)",
            convert=_rollout_repeat_n, replaces=("trajectory_pool.group_size", "trajectory_pool.key_list")),
    KeyRule("data.keep_batch_order", None, "with weight.sync_mode sync, weight.rollout_limit batch (the default) "
                                           "starts one batch of rollouts per weight version, as keep_batch_order did"),
    KeyRule("data.max_response_length", None, "responses are cut at rollout_worker.sampling.max_tokens "
                                              "(NexRL's rollout_worker.max_response_length)"),
    KeyRule("rollout_worker.agent_cls", "rollout_worker.type: simple, with a math evaluator",
            "single_turn_math (NexRL's only agent class): the simple worker and the rule-based math evaluator",
            convert=_agent_cls),
    KeyRule("rollout_worker.agent.math.judge_mode", "rollout_worker.evaluator",
            "rule: math_rule (numeric_answer where nexrl-rewards is not installed)", convert=_judge_mode),
    KeyRule("rollout_worker.need_llm_inference", None, "a nexrl worker calls the inference service when it needs "
                                                       "to (pig_latin never does)"),
    KeyRule("rollout_worker.tokenizer", None, "prompts are tokenized by the inference service, with its model's "
                                              "tokenizer"),
    KeyRule("rollout_worker.resource", None, "NexRL's Kubernetes pods of agent workers: nexrl's rollout workers are "
                                             "threads of the run (launch_mode ray spreads them over "
                                             "rollout_worker.num_actors)"),
    KeyRule("resume.resume_dataloader", None, "a resumed run always continues the data where its checkpoint left it"),
    KeyRule("logger.enable_feishu_logging", None, "no Feishu sink: logger.backend's sinks are console, wandb and "
                                                  "tensorboard (a plugin may add others)"),
    KeyRule("logger.feishu_url", None, "no Feishu sink: logger.backend's sinks are console, wandb and tensorboard "
                                       "(a plugin may add others)"),
    KeyRule("environment.setup_script", None, "NexRL's launcher sourced it before the run; nexrl reads the "
                                              "environment it is started in (nexrl migrate names the script and "
                                              "what it exports)"),
    KeyRule("environment.require_setup_script", None, "nexrl reads the environment it is started in"),
    KeyRule("runtime_monitor.rollout_progress_monitor", None, "nexrl run shows the progress on stderr "
                                                              "(logger.progress)"),
    KeyRule("validate.max_response_length", None, "validation samples as training does (rollout_worker.sampling; "
                                                  "rollout_worker.validate_temperature for its temperature)"),
    KeyRule("service.inference_service.max_tokens", None, "responses are cut at rollout_worker.sampling.max_tokens "
                                                          "(NexRL's rollout_worker.max_response_length)"),
    KeyRule("service.inference_service.tokenizer", None, "prompts are tokenized with the inference service's model's "
                                                         "tokenizer (the tinker backend: its tokenizer_path)"),
    KeyRule("service.inference_service.resource", None, "NexRL's Kubernetes replicas of the inference server: "
                                                        "nexrl attaches to a server (url) or starts vLLM itself "
                                                        "(model_path, tensor_parallel_size: docs/vllm.md)"),
    KeyRule("service.tinker_service.lora_rank", "service.train_service.lora_rank"),
    KeyRule("service.tinker_service.api_key", "service.train_service.api_key", "the rollouts' sampling client "
                                                                              "shares it"),
    KeyRule("service.tinker_service.base_url", "service.train_service.base_url", "the rollouts' sampling client "
                                                                                "shares it"),
    KeyRule("service.train_service.role", None, "the train service is the policy's; a teacher (role teacher) is "
                                                "service.reference_service"),
    KeyRule("service.train_service.resource", None, "NexRL's Kubernetes pods of the train service: local_torch "
                                                    "trains in this process (service.train_service.world_size ranks "
                                                    "on this machine's GPUs)"),
    KeyRule("service.train_service.config.loss_fn", "algorithm.loss_fn", "importance_sampling or ppo (the "
                                                                         "remote_api_grpo trainer's)",
            convert=_tinker_loss),
    KeyRule("service.train_service.config.learning_rate", "service.train_service.lr"),
    KeyRule("service.train_service.config.beta1", "service.train_service.betas", "[beta1, beta2]", convert=_betas),
    KeyRule("service.train_service.config.beta2", "service.train_service.betas", "read with beta1", convert=_beta2),
    KeyRule("service.train_service.config.eps", "service.train_service.eps"),
    KeyRule("service.train_service.config.weight_decay", "service.train_service.weight_decay"),
    KeyRule("service.train_service.config.grad_clip_norm", "service.train_service.grad_clip"),
    # on-policy distillation on Tinker (NexRL's remote_api_opd: recipe/on_policy_distill/weaver_opd.yaml's shape)
    KeyRule("trainer.teachers", "service.reference_service: {backend: tinker, base_model, tokenizer_path}",
            "the first teacher (NexRL scored with the first only): a Tinker sampling client of its base_model (its "
            "checkpoint as model_path) scores the student's tokens, with the student's tokenizer and the train "
            "service's connection unless it names its own", convert=_teachers),
    KeyRule("service.train_service.config.kl_penalty_coef", "algorithm.kl_coef", convert=_to("algorithm.kl_coef")),
    KeyRule("service.train_service.config.kl_discount_factor", None, _OWN_KL, convert=_not_carried(_OWN_KL)),
    KeyRule("service.train_service.config.entropy_coeff", None, _NO_ENTROPY, convert=_not_carried(_NO_ENTROPY)),
    KeyRule("trainer.max_prompt_length", None, "prompts are not cut"),
    KeyRule("trainer.max_response_length", None, "responses are cut at rollout_worker.sampling.max_tokens"),
    KeyRule("service.train_service.config", None, "the rest of NexRL's Tinker optimizer settings have no "
                                                  "counterpart in the tinker train service"),
    KeyRule("service.train_service.actor.micro_batch_size", "service.train_service.micro_batch_size"),
    KeyRule("service.train_service.actor.optim.lr_warmup_steps_ratio", "service.train_service.warmup_ratio",
            "NexRL's learning rate is constant after the warm-up whatever warmup_style says: lr_scheduler constant"),
    # on-policy distillation (trainer.type self_hosted_opd): NexRL's trainer.algorithm, once moved
    KeyRule("algorithm.distillation_coeff", "algorithm.kl_coef", convert=_to("algorithm.kl_coef")),
    KeyRule("algorithm.distillation_epochs", "algorithm.ppo_epochs", convert=_to("algorithm.ppo_epochs")),
    KeyRule("algorithm.use_distillation_clipping", "algorithm.clip.enabled", convert=_to("algorithm.clip.enabled")),
    KeyRule("algorithm.distillation_cliprange_low", "algorithm.clip.ratio_low",
            convert=_to("algorithm.clip.ratio_low")),
    KeyRule("algorithm.distillation_cliprange_high", "algorithm.clip.ratio_high",
            convert=_to("algorithm.clip.ratio_high")),
    KeyRule("algorithm.distillation_cliprange", "algorithm.clip.ratio_low, algorithm.clip.ratio_high",
            "where distillation_cliprange_low / _high do not say otherwise", convert=_opd_clip_range),
    KeyRule("algorithm.train_token_start_pct", "algorithm.token_range.start",
            convert=_to("algorithm.token_range.start")),
    KeyRule("algorithm.train_token_end_pct", "algorithm.token_range.end", convert=_to("algorithm.token_range.end")),
    KeyRule("algorithm.advantage_start_pct", "algorithm.kl_quantile_range.start",
            convert=_to("algorithm.kl_quantile_range.start")),
    KeyRule("algorithm.advantage_end_pct", "algorithm.kl_quantile_range.end",
            convert=_to("algorithm.kl_quantile_range.end")),
    KeyRule("algorithm.do_old_student_log_prob_compute", None, "the student's old log-probs are computed when an "
                                                               "update needs them (ppo_epochs > 1, kl_quantile_range)"),
    KeyRule("algorithm.entropy_coeff", None, _NO_ENTROPY),
    KeyRule("algorithm.temperature", None, "log-probs are scored at the rollouts' sampling temperature "
                                           "(rollout_worker.sampling.temperature)"),
    # ROLL's pipeline config (rlvr_config.py), top level
    KeyRule("exp_name", "experiment_name", source="ROLL"),
    KeyRule("max_steps", "trainer.total_train_steps", source="ROLL"),
    KeyRule("save_steps", "trainer.save_freq", source="ROLL"),
    KeyRule("eval_steps", "weight.validate_freq", source="ROLL"),
    KeyRule("output_dir", "run_dir", "checkpoints go to run_dir/checkpoints", source="ROLL"),
    KeyRule("rollout_batch_size", "trajectory_pool.batch_size",
            "times num_return_sequences_in_group: nexrl counts trajectories, ROLL prompts", source="ROLL",
            convert=_rollout_batch_size),
    KeyRule("num_return_sequences_in_group", "trajectory_pool.group_size", source="ROLL"),
    KeyRule("val_n_sample", "validate.n_samples", source="ROLL"),
    KeyRule("val_greedy", "rollout_worker.validate_temperature", "true becomes 0", source="ROLL",
            convert=_flag("rollout_worker.validate_temperature", 0)),
    KeyRule("track_with", "logger.backend", "stdout becomes console", source="ROLL", convert=_track_with),
    KeyRule("max_ckpt_to_keep", "trainer.remove_previous_ckpt", "1 keeps only the newest; 0 keeps all",
            source="ROLL", convert=_keep_checkpoints),
    KeyRule("resume_from_checkpoint", "resume.mode, resume.resume_path", "true: auto; a path: from_path",
            source="ROLL", convert=_resume),
    KeyRule("rpc_timeout", "ray.call_timeout", source="ROLL"),
    KeyRule("pretrain", "service.train_service.model_path, service.inference_service.model_path", source="ROLL",
            convert=_pretrain),
    KeyRule("domain_interleave_probs", "data.domain_interleave_probs", "with data.type multi_domain",
            source="ROLL"),
    KeyRule("adv_estimator", "algorithm.type", source="ROLL"),
    KeyRule("critic_warmup", "algorithm.critic_warmup", source="ROLL"),
    KeyRule("ppo_epochs", "algorithm.ppo_epochs", source="ROLL"),
    KeyRule("max_grad_norm", "service.train_service.grad_clip", source="ROLL"),
    KeyRule("pg_clip", "algorithm.clip_ratio_low, algorithm.clip_ratio_high", source="ROLL",
            convert=_both_clip_ratios),
    KeyRule("pg_clip_low", "algorithm.clip_ratio_low", source="ROLL"),
    KeyRule("pg_clip_high", "algorithm.clip_ratio_high", source="ROLL"),
    KeyRule("dual_clip_loss", "algorithm.policy_loss", "true becomes dual_clip", source="ROLL",
            convert=_flag("algorithm.policy_loss", "dual_clip")),
    KeyRule("use_topr_loss", "algorithm.policy_loss", "true becomes topr", source="ROLL",
            convert=_flag("algorithm.policy_loss", "topr")),
    KeyRule("loss_agg_mode", "algorithm.loss_agg_mode", source="ROLL"),
    KeyRule("kl_penalty", "algorithm.kl_penalty", source="ROLL"),
    KeyRule("init_kl_coef", "algorithm.kl_ctrl.kl_coef", source="ROLL"),
    KeyRule("target_kl", "algorithm.kl_ctrl.target_kl", "set: kl_ctrl.type becomes adaptive", source="ROLL",
            convert=_target_kl),
    KeyRule("kl_horizon", "algorithm.kl_ctrl.horizon", source="ROLL"),
    KeyRule("add_token_level_kl", "algorithm.use_kl_in_reward", source="ROLL"),
    KeyRule("use_kl_loss", "algorithm.use_kl_loss", source="ROLL"),
    KeyRule("kl_loss_coef", "algorithm.kl_loss_coef", source="ROLL"),
    KeyRule("lambd", "algorithm.lam", "with algorithm.type gae", source="ROLL"),
    KeyRule("gamma", "algorithm.gamma", "with algorithm.type gae or reinforce_plus_plus", source="ROLL"),
    KeyRule("whiten_advantages", "algorithm.whiten_advantages", "with algorithm.type gae", source="ROLL"),
    KeyRule("value_clip", "algorithm.critic.value_clip", "with algorithm.type gae", source="ROLL"),
    KeyRule("reward_clip", "algorithm.reward_processing.clip", source="ROLL"),
    KeyRule("norm_mean_type", "algorithm.reward_processing.norm, norm_mean",
            "with norm_std_type: one kind (batch, group or running) for both", source="ROLL", convert=_reward_norm),
    KeyRule("norm_std_type", "algorithm.reward_processing.norm, norm_std", "read with norm_mean_type",
            source="ROLL", convert=lambda value, recipe, ctx: {} if get_key(recipe, "norm_mean_type") is not None
            else _reward_norm(value, recipe, ctx)),
    KeyRule("max_len_mask", "algorithm.reward_processing.overlong", "true becomes mask", source="ROLL",
            convert=_flag("algorithm.reward_processing.overlong", "mask")),
    KeyRule("actor_infer.generating_args.max_new_tokens", "rollout_worker.sampling.max_tokens", source="ROLL"),
    KeyRule("actor_infer.generating_args.temperature", "rollout_worker.sampling.temperature", source="ROLL"),
    KeyRule("actor_infer.generating_args.top_p", "rollout_worker.sampling.top_p", source="ROLL"),
    KeyRule("actor_infer.generating_args.top_k", "rollout_worker.sampling.top_k", source="ROLL"),
    *(KeyRule(cluster, None, "ROLL's worker clusters: nexrl's are service.train_service and "
                             "service.inference_service", source="ROLL")
      for cluster in ("actor_train", "actor_infer", "reference", "critic", "reward", "rewards")),
    KeyRule("validation", None, "the validation set is validate.data; its sampling is rollout_worker's "
                                "(validate_temperature)", source="ROLL"),
)

# Keys nexrl reads under the same name (the docs list them; a test checks each is a nexrl key).
SAME_KEYS = ("launch_mode", "project_name", "experiment_name", "seed", "data.type", "data.seed", "data.shuffle",
             "data.prompt_key", "rollout_worker.type", "rollout_worker.num_workers",
             "rollout_worker.nexau_agent_config_path", "rollout_worker.nexau_agent_workspace",
             "rollout_worker.task_name", "trajectory_pool.batch_size", "trajectory_pool.group_size",
             "trajectory_pool.key_list", "trajectory_pool.check_batch_ready_function", "trainer.type",
             "trainer.total_train_steps", "trainer.checkpoint_path", "trainer.save_freq",
             "trainer.remove_previous_ckpt", "algorithm.type", "algorithm.use_kl_in_reward", "algorithm.kl_penalty",
             "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef", "weight.sync_mode", "weight.staleness_threshold",
             "weight.validate_freq", "service.inference_service.backend", "service.inference_service.model_tag",
             "service.inference_service.url", "service.inference_service.base_url", "service.inference_service.model",
             "service.inference_service.api_key", "service.inference_service.max_retries",
             "service.train_service.backend", "validate.validate_before_train", "validate.data", "resume.mode",
             "resume.resume_path", "logger.backend", "runtime_monitor.exception_handling.enabled",
             "runtime_monitor.exception_handling.check_interval", "runtime_monitor.exception_handling.policy",
             "runtime_monitor.health_check.enabled", "runtime_monitor.health_check.check_interval",
             "runtime_monitor.health_check.timeout")

# -- values ---------------------------------------------------------------------------------------

VALUE_RULES: tuple[ValueRule, ...] = (
    *(ValueRule(f"{loader}.type", "torch", "file", "JSONL or Parquet files") for loader in LOADERS),
    *(ValueRule(f"{loader}.type", "mock", "arithmetic", "generated a + b questions stand in for the mock rows")
      for loader in LOADERS),
    ValueRule("rollout_worker.type", "mock", "simple", "a real rollout (with the mock inference backend it needs "
                                                      "no model)"),
    ValueRule("rollout_worker.type", "single_turn_math", "simple",
              "with a math evaluator (math_rule where nexrl-rewards is installed, else numeric_answer) when the "
              "recipe names none"),
    ValueRule("rollout_worker.type", "agent", "simple",
              "NexRL's agent worker with agent_cls single_turn_math (its default): with a math evaluator, as for "
              "single_turn_math"),
    ValueRule("trajectory_pool.check_batch_ready_function", "batch_size_reached", "batch_size"),
    *(ValueRule("service.train_service.backend", seed, "local_torch", "the policy trains in this process "
                                                                      "(nexrl-grpo)")
      for seed in ("nextrainer", "direct-zmq", "http")),
    ValueRule("service.inference_service.backend", "sglang", "vllm",
              "with a trainer that trains in this process (self_hosted_*): nexrl pushes new weights to vLLM servers, "
              "not SGLang (weight.backend vllm_disk, as NexRL's sync_method disk); base_url becomes url",
              when=lambda seed, ctx: ctx.pushes_weights(str(get_key(seed, "trainer.type")))),
    ValueRule("service.inference_service.backend", "sglang", "openai",
              "otherwise: SGLang's OpenAI-compatible server; weight pushes to SGLang are not available"),
)

# NexRL values nexrl refuses, and the nearest it accepts.
ADJUSTMENTS: tuple[Adjustment, ...] = (
    Adjustment("rollout_worker.sampling.temperature", r"^rollout_worker\.sampling\.temperature: .*temperature 1 only",
               1.0, "the Tinker service scores tokens at temperature 1 only, so at another temperature the "
                    "importance ratio of its loss would compare two different distributions"),
)

@dataclass(frozen=True)
class Scoring:
    """How one of NexRL 1.4's built-in workers scored a response, and the nexrl evaluator (with its
    options) that scores it the same way on NexRL's rows as they are."""

    worker: str                  # NexRL's rollout_worker.type (agent: with agent_cls single_turn_math)
    nexrl: dict[str, Any]        # rollout_worker.evaluator
    how: str                     # NexRL's scoring, in words
    # NexRL's reward for a response cut off at max_tokens (finish_reason length), whatever it says;
    # None: scored as any other. nexrl: algorithm.reward_processing.overlong score, overlong_reward
    cut_off: float | None = None


NEXRL_ANSWER = "reward_model.ground_truth"  # where NexRL's workers read a row's answer (verl's rows)
SCORINGS: tuple[Scoring, ...] = (
    Scoring("single_turn_math", {"type": "math_rule", "answer_key": NEXRL_ANSWER, "extract_order": ["boxed"],
                                 "wrong_answer_reward": 0.1, "after_thinking": True},
            "the last \\boxed{} of the reply (after its `</think>`; none while `<think>` is open) against "
            "reward_model.ground_truth: 1 when equal, 0.1 when it is not, 0 without one (NexRL's rule judge_mode)",
            cut_off=0.0),
    Scoring("simple", {"type": "exact_match", "answer_key": NEXRL_ANSWER, "extract_pattern": "<answer>(.*?)</answer>"},
            "the first `<answer>...</answer>` of the reply, stripped, equal to reward_model.ground_truth: 1, else 0"),
)


def _scorings_in_words() -> str:
    """SCORINGS as docs/migrating.md lists them."""
    def one(scoring: Scoring) -> str:
        options = ", ".join(f"{k}: {v}" for k, v in scoring.nexrl.items())
        cut_off = "" if scoring.cut_off is None else \
            f", with algorithm.reward_processing {{overlong: score, overlong_reward: {scoring.cut_off:g}}}"
        agent = " (and agent with agent_cls single_turn_math)" if scoring.worker == "single_turn_math" else ""
        return f"{scoring.worker}{agent}: {scoring.how} -> `{{{options}}}`{cut_off}"
    return "; ".join(one(s) for s in SCORINGS)


# Where the seed's recipe leaves a nexrl key unset and the rest of the recipe decides it.
WEIGHT_BACKENDS = {"hf": "in_process", "vllm": "vllm_disk", "tinker": "tinker"}
DERIVED = (
    ("weight.backend", "from service.inference_service.backend when the recipe names none: "
                       + ", ".join(f"{k} -> {v}" for k, v in WEIGHT_BACKENDS.items())
                       + "; NexRL's weight.sync_method (disk, network, tinker) is read no further"),
    ("service.inference_service", "{backend: hf, model_path: ${service.train_service.model_path}} (weight.backend "
                                  "in_process) when a trainer that trains in this process has none (NexRL's "
                                  "pig_latin worker samples nothing, but nexrl pushes the trained weights to an "
                                  "inference service)"),
    ("service.train_service.model_path", "the model is named once: ${service.inference_service.model_path} when the "
                                         "inference backend loads that model itself (hf, a vLLM server nexrl "
                                         "starts); else the model moves there from service.inference_service (a "
                                         "server at url serves it under its model name)"),
    ("service.train_service.base_model", "NexRL's service.inference_service.model with the tinker backend: the "
                                         "Tinker model is named once, where it trains (the tinker weight sync "
                                         "hands the rollouts its sampler)"),
    ("service.inference_service.tokenizer_path", "tinker backend: data.tokenizer_path when it names a local folder, "
                                                 "else ??? (nexrl tokenizes prompts from a local folder, NexRL "
                                                 "fetched the tokenizer by name): set it on the command line"),
    ("service.inference_service.api_key, base_url", "tinker backend: ${service.train_service.api_key} / base_url, "
                                                    "where the train service names them"),
    ("service.reference_service", "{backend: hf, model_path} from NexRL's train service with role teacher; "
                                  "{backend: tinker, base_model, tokenizer_path: the student's} from NexRL's "
                                  "trainer.teachers (remote_api_opd) (on-policy distillation: the teacher only "
                                  "scores the student's tokens)"),
    ("rollout_worker.evaluator", "where the recipe names none, the evaluator that scores as NexRL's built-in "
                                 "worker did, on NexRL's rows as they are: " + _scorings_in_words()
                                 + "; without nexrl-rewards, math is numeric_answer on reward_model.ground_truth (the "
                                   "reply's last number)"),
    ("rollout_worker.prompt_key", "data.prompt_key when it is not prompt and the worker reads one"),
    ("rollout_worker.target_key", "output for the pig_latin worker (NexRL's trains on each row's output)"),
)

# NexRL 1.x's public recipe layouts (recipe/<task>/ of NexRL 1.4), and what each becomes.
LAYOUTS: tuple[Layout, ...] = (
    Layout("math: self_hosted.yaml (defaults: [common, _self_])",
           "rollout_worker.type agent, agent_cls single_turn_math; trainer self_hosted_grpo; SGLang at "
           "${oc.env:INFERENCE_BASE_URL}; weight.sync_method disk with sync_weight_path; "
           "service.train_service.main_actor",
           "rollout_worker.type simple with evaluator math_rule (answer_key reward_model.ground_truth, extract_order "
           "[boxed], wrong_answer_reward 0.1, after_thinking: NexRL's rule scoring; reward_processing.overlong "
           "score: a cut-off "
           "response 0); trainer self_hosted_grpo on local_torch "
           "(model_path ${oc.env:NEXRL_MODEL_PATH}/..., named once); a vLLM server at url "
           "${oc.env:INFERENCE_BASE_URL}; weight.backend vllm_disk, sync_dir from sync_weight_path; "
           "trajectory_pool.group_size from data.rollout_repeat_n"),
    Layout("math: tinker.yaml",
           "trainer remote_api_grpo; service.inference_service.model names the Tinker model; service.tinker_service; "
           "main_actor.config (loss_fn, learning_rate, beta1, beta2, eps)",
           "rollout_worker.type simple with evaluator math_rule; trainer remote_api_grpo; "
           "service.train_service {backend: tinker, base_model, lora_rank, api_key: ${oc.env:TINKER_API_KEY}, lr, "
           "betas, eps}; algorithm.loss_fn; service.inference_service {backend: tinker, tokenizer_path: ???}; "
           "weight.backend tinker"),
    Layout("pig_latin: self_hosted.yaml",
           "rollout_worker.type pig_latin (need_llm_inference false); trainer self_hosted_cross_entropy; no "
           "inference service; the model in main_actor.actor.model.path",
           "the same worker and trainer on local_torch; service.inference_service {backend: hf, model_path: "
           "${service.train_service.model_path}} with weight.backend in_process; rollout_worker.prompt_key from "
           "data.prompt_key; rollout_worker.target_key output"),
    Layout("pig_latin: tinker.yaml",
           "rollout_worker.type pig_latin; trainer remote_api_cross_entropy; loss_fn cross_entropy",
           "the same worker and trainer on the tinker services (as math: tinker.yaml, without algorithm.loss_fn)"),
    Layout("nexau_news: self_hosted.yaml / tinker.yaml (environment.setup_script *.env.sh)",
           "rollout_worker.type nexau with custom_rollout_worker_module_path agent_workspace/news_rollout_worker.py, "
           "nexau_agent_config_path agent_workspace/agent_config.yaml, evaluator_module_path "
           "agent_workspace/evaluator.py:NewsEvaluator; temperature 0.7",
           "rollout_worker.type python (the news worker's file and class, on nexrl-nexau's worker keys) with "
           "evaluator python (path, class), in a copy of agent_workspace beside the new file (<new "
           "name>_workspace/, the imports of NexRL rewritten; the agent YAML by ${recipe_dir}/..., as the worker "
           "reads it from the current folder); the env script named (source it before nexrl run) "
           "with what it exports; the self-hosted and Tinker services as for math; with Tinker, "
           "rollout_worker.sampling.temperature 0.7 -> 1.0"),
    Layout("nexau_deepsearch: self_hosted.yaml / tinker.yaml",
           "rollout_worker.type nexau with nexau_agent_workspace agent_workspace (agent_config.yaml, tools/*.yaml, "
           "web_tool.py, evaluator.py:DeepResearchEvaluator); temperature 0.7",
           "rollout_worker.type nexau with the workspace and agent YAML (by ${recipe_dir}/...) and the evaluator "
           "in a copy of agent_workspace beside the new file (<new name>_workspace/, whole: the tools YAML and "
           "module stay next to the agent YAML that names them; the imports of NexRL rewritten); the env script "
           "named; the services as for math; with Tinker, "
           "rollout_worker.sampling.temperature 0.7 -> 1.0"),
    Layout("on_policy_distill: self_hosted_opd_*.yaml (no defaults list)",
           "trainer self_hosted_opd with trainer.algorithm type distillation; service.train_service.student (role "
           "actor) and .teacher (role teacher); weight.sync_method network",
           "trainer self_hosted_opd: algorithm kl_coef, ppo_epochs, clip, token_range, kl_quantile_range from "
           "NexRL's distillation keys; the teacher is service.reference_service {backend: hf, model_path}; "
           "weight.backend vllm_disk (NexRL's network sync is internal; disk is its open-source counterpart)"),
    Layout("on_policy_distill: the remote-API recipe (weaver_opd.yaml's shape) on Tinker",
           "trainer remote_api_opd with trainer.teachers [{base_model, checkpoint}]; service.tinker_service; "
           "main_actor.config with kl_penalty_coef, kl_discount_factor, entropy_coeff; temperature 0.8",
           "trainer remote_api_opd (nexrl-tinker with nexrl-grpo): the simple worker scores with exact_match "
           "(extract_pattern `<answer>(.*?)</answer>`, answer_key reward_model.ground_truth), as NexRL's did; "
           "algorithm.kl_coef from kl_penalty_coef; the "
           "first teacher is service.reference_service {backend: tinker, base_model, tokenizer_path: the "
           "student's}; the services as for math: tinker.yaml; rollout_worker.sampling.temperature 0.8 -> 1.0; "
           "NexRL's Weaver backend is not mapped"),
)

# -- imports and classes --------------------------------------------------------------------------

IMPORT_RULES: tuple[ImportRule, ...] = (
    ImportRule("nexrl.NexRLController", "nexrl_core.NexRLController",
               "NexRLController(config).run() in a Hydra main as before: a config without the sections nexrl has "
               "defaults for gets them, is checked as nexrl validate checks it and records run.json; or nexrl run"),
    ImportRule("nexrl.BaseRolloutWorker", "nexrl_core.BaseRolloutWorker"),
    ImportRule("nexrl.rollout_worker.SimpleRolloutWorker", "nexrl_core.SimpleRolloutWorker"),
    ImportRule("nexrl.rollout_worker.PigLatinRolloutWorker", "nexrl_core.builtins.workers.PigLatinRolloutWorker"),
    ImportRule("nexrl.rollout_worker.Evaluator", "nexrl_core.Evaluator"),
    ImportRule("nexrl.rollout_worker.BaseEvaluationTarget", "nexrl_core.BaseEvaluationTarget"),
    ImportRule("nexrl.rollout_worker.EvaluationRunResult", "nexrl_core.EvaluationRunResult"),
    ImportRule("nexrl.rollout_worker.NexAUEvaluationTarget", "nexrl_nexau.NexAUEvaluationTarget"),
    ImportRule("nexrl.rollout_worker.BaseNexAURolloutWorker", "nexrl_nexau.BaseNexAURolloutWorker",
               "it runs the agent itself; a subclass overrides format_task_query (the task's query), "
               "get_train_loss_mask or execute_agent, not run_agent with NexRL's load_agent_from_config "
               "(docs/agents.md)"),
    ImportRule("nexrl.rollout_worker.DefaultNexAURolloutWorker", "nexrl_nexau.DefaultNexAURolloutWorker"),
    ImportRule("nexrl.rollout_worker.AgentRolloutWorker", None,
               "rollout_worker.type nexau runs tool-using agents (nexrl-nexau)"),
    ImportRule("nexrl.rollout_worker.MockRolloutWorker", None,
               "SimpleRolloutWorker with the mock inference backend needs no model"),
    ImportRule("nexrl.trainer.BaseTrainer", "nexrl_core.BaseTrainer"),
    ImportRule("nexrl.trainer.SelfHostedTrainer", "nexrl_grpo.trainers.SelfHostedTrainer"),
    ImportRule("nexrl.trainer.SelfHostedGrpoTrainer", "nexrl_grpo.trainers.SelfHostedGrpoTrainer"),
    ImportRule("nexrl.trainer.RemoteApiTrainer", "nexrl_tinker.trainers.RemoteApiTrainer"),
    ImportRule("nexrl.trainer.RemoteApiGrpoTrainer", "nexrl_tinker.trainers.RemoteApiGrpoTrainer"),
    ImportRule("nexrl.trainer.RemoteApiCrossEntropyTrainer", "nexrl_tinker.trainers.RemoteApiCrossEntropyTrainer"),
    ImportRule("nexrl.trainer.RemoteApiOpdTrainer", "nexrl_tinker.opd.RemoteApiOpdTrainer"),
    ImportRule("nexrl.trainer.SelfHostedOpdTrainer", "nexrl_grpo.opd.SelfHostedOpdTrainer"),
    ImportRule("nexrl.nexrl_types.Batch", "nexrl_core.Batch",
               "the padded tensors of _prepare_batch; the pool hands the trainer a TrajectoryBatch of "
               "trajectory rows (no from_trajectories / to_trajectories)"),
    ImportRule("nexrl.nexrl_types.Trajectory", "nexrl_core.Trajectory"),
    ImportRule("nexrl.nexrl_types.ModelTag", "nexrl_core.ModelTag"),
    ImportRule("nexrl.nexrl_types.NexRLRole", "nexrl_core.NexRLRole"),
    ImportRule("nexrl.data_loader.BaseDataLoader", "nexrl_core.BaseDataLoader"),
    ImportRule("nexrl.data_loader.TorchDataLoader", "nexrl_core.FileDataLoader", "data.type file"),
    ImportRule("nexrl.data_loader.MockDataLoader", None, "data.type arithmetic generates rows without files"),
    ImportRule("nexrl.trajectory_pool.TrajectoryPool", "nexrl_core.TrajectoryPool"),
    ImportRule("nexrl.trajectory_pool.TrajectoryPoolInstance", "nexrl_core.TrajectoryPoolInstance"),
    ImportRule("nexrl.trajectory_pool.SimpleTrajectoryStore", "nexrl_core.SimpleTrajectoryStore"),
    ImportRule("nexrl.trajectory_pool.GroupedTrajectoryStore", "nexrl_core.GroupedTrajectoryStore"),
    ImportRule("nexrl.trajectory_pool.HierarchicalTrajectoryStore", "nexrl_core.HierarchicalTrajectoryStore"),
    ImportRule("nexrl.validator.Validator", "nexrl_core.Validator"),
    ImportRule("nexrl.weight_sync.WeightSyncController", "nexrl_core.WeightSyncController"),
    ImportRule("nexrl.activity_tracker.ActivityTracker", "nexrl_core.ActivityTracker"),
    ImportRule("nexrl.activity_tracker.ActivityTrackerProxy", "nexrl_core.ActivityTrackerProxy"),
    ImportRule("nexrl.error_reporter.ErrorReporter", "nexrl_core.ErrorReporter"),
    ImportRule("nexrl.error_reporter.ErrorSeverity", "nexrl_core.ErrorSeverity"),
    ImportRule("nexrl.error_reporter.ErrorInfo", "nexrl_core.errors.ErrorInfo"),
    ImportRule("nexrl.nexrl_module.NexRLModule", "nexrl_core.NexRLModule"),
    ImportRule("nexrl.llm_service_client.LLMServiceClient", "nexrl_core.InferenceClient",
               "a worker's self._llm_client; complete() and chat() return a CompletionResult with token ids "
               "and log-probs"),
    ImportRule("nexrl.utils.execute", "nexrl_core.execute"),
    ImportRule("nexrl.utils.execute_async", "nexrl_core.execute_async"),
    ImportRule("nexrl.utils.logging_utils.set_logging_basic_config", None,
               "nexrl run sets up logging (logger.level; run.log in run_dir)"),
    ImportRule("nexrl.ray_resource_manager.RayResourceManager", None,
               "launch_mode ray places the actors from the recipe's ray.colocation and ray.resources"),
    ImportRule("nexrl.ray_resource_manager.RayActorWrapper", None,
               "launch_mode ray places the actors from the recipe's ray.colocation and ray.resources"),
)

# -- metric names ---------------------------------------------------------------------------------

METRIC_RULES: tuple[MetricRule, ...] = (
    MetricRule("val/<score_key>", "val/<score_key>", "failed samples count 0 (docs/evaluation.md)"),
    MetricRule("val/<data_source>_<score_key>", "val/<data_source>_<score_key>"),
    MetricRule("val/num_samples", "val/num_samples"),
    MetricRule("rollout/<score_key>", "rollout/<score_key>"),
    MetricRule("rollout/reward_mean", "train/reward_mean"),
    MetricRule("rollout/reward_std", None, "train/group_reward_std_mean is the mean of the groups' std"),
    MetricRule("critic/grpo_std/mean", "train/group_reward_std_mean",
               "the groups' unbiased (n - 1) std, where NexRL's is the population std"),
    MetricRule("critic/advantage_mean", None, "train/advantages_abs_mean is the mean of |advantage|"),
    MetricRule("val_correct/all/mean", "val/success_rate",
               "samples whose reward reaches validate.success_threshold (1.0 unless set)", source="ROLL"),
    MetricRule("val_correct/<tag>/mean", "val/<tag>/success_rate", "for rows with a tag field, as ROLL's",
               source="ROLL"),
)


# -- lookups --------------------------------------------------------------------------------------

_BY_SEED = {rule.seed: rule for rule in KEY_RULES}


def rule_for(key: str) -> KeyRule | None:
    """The key rule of a seed key, as a recipe holds it (dotted)."""
    return _BY_SEED.get(key)


def seed_key_hint(key: str) -> str | None:
    """What follows ``<key>: `` for a key nexrl does not know when the table does: the nexrl key it
    became and the pointer to ``nexrl migrate`` (None: not a seed key)."""
    inner = [r for r in KEY_RULES if r.seed.startswith(key + ".") and r.nexrl is not None]
    if inner:
        where = ", ".join(f"{r.seed[len(key) + 1:]} -> {r.nexrl}" for r in inner[:3])
        return f"unknown key; a {inner[0].source} section: {where} ({POINTER})"
    rule = _BY_SEED.get(key)
    if rule is None:
        return None
    if rule.nexrl is None:
        return f"unknown key; a {rule.source} key nexrl has no counterpart for: {rule.why} ({POINTER})"
    return f"unknown key; {rule.source}'s name for {rule.nexrl} ({POINTER})"


def seed_key_suffix(key: str) -> str:
    """`` (nexrl migrate ...)`` after the message of a key nexrl no longer reads, when it is a seed
    key (its message already names what replaces it)."""
    known = key in _BY_SEED or any(r.seed.startswith(key + ".") for r in KEY_RULES)
    return f" ({POINTER})" if known else ""


SEED_KEY_WORDS.update(hint=seed_key_hint, suffix=seed_key_suffix)
