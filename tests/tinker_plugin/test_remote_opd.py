"""On-policy distillation on Tinker (``trainer.type: remote_api_opd``) through the real controller,
the real ``tinker`` SDK and the stand-in on loopback, which trains a real tiny Llama (LoRA, AdamW).

The student is the stand-in's ``tiny``; the teacher another tiny Llama (other weights, the same
tokenizer) served as base model ``teacher`` and scored through a Tinker sampling client's
``compute_logprobs`` (``service.reference_service: {backend: tinker, base_model: teacher}``). Checked
against the teacher computed here in torch: each trained token's advantage is
``-kl_coef * (student - teacher)`` log-probs with the token selections applied, and over a few
steps the student's sampled reverse KL to the teacher falls.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from nexrl_core import SamplingParams
from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import check_config, load_recipe
from nexrl_tinker.inference import TinkerInferenceClient
from nexrl_tinker.service import checkpoint_sampler_path
from nexrl_tinker.standin import BaseModel, StandinServer
from tests.support.tiny_lm import build_model
from tests.tinker_plugin.helpers import API_KEY, MODEL, PROMPTS, grpo_recipe, metrics_rows, tinker_plugin_manager

TEACHER = "teacher"
TEACHER_SEED = 7
STEPS = 10
GROUP = 8
UNRELATED_SEED = 77  # a control: a model the student never sees


def _opd_recipe(run_dir: Path, url: str, tokenizer_path: str, *, steps: int, algorithm: dict | None = None) -> dict:
    recipe = grpo_recipe(run_dir, url, tokenizer_path, steps=steps, group=GROUP, lr=2e-2)
    recipe["trainer"]["type"] = "remote_api_opd"
    recipe["algorithm"] = algorithm or {"kl_coef": 1.0}
    recipe["service"]["reference_service"] = {"backend": "tinker", "base_model": TEACHER,
                                              "tokenizer_path": tokenizer_path, "base_url": url, "api_key": API_KEY}
    return recipe


def _controller(recipe: dict, folder: Path) -> NexRLController:
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return NexRLController(load_recipe(str(path)), plugin_manager=tinker_plugin_manager())


@pytest.fixture(scope="module")
def teacher(tokenizer):
    """The teacher's weights, in torch here (the stand-in serves a copy)."""
    return build_model(tokenizer, seed=TEACHER_SEED)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer, teacher):
    models = {MODEL: BaseModel(MODEL, build_model(tokenizer), tokenizer),
              TEACHER: BaseModel(TEACHER, copy.deepcopy(teacher), tokenizer)}
    with StandinServer(models, state_dir=str(tmp_path_factory.mktemp("opd_state"))) as running:
        yield running


def _teacher_log_probs(teacher, prompt: list[int], response: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = teacher(input_ids=torch.tensor([prompt + response])).logits[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return log_probs[positions, torch.tensor(response)].numpy().astype(np.float64)


@pytest.fixture(scope="module")
def opd_run(tmp_path_factory, server, tiny_folder):
    root = tmp_path_factory.mktemp("remote_opd")
    controller = _controller(_opd_recipe(root / "run", server.url, tiny_folder, steps=STEPS), root)
    trainer = controller.trainer
    prepared: list[tuple[list[dict], list[dict]]] = []  # per step: (the pool's trajectories, the prepared ones)
    prepare = trainer._prepare_trajectories

    def recording(trajectories, metrics):
        given = [dict(t) for t in trajectories]
        out = prepare(trajectories, metrics)
        prepared.append((given, [dict(t) for t in out]))
        return out
    trainer._prepare_trajectories = recording
    summary = controller.run()
    return summary, root / "run", prepared


def _exact_reverse_kl(student, teacher, prompts: list[list[int]], eos: int, samples: int = 4) -> float:
    """Mean over the positions of the student's own continuations (up to 6 tokens, a fixed seed) of
    KL(student || teacher) of the next token, summed over the vocabulary."""
    generator = torch.Generator().manual_seed(0)
    total = count = 0.0
    for prompt in prompts:
        for _ in range(samples):
            seq = torch.tensor([prompt])
            for _ in range(6):
                with torch.no_grad():
                    s = torch.log_softmax(student(seq)[0, -1].double(), -1)
                    t = torch.log_softmax(teacher(seq)[0, -1].double(), -1)
                total += float((s.exp() * (s - t)).sum())
                count += 1
                token = torch.multinomial(s.exp(), 1, generator=generator)
                seq = torch.cat([seq, token.view(1, 1)], 1)
                if int(token) == eos:
                    break
    return total / count


def test_the_students_kl_to_the_teacher_falls(opd_run, server, tokenizer, teacher):
    """The student's weights after the run (the sampler its last checkpoint names, read from the
    stand-in) against the teacher, exactly, over the run's prompts: the KL falls, and by a larger
    share than the KL to a model the student never saw (it moved towards this teacher)."""
    summary, run_dir, prepared = opd_run
    assert summary.stopped_by == "finished" and summary.global_step == STEPS and summary.errors == []
    rows = [r for r in metrics_rows(run_dir) if "train/opd_reverse_kl" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["train/opd_trained_token_share"] == 1.0 and r["train/opd_reverse_kl"] > 0 for r in rows)
    last = sorted((run_dir / "checkpoints").glob("global_step_*"), key=lambda p: int(p.name.split("_")[-1]))[-1]
    base, trained = server.checkpoint_weights(checkpoint_sampler_path(str(last)))
    assert base == MODEL and trained and all(".lora_" in name for name in trained)
    student = BaseModel(MODEL, build_model(tokenizer), tokenizer)  # LoRA B = 0: the student before training
    unrelated = build_model(tokenizer, seed=UNRELATED_SEED)
    prompts = sorted({tuple(t["prompt_token_ids"]) for t in prepared[0][0]})
    assert len(prompts) == len(PROMPTS)

    def kl(params, other):
        return _exact_reverse_kl(lambda ids: student.call(params, input_ids=ids).logits,
                                 lambda ids: other(input_ids=ids).logits, [list(p) for p in prompts],
                                 tokenizer.eos_token_id)
    before, after = kl({}, teacher), kl(trained, teacher)
    before_unrelated, after_unrelated = kl({}, unrelated), kl(trained, unrelated)
    print(f"exact reverse KL to the teacher {before:.4f} -> {after:.4f}; to an unrelated model "
          f"{before_unrelated:.4f} -> {after_unrelated:.4f}")
    assert before > 1.0 and after < 0.88 * before, (before, after)
    assert after / before < after_unrelated / before_unrelated - 0.05, (before, after, before_unrelated,
                                                                        after_unrelated)


def test_each_tokens_advantage_is_minus_the_student_minus_teacher_log_prob(opd_run, teacher):
    """The teacher's scores come from the Tinker sampling client (compute_logprobs); here they are
    computed again in torch from the teacher's weights."""
    _, _, prepared = opd_run
    assert len(prepared) == STEPS
    for given, out in (prepared[0], prepared[-1]):
        assert len(out) == len(given) == len(PROMPTS) * GROUP
        for before, after in zip(given, out):
            student = np.asarray(before["response_logprobs"], dtype=np.float64)
            expected = -(student - _teacher_log_probs(teacher, before["prompt_token_ids"],
                                                      before["response_token_ids"]))
            np.testing.assert_allclose(after["advantages"], expected, atol=2e-4)
            assert "advantages" not in before  # the pool's trajectories are left as they were


def test_the_options_select_the_tokens_and_scale_the_advantage(server, tiny_folder, teacher, tmp_path):
    """kl_coef, token_range (by position in each sample) and kl_quantile_range (by the token's
    reverse KL among the batch's), on samples of the real sampling client."""
    algorithm = {"kl_coef": 0.5, "token_range": {"start": 0.25, "end": 0.75},
                 "kl_quantile_range": {"start": 0.0, "end": 0.5}}
    recipe = _opd_recipe(tmp_path / "run", server.url, tiny_folder, steps=1, algorithm=algorithm)
    controller = _controller(recipe, tmp_path)
    trainer = controller.trainer
    trainer.initialize_workers()
    sampler = TinkerInferenceClient({"backend": "tinker", "base_model": MODEL, "tokenizer_path": tiny_folder,
                                     "base_url": server.url, "api_key": API_KEY})
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    try:
        trajectories = []
        for i, prompt in enumerate(PROMPTS * 2):
            done = sampler.complete(prompt, params)
            trajectories.append({"uid": str(i), "prompt_token_ids": done.prompt_token_ids,
                                 "response_token_ids": done.response_token_ids,
                                 "response_logprobs": done.response_logprobs, "sampling": params.as_record()})
        metrics: dict = {}
        out = trainer._prepare_trajectories(trajectories, metrics)
    finally:
        sampler.close()
        controller.trainer.close()
    kls = [np.asarray(t["response_logprobs"]) - _teacher_log_probs(teacher, t["prompt_token_ids"],
                                                                    t["response_token_ids"]) for t in trajectories]
    # by position: of n tokens, those at floor(n / 4) .. floor(3n / 4) - 1 (at least the first of them)
    in_range = []
    for kl in kls:
        n = len(kl)
        first, last = n // 4, max((3 * n) // 4, n // 4 + 1)
        in_range.append([first <= i < last for i in range(n)])
    # by KL: among the tokens in range, those at or below the median
    median = np.quantile(np.concatenate([kl[np.asarray(r)] for kl, r in zip(kls, in_range)]), 0.5)
    trained = 0
    for t, kl, r in zip(out, kls, in_range):
        keep = np.asarray(r) & (kl <= median + 1e-6)
        trained += int(keep.sum())
        np.testing.assert_allclose(t["advantages"], np.where(keep, -0.5 * kl, 0.0), atol=2e-4)
    total = sum(len(kl) for kl in kls)
    assert 0 < trained < total and metrics["train/opd_trained_token_share"] == pytest.approx(trained / total)


def test_a_recipe_without_a_teacher_or_at_another_temperature_is_refused(server, tiny_folder, tmp_path):
    recipe = _opd_recipe(tmp_path / "run", server.url, tiny_folder, steps=1)
    del recipe["service"]["reference_service"]
    recipe["rollout_worker"]["sampling"]["temperature"] = 0.7
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    problems = check_config(load_recipe(str(path)), tinker_plugin_manager())
    assert any(p.startswith("service.reference_service: trainer 'remote_api_opd' distils from a teacher")
               for p in problems), problems
    assert any(p.startswith("rollout_worker.sampling.temperature: 0.7, but the Tinker service scores tokens at "
                            "temperature 1 only") for p in problems), problems


def test_without_nexrl_grpo_the_plugin_registers_no_distillation_trainer(monkeypatch):
    """remote_api_opd reads nexrl-grpo's distillation keys (the extra nexrl-tinker[opd]); without it
    the other trainers register as before."""
    import sys

    import nexrl_tinker.plugin as plugin

    monkeypatch.delitem(sys.modules, "nexrl_tinker.opd", raising=False)
    monkeypatch.setitem(sys.modules, "nexrl_grpo.opd_settings", None)  # as if not installed
    assert sorted(plugin.nexrl_trainers()) == ["remote_api_cross_entropy", "remote_api_grpo"]
