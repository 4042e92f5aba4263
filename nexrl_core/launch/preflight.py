"""What a run builds from its recipe before it starts, shared by ``nexrl validate`` and the
controller so both decide every input with the same code: the data loaders (which read every
data file), the evaluator, the run directory and the resume state.
"""

from __future__ import annotations

import math
import os
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from ..checkpoint import CORE_STATE_FILE, find_latest_checkpoint, is_checkpoint, read_core_state
from ..errors import ConfigError, NexRLError
from ..runtime.run_log import _inside, earlier_run, writable_dir_problem

DATA_SECTIONS = ("data", "validate.data")


def dataloader_config(cfg: DictConfig, which: str) -> DictConfig | None:
    """What the data loader of ``data`` or ``validate.data`` is built with (None: no such section)."""
    section = OmegaConf.select(cfg, which, default=None)
    if section is None:
        return None
    is_validate = which == "validate.data"
    data = cast(DictConfig, OmegaConf.create(OmegaConf.to_container(section)))
    data.group_size = int(cfg.validate.n_samples if is_validate else cfg.trajectory_pool.group_size)
    if is_validate:
        data.shuffle = False
    else:  # groups per training batch: a loader that interleaves domains plans each batch's share
        data.batch_groups = max(1, int(cfg.trajectory_pool.batch_size) // max(1, int(data.group_size)))
    return data


def build_dataloader(cfg: DictConfig, pm: Any, which: str) -> Any:
    """The data loader of ``data`` or ``validate.data``, built as the run builds it; its
    constructor reads the data, so a bad file fails here with ``file:line``."""
    from ..plugins import use_plugin_manager

    data = dataloader_config(cfg, which)
    if data is None:
        return None
    cls = pm.resolve("dataloader", data.type, f"{which}.type")
    with use_plugin_manager(pm):  # a loader may build others (multi_domain's domains)
        return cls(data, is_validate=which == "validate.data")


def build_evaluator(cfg: DictConfig, pm: Any) -> Any:
    """The evaluator of ``rollout_worker.evaluator`` (and those of ``rollout_worker.domain_evaluators``,
    built and dropped), as each rollout worker builds them."""
    from .parts import build_domain_evaluators
    from .parts import build_evaluator as build

    evaluator = build(cfg.rollout_worker.get("evaluator"), pm)
    build_domain_evaluators(cfg.rollout_worker.get("domain_evaluators"), pm)
    return evaluator


def records_config(cfg: DictConfig, out: str | None) -> DictConfig:
    """The recipe as ``nexrl eval``'s records see it: files in ``out`` (None: none), no sinks."""
    records = cast(DictConfig, OmegaConf.create(OmegaConf.to_container(cfg)))
    records.run_dir = out
    records.logger.backend = []
    return records


def check_files(cfg: DictConfig, pm: Any, eval_only: bool = False) -> list[str]:
    """Problems a recipe with sound keys can still have: the run directory, the resume
    checkpoint, every data file (the loaders are built and dropped), the evaluator's options.
    Sets the steps ``trainer.num_train_epochs`` gives (:func:`apply_num_train_epochs`)."""
    problems = [] if eval_only else run_dir_problems(cfg) + resume_problems(cfg, pm)
    for which in DATA_SECTIONS:
        if eval_only and which == "data":
            continue
        try:
            loader = build_dataloader(cfg, pm, which)
            if which == "data":
                apply_num_train_epochs(cfg, pm, loader)
        except NexRLError as exc:
            problems.append(str(exc))
    try:
        build_evaluator(cfg, pm)
    except NexRLError as exc:
        problems.append(str(exc))
    return problems


def train_on_override(cfg: DictConfig) -> str:
    """The override that trains a finished run as long again: twice the epochs when
    ``trainer.num_train_epochs`` sets the steps, else twice the steps."""
    epochs = cfg.trainer.get("num_train_epochs")
    if epochs is not None:
        return f"trainer.num_train_epochs={2 * float(epochs):g}"
    return f"trainer.total_train_steps={2 * int(cfg.trainer.total_train_steps)}"


def component_notes(cfg: DictConfig, pm: Any) -> list[str]:
    """What the inference backend says about the recipe before it is built (its
    ``recipe_notes(section)``, optional): ``nexrl validate`` and ``nexrl run`` print each as a note."""
    from .recipe import hook_lines

    section = cfg.service.inference_service
    cls = pm.resolve("inference_backend", section.backend, "service.inference_service.backend")
    return hook_lines(cls, "recipe_notes", "service.inference_service", section)  # a raise: a note too


def apply_num_train_epochs(cfg: DictConfig, pm: Any, loader: Any = None) -> str | None:
    """With ``trainer.num_train_epochs`` set: ``trainer.total_train_steps`` becomes the steps that
    many passes over the training data take (set in ``cfg``; the training loader is built unless
    given), and what was done is returned in words; None without it."""
    epochs = cfg.trainer.get("num_train_epochs")
    if epochs is None:
        return None
    rows = (loader if loader is not None else build_dataloader(cfg, pm, "data")).num_rows()
    prompts = max(1, int(cfg.trajectory_pool.batch_size) // max(1, int(cfg.trajectory_pool.group_size)))
    steps = max(1, math.ceil(float(epochs) * rows / prompts - 1e-9))  # 2 epochs of 8 rows at 4 a step: 4, not 5
    OmegaConf.update(cfg, "trainer.total_train_steps", steps)
    return (f"trainer.total_train_steps: {steps} (trainer.num_train_epochs={epochs:g} over {rows} rows of data, "
            f"{prompts} prompts a step)")


# -- run directory -------------------------------------------------------------------------------

def run_dir_problems(cfg: DictConfig) -> list[str]:
    run_dir = str(cfg.run_dir)
    problems = [p for p in (writable_dir_problem(run_dir, "run_dir"),) if p]
    ckpt = cfg.trainer.get("checkpoint_path")
    if ckpt and not (problems and _inside(str(ckpt), run_dir)):  # one message when run_dir is the cause
        problem = writable_dir_problem(str(ckpt), "trainer.checkpoint_path")
        if problem:
            problems.append(problem)
    return problems


def earlier_run_refusal(cfg: DictConfig) -> str | None:
    """Why ``nexrl run`` refuses ``run_dir`` as it is (an earlier run there, and a fresh run asked
    for), with the choices; None when it does not. A fact about this machine, not about the recipe:
    ``nexrl run`` stops on it, ``nexrl validate`` says it as a note (:func:`run_dir_plan`)."""
    if cfg.resume.mode != "disable" or cfg.get("overwrite_run_dir"):
        return None
    run_dir = str(cfg.run_dir)
    ckpt = cfg.trainer.get("checkpoint_path")
    found = earlier_run(run_dir, str(ckpt) if ckpt else None)
    if not found:
        return None
    return (f"run_dir: '{run_dir}' holds an earlier run ({found}) and resume.mode is 'disable'. "
            f"Choose: resume.mode=auto to continue it, another run_dir, or overwrite_run_dir=true "
            f"to move the earlier run aside (to '{run_dir}.old-<time>')"
            + _finished_note(cfg, str(ckpt) if ckpt else None))


def _finished_note(cfg: DictConfig, checkpoint_path: str | None) -> str:
    """``. It finished ...`` when the newest checkpoint is at trainer.total_train_steps, else ''."""
    latest = find_latest_checkpoint(checkpoint_path) if checkpoint_path else None
    try:
        step = int(read_core_state(latest)["global_step"]) if latest else None
    except NexRLError:
        return ""
    total = int(cfg.trainer.total_train_steps)
    if step is None or step < total:
        return ""
    return (f". It finished (step {step} of trainer.total_train_steps={total}): resume.mode=auto trains on only "
            f"with more steps, e.g. {train_on_override(cfg)}")


#: a run this long that keeps no checkpoint is warned about (minutes of training lost when it ends)
UNKEPT_RUN_WARN_STEPS = 10


def keeps_no_checkpoint(cfg: DictConfig) -> bool:
    """No checkpoint is due in the whole run (a signal may still save one: trainer.save_on_stop)."""
    return not int(cfg.trainer.save_freq) and not cfg.trainer.save_final


def unkept_weights_warning(cfg: DictConfig, pm: Any) -> str | None:
    """What ``nexrl validate`` and ``nexrl run`` warn when a run of a trainer with weights keeps
    none of them (``save_final: false`` and ``save_freq: 0``) for ``UNKEPT_RUN_WARN_STEPS`` steps or more."""
    steps = int(cfg.trainer.total_train_steps)
    if not keeps_no_checkpoint(cfg) or steps < UNKEPT_RUN_WARN_STEPS:
        return None
    cls = getattr(pm.components("trainer").get(str(cfg.trainer.type)), "cls", None)
    if cls is None or getattr(cls, "NO_MODEL_STATE", False):
        return None
    return (f"trainer.save_final: false and trainer.save_freq: 0: this run of {steps} steps keeps no checkpoint, "
            f"so its trained weights are gone when it ends (nothing to export or to train on from); "
            f"drop save_final: false, or set trainer.save_freq")


def run_dir_plan(cfg: DictConfig) -> str | None:
    """What ``nexrl run`` will do with an earlier run in ``run_dir`` (resume, train nothing more, or
    start anew over it) and how to choose otherwise, in words; None for a fresh run_dir. For a
    recipe whose keys and files are sound (``nexrl validate`` prints it as a note, a refusal of
    :func:`earlier_run_refusal` included; an unwritable run_dir is a problem of :func:`run_dir_problems`)."""
    run_dir = str(cfg.run_dir)
    ckpt = cfg.trainer.get("checkpoint_path")
    found = earlier_run(run_dir, str(ckpt) if ckpt else None)
    mode = cfg.resume.mode
    if mode == "disable":
        if found and cfg.get("overwrite_run_dir"):
            return (f"run_dir '{run_dir}' holds an earlier run ({found}): nexrl run moves it aside to "
                    f"'{run_dir}.old-<time>' (overwrite_run_dir) and starts at step 0; resume.mode=auto "
                    f"continues it instead")
        refusal = earlier_run_refusal(cfg)
        return f"nexrl run will refuse it as it is: {refusal}" if refusal else None
    try:
        path = resume_checkpoint(cfg)
        step = int(read_core_state(path)["global_step"]) if path else None
    except NexRLError:
        return None  # a problem, reported by resume_problems
    total = int(cfg.trainer.total_train_steps)
    anew = "resume.mode=disable overwrite_run_dir=true starts anew (the earlier run is moved aside)"
    if path is None:
        if not found:
            return None
        return (f"run_dir '{run_dir}' holds an earlier run ({found}) but no checkpoint: nexrl run starts at "
                f"step 0 and replaces its records (resume.mode={mode})")
    if step is not None and step >= total:
        return (f"run_dir '{run_dir}' holds a finished run ({path}, step {step} of trainer.total_train_steps="
                f"{total}): nexrl run resumes from it (resume.mode={mode}) and trains no further step; "
                f"{train_on_override(cfg)} trains on, {anew}, or give another run_dir")
    return (f"nexrl run resumes from {path} at step {step} of {total} (resume.mode={mode}); {anew}, or give "
            f"another run_dir")


# -- resume state --------------------------------------------------------------------------------

def resume_checkpoint(cfg: DictConfig) -> str | None:
    """The checkpoint a run resumes from (None: a fresh start). Raises ConfigError when
    ``from_path`` names something that is not a complete checkpoint."""
    mode = cfg.resume.mode
    if mode == "disable":
        return None
    if mode == "from_path":
        path = str(cfg.resume.resume_path)
        if not is_checkpoint(path):
            raise ConfigError(f"resume.resume_path: '{path}' is not a complete checkpoint folder "
                              f"(expected global_step_<N>/ with {CORE_STATE_FILE})")
        return path
    root = cfg.trainer.get("checkpoint_path")
    return find_latest_checkpoint(str(root)) if root else None


def resume_problems(cfg: DictConfig, pm: Any = None) -> list[str]:
    """Why the checkpoint ``resume`` picks cannot be resumed exactly (empty: it can, or there is none)."""
    try:
        path = resume_checkpoint(cfg)
        if path is None:
            return []
        state = read_core_state(path)
    except NexRLError as exc:
        return [str(exc)]
    trainer = str(cfg.trainer.type)
    key = "resume.resume_path" if cfg.resume.mode == "from_path" else "resume.mode"
    trainers = pm.components("trainer") if pm is not None else {}
    cls = getattr(trainers.get(trainer), "cls", None)
    saved_by = state.get("trainer")
    saved_cls = getattr(trainers.get(str(saved_by)), "cls", None)
    if cls is not None and saved_cls is not None and not (issubclass(cls, saved_cls) or issubclass(saved_cls, cls)):
        # a subclass saves and loads its base's state: those resume each other
        return [f"{key}: the checkpoint {path} was written by trainer '{saved_by}', and this recipe's trainer.type is "
                f"'{trainer}': its state would not be restored"]
    if cls is None or getattr(cls, "NO_MODEL_STATE", False):
        return []
    from ..trainer import BaseTrainer

    fresh = ("so a resumed run would go on from fresh weights, not the checkpoint's; start a fresh run "
             "(resume.mode=disable with another run_dir, or overwrite_run_dir=true)")
    if not [name for name in os.listdir(path) if name != CORE_STATE_FILE]:
        return [f"{key}: the checkpoint {path} holds no model state (trainer '{trainer}' saved no weights: its "
                f"save_model_state wrote nothing), {fresh}"]
    if getattr(cls.load_model_state, "__func__", cls.load_model_state) is BaseTrainer.load_model_state:
        return [f"{key}: trainer '{trainer}' cannot restore the weights of the checkpoint {path} (it does not "
                f"implement load_model_state), {fresh}"]
    return []


def validate_recipe(cfg: DictConfig, pm: Any, eval_only: bool = False) -> list[str]:
    """Everything ``nexrl validate`` reports: key problems first; files once the keys are sound."""
    from .recipe import check_config

    problems = check_config(cfg, pm, eval_only=eval_only)
    if problems:
        return problems
    return check_files(cfg, pm, eval_only=eval_only)


def require_runnable(cfg: DictConfig, pm: Any, eval_only: bool = False) -> None:
    """What the controller checks before it builds anything (data files come next, when the
    loaders are built): the same functions, in the same order, as :func:`validate_recipe`, and
    the earlier run in ``run_dir`` that ``nexrl validate`` only notes."""
    from .recipe import RecipeProblems, require_valid

    require_valid(cfg, pm, eval_only=eval_only)
    if not eval_only:
        apply_num_train_epochs(cfg, pm)  # a data file it cannot read is said here, as validate says it
    refusal = None if eval_only else earlier_run_refusal(cfg)
    problems = [] if eval_only else run_dir_problems(cfg) + ([refusal] if refusal else []) + resume_problems(cfg, pm)
    if problems:
        raise RecipeProblems(problems)
