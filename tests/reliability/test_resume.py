"""Exact resume, reproducible runs and atomic checkpoints, through `nexrl run` subprocesses on the
tiny Llama.

One recipe (self-hosted GRPO, in-process HF engine and weight sync, sync mode, a checkpoint
every step, validation before training and every 2 steps) is run once without interruption (the
reference), with one rollout worker and with eight. Every other run of it, interrupted and
resumed or not, must end with the reference's exact final checkpoint (every tensor of every
safetensors file: model, optimizer, RNG) and the reference's metrics.jsonl rows (timing/*
aside). With eight workers, thread timing decides which worker runs which task, in which order
rollouts finish and which requests the engine batches together: none of it may show
(docs/reliability.md, "Reproducibility").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nexrl_core.builtins.mock import MockTrainer
from nexrl_core.checkpoint import CORE_STATE_FILE, find_latest_checkpoint
from nexrl_core.testing import write_recipe
from tests.reliability.helpers import STEPS, Run, grpo_recipe, metrics_rows, run_to_end

pytestmark = pytest.mark.timeout(600)


WORKERS = "rollout_worker.num_workers=8"


def _reference_run(model_dir: str, env: dict[str, str], root: Path, *overrides: str) -> Path:
    recipe = write_recipe(grpo_recipe(root / "run", model_dir), root / "recipe.yaml")
    run = Run(recipe, list(overrides), env, root / "out.log")
    assert run.wait() == 0, run.output()[-4000:]
    rows = metrics_rows(root / "run")
    assert [r["step"] for r in rows if "train/reward_mean" in r] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if "val/reward" in r] == [0, 2, 4]
    assert any(r.get("train/grad_norm", 0) > 0 for r in rows)  # the weights really move
    return root / "run"


@pytest.fixture(scope="module")
def reference(tiny_model_dir, plugin_env, tmp_path_factory) -> Path:
    return _reference_run(tiny_model_dir, plugin_env, tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def reference8(reference, tiny_model_dir, plugin_env, tmp_path_factory) -> Path:
    """The same recipe with eight rollout workers: it trains exactly what one worker trains (a
    request's tokens and logprobs do not depend on the requests batched with it, and the batch is
    in issue order)."""
    run_dir = _reference_run(tiny_model_dir, plugin_env, tmp_path_factory.mktemp("reference8"), WORKERS)
    assert_same_as_reference(run_dir, reference)
    return run_dir


@pytest.fixture
def recipe(tiny_model_dir, tmp_path) -> str:
    return write_recipe(grpo_recipe(tmp_path / "run", tiny_model_dir), tmp_path / "recipe.yaml")


def _complete(ckpt_dir: Path, step: int):
    return lambda: (ckpt_dir / f"global_step_{step}" / CORE_STATE_FILE).exists()


def assert_same_as_reference(run_dir: Path, reference: Path, counters_and_position: bool = True) -> None:
    import torch
    from safetensors.torch import load_file

    if counters_and_position:
        assert metrics_rows(run_dir) == metrics_rows(reference)
    else:
        def trained(rows):
            return [{k: v for k, v in r.items() if not k.startswith("pool/")} for r in rows]
        assert trained(metrics_rows(run_dir)) == trained(metrics_rows(reference))
    final, ref = run_dir / "checkpoints" / f"global_step_{STEPS}", reference / "checkpoints" / f"global_step_{STEPS}"
    files = sorted(p.name for p in ref.glob("*.safetensors"))
    assert {"model.safetensors", "optimizer.safetensors", "rng.safetensors"} <= set(files)
    for name in files:
        mine, theirs = load_file(str(final / name)), load_file(str(ref / name))
        assert mine.keys() == theirs.keys(), name
        different = [k for k in theirs if not torch.equal(mine[k], theirs[k])]
        assert not different, f"{name}: tensors differ from the uninterrupted run: {different[:5]}"
    mine_state = json.loads((final / CORE_STATE_FILE).read_text())
    theirs_state = json.loads((ref / CORE_STATE_FILE).read_text())
    if not counters_and_position:
        for state in (mine_state, theirs_state):
            del state["dataloader"], state["trajectory_pool"]
    assert mine_state == theirs_state
    assert not (run_dir / "errors.jsonl").exists() and not (reference / "errors.jsonl").exists()


def test_sigkill_after_a_checkpoint_then_auto_resume_is_bit_exact(reference, recipe, start_run, tmp_path):
    """Killed right after step 2's checkpoint (a validation step: its validation is re-run on
    resume); remove_previous_ckpt keeps only the newest checkpoint."""
    ckpt = tmp_path / "run" / "checkpoints"
    first = start_run(recipe, "trainer.remove_previous_ckpt=true")
    first.wait_for(_complete(ckpt, 2))
    first.kill()
    assert find_latest_checkpoint(str(ckpt)) is not None

    resumed = run_to_end(start_run, recipe, "trainer.remove_previous_ckpt=true", "resume.mode=auto")
    assert "resumed from" in resumed.output()
    assert_same_as_reference(tmp_path / "run", reference)
    assert sorted(os.listdir(ckpt)) == [f"global_step_{STEPS}"]  # only the newest, no temporary folders


def test_two_runs_with_eight_rollout_workers_are_bit_identical(reference8, recipe, start_run, tmp_path):
    run_to_end(start_run, recipe, WORKERS)
    assert_same_as_reference(tmp_path / "run", reference8)


def test_extra_rollouts_do_not_change_what_is_trained(reference8, recipe, start_run, tmp_path):
    """weight.rollout_limit: null starts rollouts until a batch is ready, so a timing-dependent
    number of extras run; the batch is still the earliest-issued groups and the extras are
    re-rolled, so the weights are the same. Only the pool's re-roll counter and the loader's
    position (how far the extras read ahead) may differ."""
    run_to_end(start_run, recipe, WORKERS, "weight.rollout_limit=null")
    assert_same_as_reference(tmp_path / "run", reference8, counters_and_position=False)


def test_sigkill_with_eight_rollout_workers_then_auto_resume_is_bit_exact(reference8, recipe, start_run, tmp_path):
    """Killed as soon as step 1's checkpoint is complete (the weight push and step 2's rollouts are
    starting) and resumed; that run killed as soon as step 4's metrics are written (its checkpoint
    may or may not be complete; the save, the push, a validation and step 5's rollouts follow) and
    resumed again."""
    run_dir = tmp_path / "run"
    first = start_run(recipe, WORKERS)
    first.wait_for(_complete(run_dir / "checkpoints", 1))
    first.kill()
    second = start_run(recipe, WORKERS, "resume.mode=auto")
    second.wait_for(lambda: sum("train/reward_mean" in r for r in _rows_if_any(run_dir)) >= 4)
    second.kill()
    assert "resumed from" in second.output()
    resumed = run_to_end(start_run, recipe, WORKERS, "resume.mode=auto")
    assert "resumed from" in resumed.output()
    assert_same_as_reference(run_dir, reference8)


BF16 = ("+service.train_service.dtype=bfloat16", "+service.inference_service.dtype=bfloat16")


def test_bf16_run_resumes_bit_exact_and_its_checkpoint_loads_with_transformers(
        reference, tiny_model_dir, plugin_env, recipe, start_run, tmp_path, tmp_path_factory):
    """Mixed-precision training (float32 masters) with a bf16 engine: killed after step 2's
    checkpoint and resumed, it ends with the uninterrupted bf16 run's exact checkpoint, which
    transformers loads as a float32 model; and it is not the float32 run."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    bf16_reference = _reference_run(tiny_model_dir, plugin_env, tmp_path_factory.mktemp("reference_bf16"), *BF16)
    final = bf16_reference / "checkpoints" / f"global_step_{STEPS}"
    weights = load_file(str(final / "model.safetensors"))
    float32_weights = load_file(str(reference / "checkpoints" / f"global_step_{STEPS}" / "model.safetensors"))
    assert any(not torch.equal(weights[k], float32_weights[k]) for k in weights)
    model = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())

    ckpt = tmp_path / "run" / "checkpoints"
    first = start_run(recipe, *BF16)
    first.wait_for(_complete(ckpt, 2))
    first.kill()
    resumed = run_to_end(start_run, recipe, *BF16, "resume.mode=auto")
    assert "resumed from" in resumed.output()
    assert_same_as_reference(tmp_path / "run", bf16_reference)


def _rows_if_any(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return rows


def test_crash_while_saving_never_leaves_a_checkpoint_auto_picks_and_from_path_resumes_an_older_one(
        reference, recipe, start_run, tmp_path):
    """SIGKILL in the middle of writing step 3's checkpoint (model files written, state not): only a
    .tmp_global_step_* folder is left, `auto` resumes from step 2 and the next save removes the
    leftovers. That run killed after step 4, then resumed from step 2 by path: steps 3 and 4 are
    trained again and their checkpoints replaced, metrics rows after step 2 are dropped and written
    again. The run still ends exactly like the uninterrupted one."""
    ckpt = tmp_path / "run" / "checkpoints"
    crashing = start_run(recipe, "trainer.type=crash_on_save_grpo", "+trainer.crash_save_step=3")
    assert crashing.wait() == -9, crashing.output()[-4000:]
    names = sorted(os.listdir(ckpt))
    assert [n for n in names if not n.startswith(".")] == ["global_step_1", "global_step_2"], names
    leftovers = [n for n in names if n.startswith(".")]
    assert leftovers and all(n.lstrip(".").startswith("tmp_global_step_3_") for n in leftovers), names
    assert any((ckpt / n / "model.safetensors").exists() for n in leftovers)  # it died mid-save, not before
    assert find_latest_checkpoint(str(ckpt)) == str(ckpt / "global_step_2")

    auto = start_run(recipe, "resume.mode=auto")
    auto.wait_for(_complete(ckpt, 4))
    auto.kill()
    assert f"resumed from {ckpt / 'global_step_2'} at step 2" in auto.output()
    assert "removed incomplete checkpoint folders" in auto.output()
    assert not [n for n in os.listdir(ckpt) if n.lstrip(".").startswith("tmp_global_step_3_")]

    resumed = run_to_end(start_run, recipe, "resume.mode=from_path", f"resume.resume_path={ckpt / 'global_step_2'}")
    assert f"resumed from {ckpt / 'global_step_2'} at step 2" in resumed.output()
    assert sorted(os.listdir(ckpt)) == [f"global_step_{s}" for s in range(1, STEPS + 1)]
    assert_same_as_reference(tmp_path / "run", reference)


# -- atomic saves, in process (the mock trainer: no torch) -----------------------------------------

class FlakySaveTrainer(MockTrainer):
    """Writes a model file, then raises when ``fail`` is set (a full disk, a bug in a plugin)."""

    fail = False

    def save_model_state(self, folder: str) -> None:
        Path(folder, "model.safetensors").write_bytes(b"half a model")
        if self.fail:
            raise OSError("No space left on device")


def _bare_trainer(ckpt: Path) -> FlakySaveTrainer:
    return FlakySaveTrainer(OmegaConf.create({"trainer": {"checkpoint_path": str(ckpt), "total_train_steps": 10},
                                              "trajectory_pool": {"batch_size": 1}}))


def test_a_save_that_raises_leaves_nothing_auto_could_pick(tmp_path):
    ckpt = tmp_path / "ckpt"
    trainer = _bare_trainer(ckpt)
    trainer.global_step = 1
    trainer.save_checkpoint()
    trainer.global_step, trainer.fail = 2, True
    with pytest.raises(OSError, match="No space left"):
        trainer.save_checkpoint()
    assert os.listdir(ckpt) == ["global_step_1"]  # its temporary folder is gone too
    assert find_latest_checkpoint(str(ckpt)) == str(ckpt / "global_step_1")


def test_leftover_tmp_folders_are_ignored_by_auto_and_removed_by_the_next_save(tmp_path):
    ckpt = tmp_path / "ckpt"
    trainer = _bare_trainer(ckpt)
    trainer.global_step = 1
    trainer.save_checkpoint()
    # what crashed saves leave: our temporary folder (even one holding a state file), the train
    # service's scratch folder, and a global_step folder without its state file
    for name in (".tmp_global_step_5_4242", "..tmp_global_step_5_4242.x1y2", "global_step_9"):
        (ckpt / name).mkdir()
        (ckpt / name / "model.safetensors").write_bytes(b"partial")
    (ckpt / ".tmp_global_step_5_4242" / CORE_STATE_FILE).write_text(json.dumps({"global_step": 5}))
    assert find_latest_checkpoint(str(ckpt)) == str(ckpt / "global_step_1")

    trainer.global_step = 2
    trainer.save_checkpoint()
    assert sorted(os.listdir(ckpt)) == ["global_step_1", "global_step_2", "global_step_9"]
    assert find_latest_checkpoint(str(ckpt)) == str(ckpt / "global_step_2")
    trainer.save_checkpoint()  # the same step again (a resume from an older checkpoint): replaced whole
    assert sorted(os.listdir(ckpt)) == ["global_step_1", "global_step_2", "global_step_9"]
    assert json.loads((ckpt / "global_step_2" / CORE_STATE_FILE).read_text())["global_step"] == 2
