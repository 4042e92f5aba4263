"""Every key the core reads, with its default, type, range and help: the one home of the
recipe's core defaults (``core_defaults()`` is what a recipe is merged onto).

A section marked ``component=`` selects a registered component with its ``selector`` key;
the component's own declared options (:mod:`nexrl_core.config.options`) are allowed next to the
core keys listed here.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ..types import NexRLRole
from .options import REQUIRED, Option, option_defaults

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


def rich_installed() -> bool:
    return installed("rich")


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
    return RICH_MISSING if setting == "rich" and not rich_installed() else None


def _launch_mode(value: Any) -> str | None:
    problem = launch_mode_problem(value)  # the same words `nexrl run` stops with
    return problem.split(": ", 1)[1] if problem else None


def _rollout_limit(value: Any) -> str | None:
    if value == "batch" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    return f"expected null, 'batch' or a positive integer, got {value!r}"


def _rollouts_ahead(value: Any) -> str | None:
    if value == "staleness" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    return f"expected null, 'staleness' or a positive integer, got {value!r}"


def _reward_range(value: Any) -> str | None:
    if len(value) != 2 or value[0] > value[1]:
        return f"expected [low, high] with low <= high, got {list(value)}"
    return None


# -- sections -----------------------------------------------------------------------------------

DATA = {
    "type": Option("file", str, "registered data loader (nexrl plugins lists them)"),
    "seed": Option("${seed}", int, "seed of the loader's shuffling (and of generated data)"),
    "shuffle": Option(True, bool, "shuffle the rows each epoch"),
}

VALIDATE_DATA = {  # a validation pass is ordered (no shuffling): a loader that draws data declares its seed
    "type": Option("file", str, "registered data loader of the validation set"),
}

EVALUATOR = {
    "type": Option("exact_match", str, "registered evaluator; the other keys go to its constructor"),
}

ROLLOUT_WORKER = {
    "type": Option("simple", str, "registered rollout worker"),
    "num_workers": Option(4, int, "rollout worker threads", ge=1),
    "seed": Option("${seed}", int, "seed of per-request sampling seeds"),
    "validate_temperature": Option(None, float, "sampling temperature during validation (null: the "
                                                "training temperature)", ge=0, needs="validate.data"),
    "reward_range": Option(None, list[float], "[low, high]: a reward outside fails the sample",
                           check=_reward_range),
    "num_actors": Option(1, int, "launch_mode ray: actors the workers are spread over (at most num_workers)",
                         ge=1),
    "tasks_per_call": Option(1, int, "tasks a worker takes per data-loader call and hands on per pool call "
                                     "(raise it for cheap rollouts in Ray mode, where every call crosses "
                                     "processes)", ge=1),
    "evaluator": Option(type=(dict, None), options=EVALUATOR, component="evaluator",
                        help="how a response is scored (null: no evaluator, reward 0)"),
    "domain_evaluators": Option({}, dict, "per-domain evaluators, {<domain>: {type: <evaluator>, ...}}: a task "
                                          "with a domain listed here is scored by its evaluator, others by "
                                          "rollout_worker.evaluator",
                                values=Option(type=(dict, None), options=EVALUATOR, component="evaluator",
                                              help="one domain's evaluator (null: none, reward 0)")),
}

TRAJECTORY_POOL = {
    "type": Option(removed="nexrl has one trajectory pool; delete trajectory_pool.type"),
    "batch_size": Option(16, int, "trajectories per training step", ge=1),
    "group_size": Option(4, int, "samples per prompt (a GRPO group)", ge=1),
    "key_list": Option(["uid"], list[str], "trajectory keys that group samples (empty: no grouping)"),
    "check_batch_ready_function": Option("batch_size", str, "when a batch is ready",
                                         choices=BATCH_READY_FUNCTIONS),
    "dynamic_sampling": Option(options={
        "enabled": Option(False, bool, "drop finished groups whose rewards are all equal and draw a fresh row "
                                       "in their place"),
        "max_replacements": Option(3, int, "drops in a row for one batch slot before a flat group is kept", ge=0,
                                   needs=".enabled"),
    }, help="dynamic sampling (DAPO): train only on groups with a reward signal"),
}

TRAINER = {
    "type": Option(REQUIRED, str, "registered trainer (nexrl plugins lists them; mock: a stand-in that trains "
                                  "nothing, for trying the plumbing)"),
    "total_train_steps": Option(10, int, "training steps of the run (replaced by what num_train_epochs gives "
                                         "when that is set)", ge=1),
    "num_train_epochs": Option(None, (float, None), "passes over the training data instead of a step count: "
                                                    "total_train_steps becomes ceil(epochs x data rows / prompts "
                                                    "per step), prompts per step = trajectory_pool.batch_size / "
                                                    "group_size (null: total_train_steps decides)", gt=0),
    "checkpoint_path": Option("${run_dir}/checkpoints", (str, None), "folder of global_step_<N> checkpoints"),
    "save_freq": Option(0, int, "checkpoint every N steps and after the last one (0: only what save_final and "
                                "save_on_stop say)", ge=0),
    "save_final": Option(True, bool, "checkpoint after the last step even with save_freq 0: the trained weights "
                                     "for nexrl export and a run that trains on (false: keep them only when "
                                     "save_freq says so)"),
    "remove_previous_ckpt": Option(False, bool, "keep only the newest checkpoint",
                                   needs="trainer.save_freq > 0 or trainer.save_final or trainer.save_on_stop"),
    "save_on_stop": Option(False, bool, "checkpoint when stopped by a signal"),
}

WEIGHT = {
    "type": Option(removed="the weight-sync backend is chosen with weight.backend; delete weight.type"),
    "backend": Option("version_only", str, "registered weight-sync backend: how new weights reach the "
                                           "inference service"),
    "sync_mode": Option("sync", str, "sync | batch-async | fully-async", choices=SYNC_MODES),
    "staleness_threshold": Option(0, int, "max weight versions a trained sample may lag (async modes)", ge=0,
                                  needs="weight.sync_mode != sync"),
    "validate_freq": Option(0, int, "validate every N steps (0: never; needs validate.data)", ge=0),
    "partial_rollout": Option(False, bool, "a weight push does not wait for the requests decoding: the engine takes "
                                           "the new weights at its next decode-step boundary and each request goes "
                                           "on from the tokens it has (token_versions records which weights sampled "
                                           "each token); false: a push waits for the running batch",
                              needs="weight.sync_mode != sync"),
    "rollouts_ahead": Option(None, (int, str, None), "async modes: at most this many training rollouts started and "
                                                     "not yet taken by the trainer (decoding, or waiting in the pool); "
                                                     "'staleness' = max(staleness_threshold, 1) x trajectory_pool."
                                                     "batch_size: the engine generates the next batches while the "
                                                     "trainer steps, and none that would come out too stale to train; "
                                                     "null: no bound (what comes out too stale is re-rolled)",
                             check=_rollouts_ahead, needs="weight.sync_mode != sync"),
    "model_update_frequency": Option(1, int, "push the trained weights to the inference service every N steps "
                                             "(and before a validation); N > 1 needs an async sync_mode with "
                                             "staleness_threshold >= N", ge=1),
    "verify_served": Option("auto", (bool, str), "after each push, the served model and the trainer score a fixed probe "
                                         "(weight/served_probe_gap): auto stops the run when the served log-probs "
                                         "did not change though the trainer's moved beyond the tolerance (the "
                                         "weights never arrived) and warns on any other gap beyond it; true stops "
                                         "on any gap beyond it, and when either side cannot score; false: no probe",
                            choices=("auto", True, False)),
    "served_probe_tolerance": Option(1e-3, float, "largest gap (max |log-prob difference| over the probe's tokens) "
                                                  "between the served model and the trainer that counts as serving "
                                                  "the trainer's weights", gt=0),
    "rollout_limit": Option("batch", (int, str, None), "sync mode: rollouts started per weight version; 'batch' = "
                                                       "trajectory_pool.batch_size (none wasted, runs reproducible); "
                                                       "N or null (until a batch is ready) start extras, which are "
                                                       "waited for and re-rolled",
                            check=_rollout_limit, needs="weight.sync_mode == sync"),
}

INFERENCE_SERVICE = {
    "backend": Option(REQUIRED, str, "registered inference backend (nexrl plugins lists them; mock: canned answers, "
                                     "for trying the plumbing)"),
    "model_tag": Option("default", str, "name of this inference service inside nexrl"),
}

SERVICE = {
    "train_service": Option({}, dict, "the train service the trainer drives: backend (a registered train service) "
                                      "and that service's own keys"),
    "inference_service": Option(options=INFERENCE_SERVICE, component="inference_backend", selector="backend",
                                help="the inference service rollouts sample from"),
    "reference_service": Option(None, (dict, None), "the KL reference on an inference service of its own (null: the "
                                                    "trainer holds a frozen copy of the initial model): backend and "
                                                    "its keys, as service.inference_service; it only scores the "
                                                    "rollouts' tokens and never receives weights",
                                options=INFERENCE_SERVICE, component="inference_backend", selector="backend"),
}

VALIDATE = {
    "validate_before_train": Option(False, bool, "validate the initial weights (needs validate.data)"),
    "n_samples": Option(1, int, "samples per validation prompt", ge=1, needs="validate.data"),
    "success_threshold": Option(1.0, float, "reward counted as correct (val/success_rate, pass@k)",
                                needs="validate.data"),
    "data": Option(None, (dict, None), "the validation set (a data loader mapping)", options=VALIDATE_DATA,
                   component="dataloader"),
    "eval": Option(removed="validation metrics are always computed by nexrl_core.runtime.eval_core; delete validate.eval"),
}

RESUME = {
    "mode": Option("disable", str, "disable: a fresh run | auto: newest checkpoint if any | from_path",
                   choices=RESUME_MODES),
    "resume_path": Option(None, str, "global_step_<N> folder for mode from_path", needs="resume.mode == from_path"),
    "on_failure": Option("stop", str, "a run a failed module stops (error policy, health check, trainer error, a "
                                      "lost Ray actor): stop (exit 1) | restart (nexrl run starts it again from the "
                                      "newest checkpoint, as resume.mode=auto)", choices=ON_FAILURE),
    "max_restarts": Option(3, int, "restarts at most, over the run's life (then it stops with exit 1)", ge=0,
                           needs="resume.on_failure == restart"),
    "restart_backoff": Option(10.0, float, "seconds before the first restart, doubled before each next one", ge=0,
                              needs="resume.on_failure == restart"),
    "restart_backoff_max": Option(300.0, float, "the longest wait before a restart", ge=0,
                                  needs="resume.on_failure == restart"),
}

PROGRESS_MODES = ("auto", "rich", "plain", "off")

LOGGER = {
    "backend": Option(["console"], (str, list[str]), "experiment loggers (registered metrics sinks): console, "
                                                     "wandb, tensorboard"),
    "level": Option("INFO", str, "console log level (run.log is always DEBUG)", choices=LOG_LEVELS),
    "progress": Option("auto", str, "nexrl run's progress display on stderr: rich (live, for a terminal), plain "
                                    "(one line per step), auto (rich on a terminal, else plain), off",
                       choices=PROGRESS_MODES, check=progress_problem),
    "samples_every": Option(10, int, "every N training steps, and at the first and the last, write some of "
                                     "the step's generations to samples.jsonl (0: never)", ge=0),
    "samples_per_step": Option(4, int, "generations written per such step, spread over the batch", ge=1,
                               needs="logger.samples_every > 0"),
}

RUNTIME_MONITOR = {
    "stop_timeout": Option(30.0, float, "seconds to wait for modules to stop", ge=0),
    "health_check": Option(options={
        "enabled": Option(True, bool, "stop when a module stops answering"),
        "check_interval": Option(30.0, float, "seconds between health checks", gt=0, needs=".enabled"),
        "timeout": Option(5.0, float, "seconds a module may take to answer", gt=0, needs=".enabled"),
        "grace_period": Option(0.0, float, "seconds a module may stay unhealthy", ge=0, needs=".enabled"),
    }, help="liveness of modules and the inference service"),
    "exception_handling": Option(options={
        "enabled": Option(True, bool, "apply the error policy"),
        "check_interval": Option(1.0, float, "seconds between error checks", gt=0, needs=".enabled"),
        "policy": Option("stop_on_error", str, "which reported errors stop the run", choices=ERROR_POLICIES,
                         needs=".enabled"),
    }, help="errors reported by modules"),
    "failed_samples": Option(options={
        "enabled": Option(True, bool, "stop a run whose training samples mostly fail"),
        "max_fraction": Option(0.5, float, "stop when more than this fraction of the recent training samples "
                                           "failed", ge=0, le=1, needs=".enabled"),
        "window": Option(64, int, "how many recent training samples the fraction is taken over", ge=1,
                         needs=".enabled"),
    }, help="failed samples (rollout or evaluator errors) among those the trainer consumed"),
}

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


RAY_RESOURCES = {
    "num_cpus": Option(None, float, "CPUs reserved", ge=0),
    "num_gpus": Option(None, float, "GPUs reserved (fractions share one)", ge=0),
    "memory": Option(None, float, "bytes of memory reserved", ge=0),
    "resources": Option(None, dict, "custom resources: name -> amount", check=_custom_resources),
}

RAY = {
    "address": Option(None, str, "a running cluster to attach to ('auto', 'host:6379', 'ray://host:10001'); null: "
                                 "$RAY_ADDRESS, else a local cluster started and stopped by the run"),
    "private_network": Option(False, bool, "local cluster (on loopback only either way): nexrl run runs itself "
                                           "and the cluster in a network namespace with only loopback, so no "
                                           "other process of the machine reaches its ports; the run then reaches "
                                           "no network (Linux)"),
    "num_cpus": Option(None, float, "local cluster: CPUs it offers (null: the machine's)", ge=0),
    "num_gpus": Option(None, float, "local cluster: GPUs it offers (null: those found)", ge=0),
    "object_store_memory": Option(None, int, "local cluster: bytes of its object store (null: Ray's default)", ge=1),
    "call_timeout": Option(300.0, (float, None), "seconds a call to an actor may take (null: no limit); calls that "
                                                 "last as long as their work (model load, checkpoint, weight push, "
                                                 "stop) are not limited", gt=0),
    "placement_timeout": Option(300.0, (float, None), "seconds an actor may wait for a node with the resources it "
                                                      "asks for (ray.resources) and for its process to start; then "
                                                      "the run fails naming it and what the nodes have (null: no "
                                                      "limit, e.g. for an autoscaler that adds nodes slowly)", gt=0),
    "max_concurrency": Option(None, int, "calls one actor serves at once (null: one per rollout worker + 32)", ge=1),
    "colocation": Option(options={
        role.value: Option(group, (str, None), f"co-location group of the {role.value.replace('_', ' ')}",
                           check=_group_name)
        for role, group in RAY_COLOCATION.items()
    }, check=_worker_group_alone, help="role -> group: the roles of one group share one actor (null: an actor of "
                                       "its own)"),
    "resources": Option({}, dict, "role -> what its actor reserves (rollout workers: per actor; an actor hosting "
                                  "several roles reserves the sum)",
                        options={role.value: Option(None, (dict, None), f"resources of the "
                                                    f"{role.value.replace('_', ' ')}", options=RAY_RESOURCES)
                                 for role in NexRLRole}),
    "env_vars": Option({}, dict[str, str | int | float | bool], "extra environment of every actor (NEXRL_*, HF_*, "
                                                                "TRANSFORMERS_* ... are passed on already)"),
}

CORE_OPTIONS: dict[str, Option] = {
    "launch_mode": Option("local", str, "where the modules run (local: threads in one process; ray: Ray actors, "
                                        "see the ray section)", check=_launch_mode),
    "project_name": Option("nexrl", str, "project name (experiment loggers)"),
    "experiment_name": Option("run", str, "experiment name (experiment loggers, default run_dir)"),
    "run_dir": Option("runs/${experiment_name}", str, "where metrics.jsonl, errors.jsonl and run.log go"),
    "overwrite_run_dir": Option(False, bool, "a fresh run into a run_dir that holds an earlier run moves the "
                                             "earlier run aside to <run_dir>.old-<time> (never appends)"),
    "seed": Option(42, int, "seed of every random choice of the run"),
    "data": Option(options=DATA, component="dataloader", help="the training data loader"),
    "rollout_worker": Option(options=ROLLOUT_WORKER, component="rollout_worker", help="rollout workers"),
    "trajectory_pool": Option(options=TRAJECTORY_POOL, help="how trajectories are grouped into batches"),
    "trainer": Option(options=TRAINER, component="trainer", help="the trainer"),
    "algorithm": Option({}, dict, "the RL algorithm (keys declared by the trainer)"),
    "weight": Option(options=WEIGHT, component="weight_sync_backend", selector="backend",
                     help="weight synchronisation between trainer and inference service"),
    "service": Option(options=SERVICE, help="train and inference services"),
    "validate": Option(options=VALIDATE, help="validation"),
    "resume": Option(options=RESUME, help="resuming from checkpoints"),
    "logger": Option(options=LOGGER, help="logging and experiment loggers"),
    "runtime_monitor": Option(options=RUNTIME_MONITOR, help="health, errors and failed samples"),
    "ray": Option(options=RAY, help="launch_mode ray: the cluster, placement and resources of the actors "
                                    "(pip install 'nexrl-core[ray]')"),
    "recipe_dir": Option(None, str, "set by nexrl: the recipe file's folder (${recipe_dir}/data.jsonl names a file "
                                    "next to the recipe)"),
}


def core_defaults() -> dict[str, Any]:
    """The mapping every recipe is merged onto."""
    out = option_defaults(CORE_OPTIONS)
    out.pop("recipe_dir", None)
    return out
