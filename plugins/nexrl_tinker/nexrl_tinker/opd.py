"""On-policy distillation through the Tinker API (``trainer.type: remote_api_opd``, NexRL's name).

The student (the model the Tinker train service trains) samples; the teacher,
``service.reference_service`` (any inference backend that answers
:meth:`nexrl_core.InferenceClient.score`: ``tinker`` with a ``base_model`` is a Tinker sampling
client's ``compute_logprobs``, ``hf`` a local model), scores each of the student's tokens; each
token's advantage is ``-kl_coef * (s - t)``, the student's sampling log-prob minus the teacher's,
and the service trains on it with its ``importance_sampling`` loss. That is the policy gradient of
``KL(student || teacher)`` of :mod:`nexrl_grpo.opd_settings`, whose keys (``kl_coef``,
``token_range``, ``kl_quantile_range``) this trainer shares with ``self_hosted_opd``. The service
computes the loss (a sum over tokens), so the self-hosted trainer's aggregation, several updates
per batch and their clipping have no counterpart here.

The service scores tokens at temperature 1 only: the student must sample at 1 (or greedily), as
for ``remote_api_grpo``. Rewards are not trained on (the evaluator still scores the rollouts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from nexrl_core import ConfigError, DataError, TrainerParts, Trajectory

# The distillation keys are nexrl-grpo's (numpy only): one declaration for every OPD trainer. The
# plugin registers remote_api_opd where nexrl-grpo is installed (pip install nexrl-tinker[opd]).
from nexrl_grpo.opd_settings import DistillationSettings, kl_quantile_mask, range_problems, token_range_mask

from .trainers import RemoteApiGrpoTrainer, RemoteApiTrainer, _name, _padded, _response_mask, _segments

TEACHER = "service.reference_service"


class RemoteApiOpdTrainer(RemoteApiTrainer):
    """On-policy distillation on the Tinker service: per-token advantages ``-kl_coef * (student -
    teacher)`` log-probs of the student's own samples, selected by ``token_range`` and
    ``kl_quantile_range``, trained with ``importance_sampling``."""

    ALGORITHM_OPTIONS = DistillationSettings.options()
    # The teacher is the reference service; this trainer always scores against it.
    REFERENCE_SERVICE_NEEDS = "algorithm.kl_coef > 0"

    def __init__(self, config: Mapping[str, Any], parts: TrainerParts | None = None):
        super().__init__(config, parts)
        # A bad algorithm section fails here, before the service is built.
        self.settings = self.select_algorithm(DistillationSettings)[1]
        self.teacher: Any = None  # service.reference_service's client

    def _check_sampling(self, trajectory: Trajectory) -> None:
        """Sampled at temperature 1: remote_api_grpo's check (one for both; it reads only
        :meth:`_temperature_reason`)."""
        RemoteApiGrpoTrainer._check_sampling(cast(RemoteApiGrpoTrainer, self), trajectory)

    @staticmethod
    def _temperature_reason() -> str:
        return ("the Tinker service scores tokens at temperature 1 only, so the student's log-probs, the teacher's "
                "and the importance ratio of the loss would be of different distributions")

    @classmethod
    def algorithm_option_problems(cls, options: Mapping[str, Any]) -> list[str]:
        return range_problems(options)

    @classmethod
    def check_recipe(cls, recipe: Mapping[str, Any]) -> list[str]:
        # remote_api_grpo's temperature check, worded with this trainer's _temperature_reason
        problems = vars(RemoteApiGrpoTrainer)["check_recipe"].__func__(cls, recipe)
        service = recipe.get("service")
        if not (isinstance(service, Mapping) and service.get("reference_service") is not None):
            problems.append(f"{TEACHER}: trainer 'remote_api_opd' distils from a teacher, which this section "
                            f"declares: an inference backend that scores the student's tokens, e.g. {{backend: "
                            f"tinker, base_model: <teacher with the student's tokenizer>, tokenizer_path: ...}}")
        return problems

    def initialize_workers(self) -> None:
        super().initialize_workers()
        if self.teacher is None:
            self.teacher = self.create_reference_service()
            if self.teacher is None:
                raise ConfigError(self.check_recipe({})[-1])

    def close(self) -> None:
        if self.teacher is not None:
            self.teacher.close()
        super().close()

    def teacher_log_probs(self, trajectories: list[Trajectory]) -> list[np.ndarray]:
        """The teacher's log-prob of each response token of each trajectory (its sequences end to
        end), at temperature 1."""
        segments = [_segments(t) for t in trajectories]
        scored = iter(self.teacher.score([(seg["prompt_token_ids"], seg["response_token_ids"], 1.0)
                                          for segs in segments for seg in segs]))
        return [np.concatenate([np.asarray(next(scored), dtype=np.float64) for _ in segs] or [np.zeros(0)])
                for segs in segments]

    def _prepare_trajectories(self, trajectories: list[Trajectory], metrics: dict[str, Any]) -> list[Trajectory]:
        settings = self.settings
        students = []
        for t in trajectories:
            self._check_sampling(t)
            logprobs = [seg.get("response_logprobs") for seg in _segments(t)]
            if any(lp is None for lp in logprobs):
                raise DataError(f"{_name(t)} has no response_logprobs: on-policy distillation needs the student's "
                                f"log-prob of every sampled token")
            students.append(np.concatenate([np.asarray(lp, dtype=np.float64) for lp in logprobs]))
        teachers = self.teacher_log_probs(trajectories)
        masks = [_response_mask(t) for t in trajectories]
        for t, s, m in zip(trajectories, students, masks):
            if len(s) != len(m):
                raise DataError(f"{_name(t)}: {len(s)} response_logprobs for {len(m)} response tokens")
        kl, trained = _padded([s - t for s, t in zip(students, teachers)]), _padded(masks)
        selected = trained
        tokens, quantiles = settings.token_range, settings.kl_quantile_range
        if (tokens.start, tokens.end) != (0.0, 1.0):
            selected = token_range_mask(selected, tokens.start, tokens.end)
        if (quantiles.start, quantiles.end) != (0.0, 1.0):
            selected = kl_quantile_mask(kl, selected, quantiles.start, quantiles.end)
        advantages = -settings.kl_coef * kl * selected
        total = float(trained.sum())
        metrics.update({
            "train/opd_reverse_kl": float((kl * trained).sum()) / total if total else 0.0,
            "train/opd_trained_token_share": float(selected.sum()) / total if total else 0.0,
            "train/opd_teacher_logprob_mean": float((_padded(teachers) * trained).sum()) / total if total else 0.0,
            "train/opd_student_logprob_mean": float((_padded(students) * trained).sum()) / total if total else 0.0,
        })
        return cast(list[Trajectory], [{**t, "advantages": row[:len(m)].tolist()}
                                       for t, row, m in zip(trajectories, advantages, masks)])
