"""Every key the core reads, with its default, type, range and help, declared once as typed
settings classes: one per section, and :class:`RecipeSettings` for the whole recipe, which the run's
prologue reads a composed recipe into once (``RecipeSettings.of(cfg)``). The one home of the
recipe's core defaults (``core_defaults()`` is what a recipe is merged onto); ``CORE_OPTIONS`` is
its Option table (what ``nexrl validate``, ``nexrl config`` and the docs walk). A section marked
``component=`` also holds the selected component's own keys, which the component reads itself.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..types import NexRLRole
from .options import Option, option_defaults
from .settings import ROOT_OPTIONS, PlainData, Settings, setting

RESUME_MODES = ("disable", "auto", "from_path")
ON_FAILURE = ("stop", "restart")
ERROR_POLICIES = ("stop_on_error", "stop_on_critical", "continue")
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL")


SYNC_MODES = ("sync", "batch-async", "fully-async")
BATCH_READY_FUNCTIONS = ("batch_size", "loaded_batch_finished", "batch_size_or_loaded_batch_finished")

# launch_mode -> "module:class" of its resource manager (nexrl_core.launch builds it)
LAUNCH_MODES: dict[str, str] = {
    "local": "nexrl_core.launch.local:LocalResourceManager",
    "ray": "nexrl_core.launch.ray.manager:RayResourceManager",
}
# Accepted names that do not run yet, and why (one message for `nexrl validate` and `nexrl run`).
PLANNED_LAUNCH_MODES: dict[str, str] = {}
RICH_MISSING = "the live progress display needs rich: pip install 'nexrl-core[progress]'"


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (an optional extra), without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def ray_installed() -> bool:
    return installed("ray")


def launch_mode_problem(mode: Any) -> str | None:
    """Why ``launch_mode: mode`` cannot run, or None when it can."""
    if mode == "ray" and not ray_installed():
        return "launch_mode: 'ray' needs Ray, an optional extra: pip install 'nexrl-core[ray]'"
    if mode in LAUNCH_MODES:
        return None
    if mode in PLANNED_LAUNCH_MODES:
        return PLANNED_LAUNCH_MODES[mode]
    return f"launch_mode: '{mode}' is not one of {', '.join(LAUNCH_MODES)}"


def progress_problem(setting: Any) -> str | None:
    """``logger.progress``'s check (validate and run): 'rich' needs the rich package."""
    return RICH_MISSING if setting == "rich" and not installed("rich") else None


def _launch_mode(value: Any) -> str | None:
    problem = launch_mode_problem(value)  # the same words `nexrl run` stops with
    return problem.split(": ", 1)[1] if problem else None


def _positive_or(word: str) -> Callable[[Any], str | None]:
    """The check of a key that takes ``word`` or a positive integer (null aside)."""
    def check(value: Any) -> str | None:
        if value == word or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return None
        return f"expected null, '{word}' or a positive integer, got {value!r}"
    return check


def _reward_range(value: Any) -> str | None:
    if len(value) != 2 or value[0] > value[1]:
        return f"expected [low, high] with low <= high, got {list(value)}"
    return None


# -- sections -----------------------------------------------------------------------------------
# Each section is a typed Settings class (the one declaration); its Option table (``.options()``,
# CORE_OPTIONS for the whole) is derived from it for what walks declarations.


@dataclass(frozen=True, kw_only=True)
class DataSettings(Settings):
    type: str = setting("file", "registered data loader (nexrl plugins lists them)")
    seed: int = setting("${seed}", "seed of the loader's shuffling (and of generated data)")
    shuffle: bool = setting(True, "shuffle the rows each epoch")


@dataclass(frozen=True, kw_only=True)
class ValidateDataSettings(Settings):  # a validation pass is ordered (no shuffling): a loader that draws data declares its seed
    type: str = setting("file", "registered data loader of the validation set")


@dataclass(frozen=True, kw_only=True)
class EvaluatorSettings(Settings):
    type: str = setting("exact_match", "registered evaluator; the other keys go to its constructor")


#: an evaluator's section as the recipe writes it (its own keys are the evaluator's)
EvaluatorSection = dict[str, PlainData]


@dataclass(frozen=True, kw_only=True)
class RolloutWorkerSettings(Settings):
    type: str = setting("simple", "registered rollout worker")
    num_workers: int = setting(4, "rollout worker threads", ge=1)
    seed: int = setting("${seed}", "seed of per-request sampling seeds")
    validate_temperature: float | None = setting(None, "sampling temperature during validation (null: the "
                                                       "training temperature)", ge=0, needs="validate.data")
    reward_range: list[float] | None = setting(None, "[low, high]: a reward outside fails the sample",
                                               check=_reward_range)
    num_actors: int = setting(1, "launch_mode ray: actors the workers are spread over (at most num_workers)", ge=1)
    tasks_per_call: int = setting(1, "tasks a worker takes per data-loader call and hands on per pool call "
                                     "(raise it for cheap rollouts in Ray mode, where every call crosses "
                                     "processes)", ge=1)
    evaluator: EvaluatorSettings | None = setting(EvaluatorSettings, "how a response is scored (null: no "
                                                                     "evaluator, reward 0)", component="evaluator")
    domain_evaluators: dict[str, EvaluatorSection | None] = setting(
        {}, "per-domain evaluators, {<domain>: {type: <evaluator>, ...}}: a task with a domain listed here is "
            "scored by its evaluator, others by rollout_worker.evaluator",
        values=Option(type=(dict, None), options=EvaluatorSettings.options(), component="evaluator",
                      help="one domain's evaluator (null: none, reward 0)"))


@dataclass(frozen=True, kw_only=True)
class DynamicSamplingSettings(Settings):
    enabled: bool = setting(False, "drop finished groups whose rewards are all equal and draw a fresh row in "
                                   "their place")
    max_replacements: int = setting(3, "drops in a row for one batch slot before a flat group is kept", ge=0,
                                    needs=".enabled")


@dataclass(frozen=True, kw_only=True)
class TrajectoryPoolSettings(Settings):
    REMOVED = {"type": "nexrl has one trajectory pool; delete trajectory_pool.type"}

    batch_size: int = setting(16, "trajectories per training step", ge=1)
    group_size: int = setting(4, "samples per prompt (a GRPO group)", ge=1)
    key_list: list[str] = setting(["uid"], "trajectory keys that group samples (empty: no grouping)")
    check_batch_ready_function: str = setting("batch_size", "when a batch is ready", choices=BATCH_READY_FUNCTIONS)
    dynamic_sampling: DynamicSamplingSettings = setting(DynamicSamplingSettings, "dynamic sampling (DAPO): train "
                                                                                 "only on groups with a reward signal")


@dataclass(frozen=True, kw_only=True)
class TrainerSettings(Settings):
    type: str = setting(help="registered trainer (nexrl plugins lists them; mock: a stand-in that trains nothing, "
                             "for trying the plumbing)")
    total_train_steps: int = setting(10, "training steps of the run (replaced by what num_train_epochs gives when "
                                         "that is set)", ge=1)
    num_train_epochs: float | None = setting(None, "passes over the training data instead of a step count: "
                                                   "total_train_steps becomes ceil(epochs x data rows / prompts per "
                                                   "step), prompts per step = trajectory_pool.batch_size / "
                                                   "group_size (null: total_train_steps decides)", gt=0)
    checkpoint_path: str | None = setting("${run_dir}/checkpoints", "folder of global_step_<N> checkpoints")
    save_freq: int = setting(0, "checkpoint every N steps and after the last one (0: only what save_final and "
                                "save_on_stop say)", ge=0)
    save_final: bool = setting(True, "checkpoint after the last step even with save_freq 0: the trained weights "
                                     "for nexrl export and a run that trains on (false: keep them only when "
                                     "save_freq says so)")
    remove_previous_ckpt: bool = setting(False, "keep only the newest checkpoint",
                                         needs="trainer.save_freq > 0 or trainer.save_final or trainer.save_on_stop")
    save_on_stop: bool = setting(False, "checkpoint when stopped by a signal")


@dataclass(frozen=True, kw_only=True)
class WeightSettings(Settings):
    REMOVED = {"type": "the weight-sync backend is chosen with weight.backend; delete weight.type"}

    backend: str = setting("version_only", "registered weight-sync backend: how new weights reach the inference "
                                           "service")
    sync_mode: str = setting("sync", "sync | batch-async | fully-async", choices=SYNC_MODES)
    staleness_threshold: int = setting(0, "max weight versions a trained sample may lag (async modes)", ge=0,
                                       needs="weight.sync_mode != sync")
    validate_freq: int = setting(0, "validate every N steps (0: never; needs validate.data)", ge=0)
    partial_rollout: bool = setting(False, "a weight push does not wait for the requests decoding: the engine takes "
                                           "the new weights at its next decode-step boundary and each request goes "
                                           "on from the tokens it has (token_versions records which weights "
                                           "sampled each token); false: a push waits for the running batch",
                                    needs="weight.sync_mode != sync")
    rollouts_ahead: int | str | None = setting(
        None, "async modes: at most this many training rollouts started and not yet taken by the trainer "
              "(decoding, or waiting in the pool); 'staleness' = max(staleness_threshold, 1) x trajectory_pool."
              "batch_size: the engine generates the next batches while the trainer steps, and none that would come "
              "out too stale to train; null: no bound (what comes out too stale is re-rolled)",
        check=_positive_or("staleness"), needs="weight.sync_mode != sync")
    model_update_frequency: int = setting(1, "push the trained weights to the inference service every N steps (and "
                                             "before a validation); N > 1 needs an async sync_mode with "
                                             "staleness_threshold >= N", ge=1)
    verify_served: bool | str = setting(
        "auto", "after each push, the served model and the trainer score a fixed probe (weight/served_probe_gap): "
                "auto stops the run when the served log-probs did not change though the trainer's moved beyond "
                "the tolerance (the weights never arrived) and warns on any other gap beyond it; true stops on any "
                "gap beyond it, and when either side cannot score; false: no probe",
        choices=("auto", True, False))
    served_probe_tolerance: float = setting(1e-3, "largest gap (max |log-prob difference| over the probe's tokens) "
                                                  "between the served model and the trainer that counts as serving "
                                                  "the trainer's weights", gt=0)
    rollout_limit: int | str | None = setting(
        "batch", "sync mode: rollouts started per weight version; 'batch' = trajectory_pool.batch_size (none "
                 "wasted, runs reproducible); N or null (until a batch is ready) start extras, which are waited "
                 "for and re-rolled",
        check=_positive_or("batch"), needs="weight.sync_mode == sync")


@dataclass(frozen=True, kw_only=True)
class InferenceServiceSettings(Settings):
    backend: str = setting(help="registered inference backend (nexrl plugins lists them; mock: canned answers, "
                                "for trying the plumbing)")
    model_tag: str = setting("default", "name of this inference service inside nexrl")


@dataclass(frozen=True, kw_only=True)
class ServiceSettings(Settings):
    train_service: dict[str, PlainData] = setting({}, "the train service the trainer drives: backend (a registered "
                                                      "train service) and that service's own keys")
    inference_service: InferenceServiceSettings = setting(InferenceServiceSettings, "the inference service rollouts "
                                                                                    "sample from",
                                                          component="inference_backend", selector="backend")
    reference_service: InferenceServiceSettings | None = setting(
        None, "the KL reference on an inference service of its own (null: the trainer holds a frozen copy of the "
              "initial model): backend and its keys, as service.inference_service; it only scores the rollouts' "
              "tokens and never receives weights",
        component="inference_backend", selector="backend")


@dataclass(frozen=True, kw_only=True)
class ValidateSettings(Settings):
    REMOVED = {"eval": "validation metrics are always computed by nexrl_core.runtime.eval_core; delete validate.eval"}

    validate_before_train: bool = setting(False, "validate the initial weights (needs validate.data)")
    n_samples: int = setting(1, "samples per validation prompt", ge=1, needs="validate.data")
    success_threshold: float = setting(1.0, "reward counted as correct (val/success_rate, pass@k)",
                                       needs="validate.data")
    data: ValidateDataSettings | None = setting(None, "the validation set (a data loader mapping)",
                                                component="dataloader")


@dataclass(frozen=True, kw_only=True)
class ResumeSettings(Settings):
    mode: str = setting("disable", "disable: a fresh run | auto: newest checkpoint if any | from_path",
                        choices=RESUME_MODES)
    resume_path: str | None = setting(None, "global_step_<N> folder for mode from_path",
                                      needs="resume.mode == from_path")
    on_failure: str = setting("stop", "a run a failed module stops (error policy, health check, trainer error, a "
                                      "lost Ray actor): stop (exit 1) | restart (nexrl run starts it again from the "
                                      "newest checkpoint, as resume.mode=auto)", choices=ON_FAILURE)
    max_restarts: int = setting(3, "restarts at most, over the run's life (then it stops with exit 1)", ge=0,
                                needs="resume.on_failure == restart")
    restart_backoff: float = setting(10.0, "seconds before the first restart, doubled before each next one", ge=0,
                                     needs="resume.on_failure == restart")
    restart_backoff_max: float = setting(300.0, "the longest wait before a restart", ge=0,
                                         needs="resume.on_failure == restart")


PROGRESS_MODES = ("auto", "rich", "plain", "off")


@dataclass(frozen=True, kw_only=True)
class LoggerSettings(Settings):
    HOLDS_OTHERS = True  # logger.<sink>: each chosen metrics sink's own keys

    backend: str | list[str] = setting(["console"], "experiment loggers (registered metrics sinks): console, "
                                                    "wandb, tensorboard")
    level: str = setting("INFO", "console log level (run.log is always DEBUG)", choices=LOG_LEVELS)
    progress: str = setting("auto", "nexrl run's progress display on stderr: rich (live, for a terminal), plain "
                                    "(one line per step), auto (rich on a terminal, else plain), off",
                            choices=PROGRESS_MODES, check=progress_problem)
    samples_every: int = setting(10, "every N training steps, and at the first and the last, write some of the "
                                     "step's generations to samples.jsonl (0: never)", ge=0)
    samples_per_step: int = setting(4, "generations written per such step, spread over the batch", ge=1,
                                    needs="logger.samples_every > 0")


@dataclass(frozen=True, kw_only=True)
class HealthCheckSettings(Settings):
    enabled: bool = setting(True, "stop when a module stops answering")
    check_interval: float = setting(30.0, "seconds between health checks", gt=0, needs=".enabled")
    timeout: float = setting(5.0, "seconds a module may take to answer", gt=0, needs=".enabled")
    grace_period: float = setting(0.0, "seconds a module may stay unhealthy", ge=0, needs=".enabled")


@dataclass(frozen=True, kw_only=True)
class ExceptionHandlingSettings(Settings):
    enabled: bool = setting(True, "apply the error policy")
    check_interval: float = setting(1.0, "seconds between error checks", gt=0, needs=".enabled")
    policy: str = setting("stop_on_error", "which reported errors stop the run", choices=ERROR_POLICIES,
                          needs=".enabled")


@dataclass(frozen=True, kw_only=True)
class FailedSamplesSettings(Settings):
    enabled: bool = setting(True, "stop a run whose training samples mostly fail")
    max_fraction: float = setting(0.5, "stop when more than this fraction of the recent training samples failed",
                                  ge=0, le=1, needs=".enabled")
    window: int = setting(64, "how many recent training samples the fraction is taken over", ge=1,
                          needs=".enabled")


@dataclass(frozen=True, kw_only=True)
class RuntimeMonitorSettings(Settings):
    stop_timeout: float = setting(30.0, "seconds to wait for modules to stop", ge=0)
    health_check: HealthCheckSettings = setting(HealthCheckSettings, "liveness of modules and the inference service")
    exception_handling: ExceptionHandlingSettings = setting(ExceptionHandlingSettings, "errors reported by modules")
    failed_samples: FailedSamplesSettings = setting(FailedSamplesSettings, "failed samples (rollout or evaluator "
                                                                           "errors) among those the trainer consumed")


# -- launch_mode: ray ----------------------------------------------------------------------------

# Where each role runs by default (role -> co-location group; null: an actor of its own): the
# control plane together, the trainer with the inference engine (their weight sync stays in
# process), the rollout workers over rollout_worker.num_actors actors of their own.
RAY_COLOCATION = {
    NexRLRole.ACTIVITY_TRACKER: "control", NexRLRole.DATA_LOADER: "control",
    NexRLRole.VALIDATE_DATALOADER: "control", NexRLRole.TRAJECTORY_POOL: "control", NexRLRole.VALIDATOR: "control",
    NexRLRole.WEIGHT_SYNC_CONTROLLER: "control", NexRLRole.TRAINER: "model", NexRLRole.INFERENCE_SERVICE: "model",
    NexRLRole.ROLLOUT_WORKER: None,
}


def _group_name(value: Any) -> str | None:
    return None if value else "expected a group name or null, got ''"


def _worker_group_alone(colocation: Any) -> str | None:
    group = colocation.get(NexRLRole.ROLLOUT_WORKER.value)
    others = sorted(r for r, g in colocation.items() if g == group and r != NexRLRole.ROLLOUT_WORKER.value)
    if group is None or not others:
        return None
    return (f"rollout workers spread over rollout_worker.num_actors actors of their own; group '{group}' also "
            f"names {', '.join(others)}")


def _custom_resources(value: Any) -> str | None:
    bad = {k: v for k, v in value.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0}
    return f"expected a mapping of custom resource -> amount >= 0, got {bad}" if bad else None


@dataclass(frozen=True, kw_only=True)
class RayResourceSettings(Settings):
    num_cpus: float | None = setting(None, "CPUs reserved", ge=0)
    num_gpus: float | None = setting(None, "GPUs reserved (fractions share one)", ge=0)
    memory: float | None = setting(None, "bytes of memory reserved", ge=0)
    resources: dict[str, float] | None = setting(None, "custom resources: name -> amount", type=dict,
                                                 check=_custom_resources)


#: what one role's actor reserves, as the recipe writes it (``ray.resources.<role>``)
ResourceAmounts = dict[str, float | dict[str, float] | None]


@dataclass(frozen=True, kw_only=True)
class RaySectionSettings(Settings):
    address: str | None = setting(None, "a running cluster to attach to ('auto', 'host:6379', 'ray://host:10001'); "
                                        "null: $RAY_ADDRESS, else a local cluster started and stopped by the run")
    private_network: bool = setting(False, "local cluster (on loopback only either way): nexrl run runs itself and "
                                           "the cluster in a network namespace with only loopback, so no other "
                                           "process of the machine reaches its ports; the run then reaches no "
                                           "network (Linux)")
    num_cpus: float | None = setting(None, "local cluster: CPUs it offers (null: the machine's)", ge=0)
    num_gpus: float | None = setting(None, "local cluster: GPUs it offers (null: those found)", ge=0)
    object_store_memory: int | None = setting(None, "local cluster: bytes of its object store (null: Ray's "
                                                    "default)", ge=1)
    call_timeout: float | None = setting(300.0, "seconds a call to an actor may take (null: no limit); calls that "
                                                "last as long as their work (model load, checkpoint, weight push, "
                                                "stop) are not limited", gt=0)
    placement_timeout: float | None = setting(300.0, "seconds an actor may wait for a node with the resources it "
                                                     "asks for (ray.resources) and for its process to start; then "
                                                     "the run fails naming it and what the nodes have (null: no "
                                                     "limit, e.g. for an autoscaler that adds nodes slowly)", gt=0)
    max_concurrency: int | None = setting(None, "calls one actor serves at once (null: one per rollout worker + 32)",
                                          ge=1)
    colocation: dict[str, str | None] = setting(dict, "role -> group: the roles of one group share one actor (null: "
                                                      "an actor of its own)", options={
        role.value: Option(group, (str, None), f"co-location group of the {role.value.replace('_', ' ')}",
                           check=_group_name)
        for role, group in RAY_COLOCATION.items()
    }, check=_worker_group_alone)
    resources: dict[str, ResourceAmounts | None] = setting(
        {}, "role -> what its actor reserves (rollout workers: per actor; an actor hosting several roles reserves "
            "the sum)",
        options={role.value: Option(None, (dict, None), f"resources of the {role.value.replace('_', ' ')}",
                                    options=RayResourceSettings.options()) for role in NexRLRole})
    env_vars: dict[str, str | int | float | bool] = setting({}, "extra environment of every actor (NEXRL_*, HF_*, "
                                                                "TRANSFORMERS_* ... are passed on already)")


@dataclass(frozen=True, kw_only=True)
class RecipeSettings(Settings):
    """The whole recipe as a run reads it: built once per run by the prologue (``start_run``)."""

    launch_mode: str = setting("local", "where the modules run (local: threads in one process; ray: Ray actors, "
                                        "see the ray section)", check=_launch_mode)
    project_name: str = setting("nexrl", "project name (experiment loggers)")
    experiment_name: str = setting("run", "experiment name (experiment loggers, default run_dir)")
    run_dir: str = setting("runs/${experiment_name}", "where metrics.jsonl, errors.jsonl and run.log go")
    overwrite_run_dir: bool = setting(False, "a fresh run into a run_dir that holds an earlier run moves the "
                                             "earlier run aside to <run_dir>.old-<time> (never appends)")
    seed: int = setting(42, "seed of every random choice of the run")
    data: DataSettings = setting(DataSettings, "the training data loader", component="dataloader")
    rollout_worker: RolloutWorkerSettings = setting(RolloutWorkerSettings, "rollout workers",
                                                    component="rollout_worker")
    trajectory_pool: TrajectoryPoolSettings = setting(TrajectoryPoolSettings, "how trajectories are grouped into "
                                                                              "batches")
    trainer: TrainerSettings = setting(TrainerSettings, "the trainer", component="trainer")
    algorithm: dict[str, PlainData] = setting({}, "the RL algorithm (keys declared by the trainer)")
    weight: WeightSettings = setting(WeightSettings, "weight synchronisation between trainer and inference service",
                                     component="weight_sync_backend", selector="backend")
    service: ServiceSettings = setting(ServiceSettings, "train and inference services")
    validate: ValidateSettings = setting(ValidateSettings, "validation")
    resume: ResumeSettings = setting(ResumeSettings, "resuming from checkpoints")
    logger: LoggerSettings = setting(LoggerSettings, "logging and experiment loggers")
    runtime_monitor: RuntimeMonitorSettings = setting(RuntimeMonitorSettings, "health, errors and failed samples")
    ray: RaySectionSettings = setting(RaySectionSettings, "launch_mode ray: the cluster, placement and resources of "
                                                          "the actors (pip install 'nexrl-core[ray]')")
    recipe_dir: str | None = setting(None, "set by nexrl: the recipe file's folder (${recipe_dir}/data.jsonl names "
                                           "a file next to the recipe)")


CORE_OPTIONS: dict[str, Option] = RecipeSettings.options()
ROOT_OPTIONS.update(CORE_OPTIONS)


def core_defaults() -> dict[str, Any]:
    """The mapping every recipe is merged onto."""
    out = option_defaults(CORE_OPTIONS)
    out.pop("recipe_dir", None)
    return out
