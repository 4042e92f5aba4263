"""The whole GRPO loop through the real controller, in local mode, with the installed nexrl-grpo
plugin on the tiny Llama (the session's ``tiny_model_dir``).

One run (module fixture) of a toy task the tiny model learns in a few steps: a third-party-style
evaluator, registered in process with ``PluginManager.register``, rewards the share of the
letter "e" in the reply. The run is instrumented at public seams (the engine's ``load_weights``,
the trainer's ``train``) and its outputs are checked:

- the reward rises (mean of the last steps > mean of the first steps, with a margin);
- metrics.jsonl has ``train/reward_mean``, ``train/loss`` and ``train/grad_norm`` at every step;
- after every weight sync the engine serves version == the trainer's ``global_step`` and holds
  exactly the trainer's tensors; each step trains on trajectories of the previous version;
- old log-probs are the trainer's own, taken from the update's forward (no extra pass): the
  ratio is exactly 1 (``ppo_kl`` and the clip fraction 0); the rollout-vs-trainer mismatch is
  logged every step and is numerical noise (same temperature on both sides);
- checkpoints at ``save_freq`` load with ``AutoModelForCausalLM.from_pretrained`` and hold the
  trainer's weights of that step.

Plus the CLI face of the plugin: ``nexrl plugins --json`` lists what nexrl-grpo registers, and
``nexrl validate recipes/quickstart.yaml`` passes.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import load_recipe
from tests.support.letters import grpo_plugin_manager, tiny_grpo_recipe

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
SAVE_FREQ = 3  # checkpoints at steps 3 and 6, and at the last step (8)
GROUP = 8  # tiny_grpo_recipe: one batch of 4 groups, so every step sees every prompt




def recipe(run_dir: Path, model_dir: str) -> dict:
    return tiny_grpo_recipe(run_dir, model_dir, group=GROUP, steps=STEPS, trainer={"save_freq": SAVE_FREQ},
                            algorithm={"loss_agg_mode": "seq-mean-token-mean"})


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class RunRecord:
    def __init__(self):
        self.syncs: list[dict] = []  # one per weight sync: what the engine served right after it
        self.trainer_weights: dict[int, dict[str, torch.Tensor]] = {}  # version -> trainer tensors
        self.batch_versions: list[tuple[int, set[int]]] = []  # (step being trained, versions of its data)
        self.precomputed_old_logprobs: list[bool] = []
        self.advantages: list[list[tuple]] = []  # per step: (uid, reward, recorded advantage) of each trajectory
        self.rows_untouched: list[bool] = []  # per step: the trajectories were as the pool handed them after train
        self.controller: NexRLController | None = None
        self.summary = None
        self.run_dir: Path | None = None
        self.rows: list[dict] = []


@pytest.fixture(scope="module")
def grpo_run(tiny_model_dir, tmp_path_factory) -> RunRecord:
    root = tmp_path_factory.mktemp("grpo_loop")
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(root / "run", tiny_model_dir), sort_keys=False))
    controller = NexRLController(load_recipe(str(path)), plugin_manager=grpo_plugin_manager())
    rec = RunRecord()
    rec.controller, rec.run_dir = controller, root / "run"
    engine, trainer = controller.inference_client, controller.trainer

    def after_sync():
        trainer_state = trainer.train_service.export_weights(copy=True)
        rec.trainer_weights[engine.model_version()] = trainer_state
        rec.syncs.append({"engine_version": engine.model_version(), "global_step": trainer.global_step,
                          "same_weights": _same_weights(engine.model.state_dict(), trainer_state)})

    load_weights = engine.load_weights

    def recording_load_weights(state_dict, version):  # the in-process backend's only path
        load_weights(state_dict, version)
        after_sync()

    engine.load_weights = recording_load_weights

    train, prepare = trainer.train, trainer._prepare_batch

    def recording_train(trajectories):
        rec.batch_versions.append((trainer.global_step + 1, {int(t["model_version"]) for t in trajectories}))
        before = copy.deepcopy(trajectories)
        output = train(trajectories)
        rec.rows_untouched.append(trajectories == before)
        rec.advantages.append([(t["uid"], t["reward"], output.samples[i].advantage) for i, t in enumerate(trajectories)])
        return output

    def recording_prepare(batch):
        batch, metrics = prepare(batch)
        v = batch.values
        rec.precomputed_old_logprobs.append("old_log_probs" in v)
        return batch, metrics

    trainer.train, trainer._prepare_batch = recording_train, recording_prepare
    rec.summary = controller.run()
    rec.rows = [json.loads(line) for line in (rec.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rec


def _train_rows(rec: RunRecord) -> dict[int, dict]:
    rows = [r for r in rec.rows if "train/reward_mean" in r]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, STEPS + 1)), f"one training row per step expected, got steps {steps}"
    return {r["step"]: r for r in rows}


def test_run_finishes(grpo_run):
    assert grpo_run.summary.stopped_by == "finished"
    assert grpo_run.summary.global_step == STEPS
    assert grpo_run.summary.errors == []
    assert not (grpo_run.run_dir / "errors.jsonl").exists()


def test_metrics_every_step(grpo_run):
    rows = _train_rows(grpo_run)
    for step, row in rows.items():
        for key in ("train/reward_mean", "train/loss", "train/grad_norm", "train/ppo_kl", "train/pg_clipfrac"):
            assert key in row, f"step {step}: {key} missing from metrics.jsonl"
            assert isinstance(row[key], float) and math.isfinite(row[key]), f"step {step}: {key}={row[key]!r}"
        assert row["train/num_trajectories"] == 4 * GROUP and row["train/num_failed"] == 0
        assert row["train/grad_norm"] >= 0
    # Late steps may be all flat groups (the reward saturates), the first one is not.
    assert rows[1]["train/grad_norm"] > 0


def test_reward_improves(grpo_run):
    rewards = [row["train/reward_mean"] for _, row in sorted(_train_rows(grpo_run).items())]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.15, f"reward did not rise enough over {STEPS} steps: {rewards}"


def test_engine_serves_newest_weights_after_every_sync(grpo_run):
    syncs = grpo_run.syncs
    assert [s["engine_version"] for s in syncs] == list(range(STEPS + 1)), syncs
    for s in syncs:
        assert s["engine_version"] == s["global_step"], s
        assert s["same_weights"], f"engine tensors differ from the trainer's after the sync to v{s['engine_version']}"
    # Training moved the weights: every version differs from the one before.
    versions = grpo_run.trainer_weights
    for v in range(1, STEPS + 1):
        assert not _same_weights(versions[v - 1], versions[v]), f"v{v} equals v{v - 1}"
    engine, trainer = grpo_run.controller.inference_client, grpo_run.controller.trainer
    assert engine.model_version() == trainer.global_step == STEPS
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(engine.model.state_dict()[name], trainer.train_service.model.state_dict()[name])


def test_sync_mode_trains_on_the_previous_version(grpo_run):
    assert [step for step, _ in grpo_run.batch_versions] == list(range(1, STEPS + 1))
    for step, versions in grpo_run.batch_versions:
        assert versions == {step - 1}, f"step {step} trained on versions {versions}"
    for row in _train_rows(grpo_run).values():
        assert row["train/staleness_max"] == 0


def test_on_policy_ratio_and_rollout_mismatch(grpo_run):
    assert grpo_run.precomputed_old_logprobs == [False] * STEPS  # one update per batch: no extra forward
    for step, row in _train_rows(grpo_run).items():
        assert row["train/ppo_kl"] == 0.0, f"step {step}: on-policy ppo_kl={row['train/ppo_kl']}"
        assert row["train/pg_clipfrac"] == 0.0, f"step {step}: clipping on-policy ({row['train/pg_clipfrac']})"
        # The engine (KV-cached fast decoding) and the trainer (packed forward) differ by float noise only.
        assert 0.0 <= row["train/rollout_logprob_diff_mean"] <= row["train/rollout_logprob_diff_max"] < 1e-3, row
        assert 0.0 <= row["train/rollout_kl_k3"] < 1e-6, row
        assert "train/rollout_is_weight_mean" not in row  # the correction is off by default


def test_checkpoints_load_with_transformers(grpo_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt_root = grpo_run.run_dir / "checkpoints"
    expected = [f"global_step_{s}" for s in sorted({*range(SAVE_FREQ, STEPS + 1, SAVE_FREQ), STEPS})]
    assert sorted(p.name for p in ckpt_root.iterdir() if not p.name.startswith(".")) == sorted(expected)
    for name in expected:
        folder = ckpt_root / name
        assert (folder / "model.safetensors").is_file()
        pickled = [p.name for p in folder.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt")]
        assert not pickled, f"{name} holds pickle files {pickled}"
        model = AutoModelForCausalLM.from_pretrained(str(folder))
        AutoTokenizer.from_pretrained(str(folder))
        step = int(name.rsplit("_", 1)[1])
        loaded = dict(model.state_dict())
        assert _same_weights(loaded, grpo_run.trainer_weights[step]), f"{name} does not hold the step-{step} weights"
        assert json.loads((folder / "nexrl_state.json").read_text())["global_step"] == step
        assert _modes(folder) == {"folder": 0o755, "files": {0o644}}  # like any file the user makes (umask 022)


def _modes(folder: Path) -> dict:
    """Permission bits of ``folder`` and of its files (expected values assume the usual umask 022)."""
    from nexrl_core.checkpoint import _umask

    assert _umask() == 0o022, "these expectations assume umask 022"
    return {"folder": folder.stat().st_mode & 0o777, "files": {p.stat().st_mode & 0o777 for p in folder.iterdir()}}


def test_samples_of_the_first_and_last_step_with_their_advantage(grpo_run, capsys):
    # logger.samples_every is 10 and the run has 8 steps: the first and the last step are recorded
    rows = [json.loads(line) for line in (grpo_run.run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [1, STEPS] and len(rows) == 2 * 4  # samples_per_step 4
    for r in rows:
        assert isinstance(r["advantage"], float) and r["response"] and r["prompt"]
    # each sample has its advantage: GRPO's is centred on its group and orders it as the rewards do
    assert len(grpo_run.advantages) == STEPS
    assert grpo_run.rows_untouched == [True] * STEPS  # written beside the trajectories, never into them
    for step in grpo_run.advantages:
        groups: dict[str, list[tuple[float, float]]] = {}
        for uid, reward, advantage in step:
            groups.setdefault(uid, []).append((reward, advantage))
        for members in groups.values():
            assert sum(a for _, a in members) == pytest.approx(0.0, abs=1e-4)
            by_reward = sorted(members)
            assert all(a1 <= a2 + 1e-6 for (_, a1), (_, a2) in zip(by_reward, by_reward[1:]))
    assert any(a != 0.0 for _, _, a in grpo_run.advantages[0])
    recorded = {(r["uid"], r["reward"], r["advantage"]) for r in rows if r["step"] == 1}
    assert recorded <= set(grpo_run.advantages[0])

    from nexrl_core.cli import main

    assert main(["show", str(grpo_run.run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"4 of 8 samples (step {STEPS})" in out.splitlines()[0]
    for r in rows[4:]:
        first_line = (r["response"].splitlines() or [""])[0]
        assert f"advantage {r['advantage']:+.3f}" in out and f"  reply    {first_line}".rstrip() in out


def test_report_shows_each_samples_advantage_and_its_own_logprob_gap(grpo_run, tmp_path, capsys):
    from nexrl_core.cli import main
    from tests.support.html_page import Page

    out = tmp_path / "report.html"
    assert main(["report", str(grpo_run.run_dir), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    page = Page(out.read_text(encoding="utf-8"))
    rows = [json.loads(line) for line in (grpo_run.run_dir / "samples.jsonl").read_text().splitlines()]
    header = [t for t, _ in page.tags if t == "th"]
    assert len(page.rows) == len(rows) == 8 and len(header) == 7  # the log-prob gap column: the run logs it
    gaps = {step: row["train/rollout_logprob_diff_max"] for step, row in _train_rows(grpo_run).items()}
    for (attrs, cells), row in zip(page.rows, rows):
        assert cells[3] == f"{row['advantage']:+.3f}" and float(attrs["data-reward"]) == row["reward"]
        own = row["logprob_gap"]  # the sample's own, at most its step's
        assert 0 <= own["max"] <= gaps[row["step"]] and float(attrs["data-gap"]) == own["max"]
        # float noise: not marked large
        assert cells[6] == f"{own['max']:.3g}\ntoken {own['position']} {json.dumps(own['token'])}"
    assert page.count("polyline") >= 3  # reward, its running mean, the gradient norm at least


def _nexrl_cmd() -> list[str]:
    script = Path(sys.executable).with_name("nexrl")
    return [str(script)] if script.is_file() else [shutil.which("nexrl") or "nexrl"]


def test_cli_plugins_and_validate_quickstart():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NEXRL_LOAD_PLUGINS", None)
    # Both commands import torch: start them together so they overlap.
    plugins = subprocess.Popen(_nexrl_cmd() + ["plugins", "--json"], cwd=REPO_ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    validate = subprocess.Popen(_nexrl_cmd() + ["validate", "recipes/quickstart.yaml"], cwd=REPO_ROOT, env=env,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = plugins.communicate(timeout=120)
    v_out, v_err = validate.communicate(timeout=120)

    assert plugins.returncode == 0, err
    info = json.loads(out)
    grpo = [p for p in info["plugins"] if p["distribution"] == "nexrl-grpo"]
    backend = [p for p in info["plugins"] if p["distribution"] == "nexrl-torch"]
    assert len(grpo) == 1 and len(backend) == 1, info
    assert {"self_hosted_grpo", "self_hosted_cross_entropy"} <= set(grpo[0]["components"].get("trainer", []))
    assert {"nexrl_trainers", "nexrl_policy_losses"} <= set(grpo[0]["hooks"])
    components = backend[0]["components"]
    assert components.get("train_service") == ["local_torch"]
    assert "hf" in components.get("inference_backend", [])
    assert "in_process" in components.get("weight_sync_backend", [])
    assert {"nexrl_train_services", "nexrl_inference_backends", "nexrl_weight_sync_backends"} <= set(backend[0]["hooks"])
    assert not [f for f in info["failed"] if f["distribution"] in ("nexrl-grpo", "nexrl-torch")], info["failed"]

    assert validate.returncode == 0, f"nexrl validate failed:\n{v_out}\n{v_err}"
    assert "ok" in v_out


def test_a_recipe_of_other_components_never_imports_torch(tmp_path):
    """nexrl-grpo and nexrl-torch register their classes by path: with every installed plugin
    loaded, `nexrl validate` of a recipe on the mock components never imports torch; selecting
    nexrl-grpo's trainer does."""
    from nexrl_core.testing import make_recipe, write_recipe

    recipe = write_recipe(make_recipe(run_dir=str(tmp_path / "run")), tmp_path / "recipe.yaml")
    code = ("import sys\n"
            "from nexrl_core.cli import main\n"
            f"assert main(['validate', {recipe!r}]) == 0\n"
            "print('torch' in sys.modules)\n"
            "from nexrl_core.plugins import get_plugin_manager\n"
            "get_plugin_manager().resolve('trainer', 'self_hosted_grpo', 'trainer.type')\n"
            "print('torch' in sys.modules)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NEXRL_LOAD_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-2:] == ["False", "True"], proc.stdout


def test_export_writes_a_from_pretrained_folder_without_optimizer_state(grpo_run, tmp_path, capsys):
    """`nexrl export CHECKPOINT OUT`: the model and tokenizer of a checkpoint, no optimizer or RNG state."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nexrl_core.cli import main

    step = SAVE_FREQ
    ckpt = grpo_run.run_dir / "checkpoints" / f"global_step_{step}"
    out = tmp_path / "exported"
    assert main(["export", str(ckpt), str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "nexrl_export.json"} <= names
    assert not names & {"optimizer.safetensors", "optimizer.json", "rng.safetensors", "rng.json", "extra_state.json",
                        "nexrl_state.json"}
    assert json.loads((out / "nexrl_export.json").read_text())["global_step"] == step
    size = sum(p.stat().st_size for p in out.iterdir())
    assert size < sum(p.stat().st_size for p in ckpt.iterdir()) / 2  # AdamW keeps two moments per weight
    model = AutoModelForCausalLM.from_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(out))
    assert _same_weights(dict(model.state_dict()), grpo_run.trainer_weights[step])

    # --dtype casts the weights and says so in config.json
    half = tmp_path / "exported-bf16"
    assert main(["export", str(ckpt), str(half), "--dtype", "bfloat16"]) == 0
    model16 = AutoModelForCausalLM.from_pretrained(str(half), dtype="auto")
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}
    expected = {k: v.to(torch.bfloat16) for k, v in grpo_run.trainer_weights[step].items()}
    assert _same_weights(dict(model16.state_dict()), expected)
    assert (half / "model.safetensors").stat().st_size < (out / "model.safetensors").stat().st_size * 0.6

    # an existing folder is replaced only with --force, and only when an earlier export wrote it
    capsys.readouterr()
    assert main(["export", str(ckpt), str(out)]) == 2
    assert "exists and is not empty (--force replaces an earlier export)" in capsys.readouterr().err
    last = grpo_run.run_dir / "checkpoints" / f"global_step_{STEPS}"
    assert main(["export", str(last), str(out), "--force"]) == 0
    assert json.loads((out / "nexrl_export.json").read_text())["global_step"] == STEPS
    mine = tmp_path / "my-notes"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    capsys.readouterr()
    assert main(["export", str(ckpt), str(mine), "--force"]) == 2
    assert "replaces only a folder an earlier `nexrl export` wrote" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me"
    assert main(["export", str(grpo_run.run_dir), str(tmp_path / "x")]) == 2
    assert f"not a complete checkpoint (no nexrl_state.json) nor a folder holding one; give a global_step_<N> " \
           f"folder of trainer.checkpoint_path, or that folder (here: {grpo_run.run_dir / 'checkpoints'})" \
        in capsys.readouterr().err
    assert _modes(out) == {"folder": 0o755, "files": {0o644}}
    # the checkpoints folder itself: its newest checkpoint
    newest = tmp_path / "newest"
    assert main(["export", str(grpo_run.run_dir / "checkpoints"), str(newest)]) == 0
    assert json.loads((newest / "nexrl_export.json").read_text())["global_step"] == STEPS
    assert f"exporting {last}, the newest checkpoint in" in capsys.readouterr().err
