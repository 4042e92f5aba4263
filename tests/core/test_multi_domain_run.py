"""Multi-domain training through the real controller (mock inference, mock trainer): per-domain
evaluators, batches in the domains' proportions with whole groups, dynamic sampling and its
accounting, per-domain training and validation metrics with their denominators, per-domain
pass@k, exact resume, and the recipe checks of `nexrl validate` / `nexrl run`.

Rewards are computed here from the rows: the ``pattern`` evaluator (registered in the test) scores
sample ``i`` of a row ``pattern[i % len(pattern)]``; the ``sum`` domain is scored by
``exact_match`` against the mock model's answer (right from version ``mock_sum_threshold``)."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest

from nexrl_core import ConfigError, EvaluationRunResult, Evaluator, hookimpl
from nexrl_core.builtins.mock import mock_sum_threshold
from nexrl_core.testing import make_recipe

GROUP = 2
BATCH = 8  # 4 groups: sum 1, mixed 2, flat 1
STEPS = 3
N_VAL = 3
LEARN_STEPS = 4
SUMS = [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3)]
MIXED = [[1.0, 0.0], [0.0, 1.0], [1.0, 0.5], [0.25, 0.0]]  # never flat over GROUP samples
FLAT = [[1.0, 1.0], [0.0, 0.0]]  # served in this order (shuffle: false): f0, f1, f0, f1, ...
VAL_MIXED = [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
VAL_SUMS = [(1, 0), (4, 4)]


class PatternEvaluator(Evaluator):
    def __init__(self, weight: float = 1.0):
        if weight < 0:  # as nexrl-rewards' evaluators name a bad option
            raise ConfigError("rollout_worker.evaluator.weight: must be >= 0")

    def evaluate(self, data, evaluation_target):
        pattern = data["pattern"]
        reward = float(pattern[int(data["sample_index"]) % len(pattern)])
        return EvaluationRunResult(reward=reward, metrics={"hit": float(reward == 1.0)})


class TestPlugin:
    @staticmethod
    @hookimpl
    def nexrl_evaluators():
        return {"pattern": PatternEvaluator}


@pytest.fixture
def pm(core_pm):
    core_pm.register(TestPlugin(), "test.pattern")
    return core_pm


def sum_row(a, b):
    return {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}


def recipe(steps=STEPS, dynamic=True, **extra):
    """The kit's mock recipe over three domains; each of ``extra`` replaces its whole section."""
    return {**make_recipe(**{
        "data": {"type": "multi_domain",
                 "domain_interleave_probs": {"sum": 0.25, "mixed": 0.5, "flat": 0.25},
                 "domains": {"sum": {"type": "inline", "rows": [sum_row(a, b) for a, b in SUMS]},
                             "mixed": {"type": "inline", "rows": [{"prompt": f"m{i}", "pattern": p}
                                                                  for i, p in enumerate(MIXED)]},
                             "flat": {"type": "inline", "shuffle": False,
                                      "rows": [{"prompt": f"f{i}", "pattern": p} for i, p in enumerate(FLAT)]}}},
        "validate": {"validate_before_train": True, "n_samples": N_VAL,
                     "data": {"type": "multi_domain",
                              "domains": {"sum": {"type": "inline", "rows": [sum_row(a, b) for a, b in VAL_SUMS]},
                                          "mixed": {"type": "inline",
                                                    "rows": [{"prompt": f"v{i}", "pattern": p}
                                                             for i, p in enumerate(VAL_MIXED)]}}}},
        "rollout_worker": {"num_workers": 3, "evaluator": {"type": "exact_match"}, "sampling": {"max_tokens": 8},
                           "domain_evaluators": {"mixed": {"type": "pattern"}, "flat": {"type": "pattern"}},
                           "domain_sampling": {"mixed": {"max_tokens": 3, "temperature": 0.5}}},
        "trajectory_pool": {"batch_size": BATCH, "group_size": GROUP,
                            "dynamic_sampling": {"enabled": dynamic, **({"max_replacements": 2} if dynamic else {})}},
        "trainer": {"type": "mock", "total_train_steps": steps},
        "weight": {"rollout_limit": "batch"},
        "service": {"inference_service": {"backend": "mock", "mode": "sum", "learn_steps": LEARN_STEPS}},
    }), **extra}


def metrics_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def brute_pass_at_k(outcomes, k):
    subsets = list(itertools.combinations(outcomes, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


def test_a_multi_domain_run(run_local, pm, tmp_path):
    controller, summary = run_local(recipe(), pm=pm)
    assert summary.stopped_by == "finished" and summary.global_step == STEPS
    rows = metrics_rows(tmp_path / "run")
    train = {r["step"]: r for r in rows if "train/reward_mean" in r}
    assert sorted(train) == list(range(1, STEPS + 1))

    for step, batch in enumerate(controller.trainer.batches, start=1):
        version = step - 1
        # whole groups, in the proportions 1 : 2 : 1 of the 4 groups of a batch
        groups = {}
        for t in batch:
            groups.setdefault(t["uid"], []).append(t)
        assert all(len(g) == GROUP for g in groups.values())
        assert sorted(g[0]["domain"] for g in groups.values()) == ["flat", "mixed", "mixed", "sum"]
        # each domain's sampling (the mixed domain's own max_tokens and temperature) and evaluator
        for t in batch:
            want = (3, 0.5) if t["domain"] == "mixed" else (8, 1.0)
            assert (t["sampling"]["max_tokens"], t["sampling"]["temperature"]) == want
            if t["domain"] == "sum":
                a, b = map(int, t["prompt"][-1]["content"].removeprefix("What is ").rstrip("?").split(" + "))
                assert t["reward"] == float(version >= mock_sum_threshold(a, b, LEARN_STEPS))
            else:
                pattern = t["task"]["pattern"]
                assert t["reward"] == pattern[t["sample_index"] % len(pattern)]
        # dynamic sampling: the sum and flat groups are always flat, so each slot was dropped twice
        # (max_replacements) and the third flat group kept; mixed groups are never flat
        attempts = {g[0]["domain"]: g[0]["task"].get("sampling_attempt", 0) for g in groups.values()}
        assert attempts == {"sum": 2, "flat": 2, "mixed": 0}

        m = train[step]
        used = {d: [t for t in batch if t["domain"] == d] for d in ("sum", "mixed", "flat")}
        for d, mine in used.items():
            assert m[f"train/{d}/reward_mean"] == pytest.approx(sum(t["reward"] for t in mine) / len(mine))
            assert m[f"train/{d}/num_trajectories"] == len(mine)
            assert m[f"train/{d}/num_groups"] == len(mine) // GROUP
            assert m[f"train/{d}/num_failed"] == 0
        assert m["train/flat/hit_mean"] == pytest.approx(sum(t["reward"] == 1.0 for t in used["flat"]) / GROUP)
        # denominators: the overall mean is the sample-weighted mean of the domains' means
        weighted = sum(m[f"train/{d}/reward_mean"] * m[f"train/{d}/num_trajectories"] for d in used) / BATCH
        assert m["train/reward_mean"] == pytest.approx(weighted)
        # dropped groups count where they belong; sampled_reward_mean includes them
        assert (m["train/sum/dropped_groups"], m["train/flat/dropped_groups"], m["train/mixed/dropped_groups"]) \
            == (2, 2, 0)
        assert m["train/dropped_groups"] == 4
        assert m["pool/dynamic_sampling_dropped_groups"] == 4 * step
        assert m["pool/dynamic_sampling_kept_flat_groups"] == 2 * step
        # the flat domain serves f0, f1, f0, ...: three groups a step, two dropped and the third kept
        served = [FLAT[i % 2][0] for i in range(3 * (step - 1), 3 * step)]
        assert m["train/flat/reward_mean"] == served[2]
        assert m["train/flat/sampled_reward_mean"] == pytest.approx(sum(served) / 3)
        assert m["train/mixed/sampled_reward_mean"] == pytest.approx(m["train/mixed/reward_mean"])

    # validation: per-domain means and pass@k against a brute force over the samples
    val = {r["step"]: r for r in rows if "val/reward" in r}
    v0 = val[0]
    mixed_rewards = [p[i % len(p)] for p in VAL_MIXED for i in range(N_VAL)]
    sum_rewards = [float(0 >= mock_sum_threshold(a, b, LEARN_STEPS)) for a, b in VAL_SUMS for _ in range(N_VAL)]
    assert v0["val/mixed_reward"] == pytest.approx(sum(mixed_rewards) / len(mixed_rewards))
    assert v0["val/sum_reward"] == pytest.approx(sum(sum_rewards) / len(sum_rewards))
    assert v0["val/reward"] == pytest.approx((sum(mixed_rewards) + sum(sum_rewards)) / (len(mixed_rewards)
                                                                                        + len(sum_rewards)))
    assert v0["val/num_samples"] == len(mixed_rewards) + len(sum_rewards)
    for k in (1, N_VAL):
        want = sum(brute_pass_at_k([p[i % len(p)] >= 1.0 for i in range(N_VAL)], k) for p in VAL_MIXED) / len(VAL_MIXED)
        assert v0[f"val/mixed_pass@{k}"] == pytest.approx(float(want))
    assert v0[f"val/mixed_mean@{N_VAL}"] == pytest.approx(sum(mixed_rewards) / len(mixed_rewards))
    assert "val/flat_reward" not in v0  # no validation rows in that domain
    # a domain's evaluator metric is the domain's own: not a zero of the other domain
    mixed_hits = [r == 1.0 for r in mixed_rewards]
    assert v0["val/mixed_hit"] == pytest.approx(sum(mixed_hits) / len(mixed_hits))
    assert "val/sum_hit" not in v0
    assert v0["val/hit"] == pytest.approx(sum(mixed_hits) / v0["val/num_samples"])  # overall: every sample


def test_without_dynamic_sampling_flat_groups_are_trained_on_and_nothing_is_dropped(run_local, pm, tmp_path):
    controller, summary = run_local(recipe(steps=2, dynamic=False), pm=pm)
    assert summary.global_step == 2
    rows = metrics_rows(tmp_path / "run")
    for batch in controller.trainer.batches:
        assert not any(t["task"].get("sampling_attempt") for t in batch)
    assert not any(k.startswith("pool/dynamic_sampling") or k.endswith("dropped_groups") for r in rows for k in r)


def test_resume_across_domains_trains_on_the_same_data(run_local, pm, tmp_path):
    def trained(controller):
        return [sorted((t["uid"], t["sample_index"], t["reward"], t["task"].get("sampling_attempt", 0))
                       for t in batch) for batch in controller.trainer.batches]

    straight, _ = run_local(recipe(steps=4, run_dir=str(tmp_path / "straight")), pm=pm)
    first, _ = run_local(recipe(steps=2, run_dir=str(tmp_path / "cut"),
                                trainer={"type": "mock", "total_train_steps": 2, "save_freq": 2}), pm=pm)
    resumed, summary = run_local(recipe(steps=4, run_dir=str(tmp_path / "cut"), resume={"mode": "auto"},
                                        trainer={"type": "mock", "total_train_steps": 4, "save_freq": 2}), pm=pm)
    assert summary.global_step == 4
    assert trained(first) + trained(resumed) == trained(straight)
    state = json.loads((tmp_path / "cut" / "checkpoints" / "global_step_2" / "nexrl_state.json").read_text())
    assert sorted(state["dataloader"]["domains"]) == ["flat", "mixed", "sum"]
    assert state["trajectory_pool"]["counters"]["default"]["dynamic_sampling_dropped_groups"] == 8


def test_two_runs_with_dynamic_sampling_train_on_the_same_batches_in_the_same_order(run_local, pm, tmp_path):
    """Sync mode, several workers: flat groups are dropped and replaced every step, yet the batches
    (their tasks, seqs, order and sampling attempts) are the same in two runs (the replacements
    are asked for once the round has landed, in issue order)."""
    def trained(controller):
        return [[(t["uid"], t["sample_index"], t["seq"], t["reward"], t["task"].get("sampling_attempt", 0))
                 for t in batch] for batch in controller.trainer.batches]

    runs = [run_local(recipe(steps=3, run_dir=str(tmp_path / f"run{i}"),
                             rollout_worker={"num_workers": 4, "evaluator": {"type": "exact_match"},
                                             "domain_evaluators": {"mixed": {"type": "pattern"},
                                                                   "flat": {"type": "pattern"}}}), pm=pm)[0]
            for i in range(2)]
    first = trained(runs[0])
    assert any(attempt for batch in first for *_, attempt in batch)  # replacements were trained on
    assert trained(runs[1]) == first


# -- recipe checks: validate and run say the same ----------------------------------------------------

@pytest.mark.parametrize("change,expected", [
    ({"rollout_worker": {"domain_evaluators": {"mixd": {"type": "pattern"}}}},
     "rollout_worker.domain_evaluators.mixd: no such domain; did you mean 'mixed'? (the data's domains: sum, mixed, "
     "flat)"),
    ({"rollout_worker": {"domain_sampling": {"flta": {"max_tokens": 4}}}},
     "rollout_worker.domain_sampling.flta: no such domain; did you mean 'flat'?"),
    ({"rollout_worker": {"domain_sampling": {"flat": {"max_token": 4}}}},
     "rollout_worker.domain_sampling.flat.max_token: unknown key; did you mean "
     "'rollout_worker.domain_sampling.flat.max_tokens'?"),
    ({"rollout_worker": {"domain_evaluators": {"mixed": {"weight": -1.0}}}},
     "rollout_worker.domain_evaluators.mixed.weight: must be >= 0"),
    ({"rollout_worker": {"domain_evaluators": {"mixed": {"type": "patern"}}}},
     "rollout_worker.domain_evaluators.mixed.type: unknown evaluator 'patern'"),
    ({"trajectory_pool": {"group_size": 1, "batch_size": 8, "dynamic_sampling": {"enabled": True}}},
     "trajectory_pool.dynamic_sampling.enabled: drops groups whose rewards are all equal, so it needs groups of "
     "several samples (group_size > 1 and a key_list)"),
    ({"data": {"domain_interleave_probs": {"code": 1}}}, "data.domain_interleave_probs: code is not a domain "
                                                         "(domains: sum, mixed, flat)"),
    ({"algorithm": {"reward_processing": {"domains": {"cod": {}}}}},
     "algorithm.reward_processing.domains.cod: no such domain (the data's domains: sum, mixed, flat)"),
    ({"data": {"domains": {"sum": {"type": "inline", "rowz": []}}}}, "data.domains.sum.rowz: unknown key"),
])
def test_bad_multi_domain_recipes_are_one_line_in_validate_and_run(change, expected, pm, tmp_path, run_local):
    import yaml

    from nexrl_core.launch.preflight import validate_recipe
    from nexrl_core.launch.recipe import load_recipe

    bad = make_recipe(recipe(), **change)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), **bad}, sort_keys=False))
    problems = validate_recipe(load_recipe(str(path)), pm)
    assert any(p.startswith(expected) for p in problems), problems
    with pytest.raises(ConfigError) as exc:  # RecipeProblems before anything is built, else the builder's line
        run_local(bad, pm=pm)
    assert any(p.startswith(expected) for p in getattr(exc.value, "problems", [str(exc.value)]))
