"""On-policy distillation (``trainer.type: self_hosted_opd``): the student samples, a teacher scores
the student's tokens, and the student is trained to lower its per-token reverse KL to the teacher.

The teacher is ``service.reference_service``: any inference backend that answers
:meth:`nexrl_core.InferenceClient.score` (``hf`` runs it in the trainer's process), built like the KL
reference of ``self_hosted_grpo`` and, like it, never sent weights. Rewards are not trained on (the
evaluator still scores the rollouts, for the reward metrics).

The objective, per token ``x_t`` of a student sample (``s``: the student's log-prob, ``t``: the
teacher's, both at the row's sampling temperature)::

    k_t = s_old(x_t) - t(x_t)                       the sampled reverse KL, a constant for the update
    r_t = exp(s(x_t) - s_old(x_t))                  the student against itself at the step's start
    L_t = kl_coef * k_t * r_t                       (clip.enabled: max(that, kl_coef * k_t * clip(r_t)))

aggregated by ``loss_agg_mode`` over the tokens ``token_range`` / ``kl_quantile_range`` keep. ``k_t``
is the advantage ``-kl_coef * k_t`` of a policy gradient whose reward is the negative reverse KL of
each token alone (no credit to earlier tokens), so the first update's gradient is
``kl_coef * k_t * grad s(x_t)``: in expectation over the student's samples, exactly the gradient of
``KL(student || teacher)`` at each position (``tests/grpo_plugin/test_opd.py`` checks it by summing
over the vocabulary). Differentiating ``s - t`` directly would not be: its gradient ``grad s(x_t)``
does not involve the teacher and averages to zero over the student's own samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nexrl_core import Batch, ConfigError, Settings, TrainerParts, setting
from nexrl_torch.train.service import ROW_OUTPUTS

from .losses import MAX_LOG_RATIO, LossAggMode, LossContext, _aggregate, _clipped_surrogate, masked_mean
from .opd_settings import DistillationSettings, kl_quantile_mask, range_problems, token_range_mask
from .trainers import LossFn, SelfHostedTrainer, TrajectoryView, served_log_probs

TEACHER = "service.reference_service"


@dataclass(frozen=True, kw_only=True)
class OpdClip(Settings):
    """PPO's pessimistic bound on the student's ratio to itself at the step's start."""

    enabled: bool = setting(False, "clip the ratio of the student to itself at the step's start (PPO's "
                                   "pessimistic bound; NexRL's use_distillation_clipping)")
    ratio_low: float = setting(0.2, "the ratio is kept above 1 - ratio_low", ge=0.0, lt=1.0, needs=".enabled")
    ratio_high: float = setting(0.2, "the ratio is kept below 1 + ratio_high", ge=0.0, needs=".enabled")


@dataclass(frozen=True, kw_only=True)
class OpdSettings(DistillationSettings):
    """The ``algorithm.*`` keys of ``self_hosted_opd``: the distillation keys every OPD trainer
    reads (:class:`~nexrl_grpo.opd_settings.DistillationSettings`) and this trainer's loss."""

    ppo_epochs: int = setting(1, "updates per batch (1: on-policy, the student's ratio to itself is exactly 1)", ge=1)
    loss_agg_mode: LossAggMode = setting("token-mean", "how per-token losses reduce to the batch loss "
                                                       "(docs/algorithms.md, Aggregation)")
    max_response_length: int | None = setting(None, "seq-mean-token-sum-norm's normaliser (null: "
                                                    "rollout_worker.sampling.max_tokens)", ge=1,
                                              needs=".loss_agg_mode == seq-mean-token-sum-norm")
    clip: OpdClip = setting(OpdClip, "clipping of the student's ratio to itself at the step's start; it acts "
                                     "from the second update of a batch on", needs=".ppo_epochs > 1")


# -- the pieces, on tensors -------------------------------------------------------------------------

def reverse_kl_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    context: LossContext,
    *,
    kl_coef: float = 1.0,
    clip: tuple[float, float] | None = None,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The distillation loss of one micro-batch (its share of the batch's, as :mod:`.losses`).
    Per token, with ``k = old_log_prob - teacher_log_prob`` (held constant) and
    ``r = exp(log_prob - old_log_prob)``::

        L_t = kl_coef * k_t * r_t                                       clip None
        L_t = max(kl_coef * k_t * r_t, kl_coef * k_t * clip(r_t, 1 - low, 1 + high))   clip (low, high)

    aggregated by ``loss_agg_mode`` over ``response_mask``. On-policy (``old_log_prob`` is
    ``log_prob`` detached) the value is ``kl_coef`` times the aggregated sampled reverse KL and the
    gradient ``kl_coef * k_t * grad log_prob``.

    Metrics: ``opd_clipfrac`` (share of the tokens where the clipped branch is active) and
    ``ppo_kl`` (token mean of ``old_log_prob - log_prob``: how far the student moved this step).
    """
    kl = (old_log_prob - teacher_log_prob).detach()
    advantages = -kl_coef * kl
    log_ratio = (log_prob - old_log_prob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    if clip is None:
        per_token, clipped = -advantages * ratio, torch.zeros_like(ratio, dtype=torch.bool)
    else:
        per_token, clipped = _clipped_surrogate(ratio, advantages, clip[0], clip[1])
    loss = _aggregate(per_token, response_mask, context, loss_agg_mode)
    with torch.no_grad():
        metrics = {"opd_clipfrac": masked_mean(clipped.to(log_ratio.dtype), response_mask).item(),
                   "ppo_kl": masked_mean(-log_ratio, response_mask).item()}
    return loss, metrics


# -- the trainer ------------------------------------------------------------------------------------

class SelfHostedOpdTrainer(SelfHostedTrainer):
    """On-policy distillation: the student (the model being trained) samples, the teacher
    (``service.reference_service``, a backend that scores tokens) gives the log-prob of each of the
    student's tokens, and the loss is the per-token reverse KL, student minus teacher, as a
    policy-gradient cost (:mod:`nexrl_grpo.opd`); optional PPO clipping of the student's ratio to
    itself and a choice of the tokens trained, by position or by KL quantile. Rewards are not
    trained on.

    Old log-probs are the trainer's own, as for ``self_hosted_grpo``: with one update per batch and
    no ``kl_quantile_range`` they are the current log-probs detached; otherwise one no-grad forward
    before the first update computes them.
    """

    ALGORITHM_OPTIONS = OpdSettings.options()
    # The teacher is the reference service; this trainer always scores against it.
    REFERENCE_SERVICE_NEEDS = "algorithm.kl_coef > 0"

    def __init__(self, config: Mapping[str, Any], parts: TrainerParts | None = None):
        super().__init__(config, parts)
        # The recipe's `algorithm` section, checked as `nexrl validate` checks it: a bad one fails here.
        self.settings = self.select_algorithm(OpdSettings)[1]
        self._ppo_epochs = self.settings.ppo_epochs
        self.teacher: Any = None  # service.reference_service's client

    @classmethod
    def algorithm_option_problems(cls, options: Mapping[str, Any]) -> list[str]:
        return range_problems(options)

    @classmethod
    def check_recipe(cls, recipe: dict[str, Any]) -> list[str]:
        service = recipe.get("service")
        if isinstance(service, Mapping) and service.get("reference_service") is not None:
            return []
        trainer = recipe.get("trainer")
        name = trainer.get("type") if isinstance(trainer, Mapping) else None
        return [f"{TEACHER}: trainer '{name or cls.__name__}' distils from a teacher, which this section declares: "
                f"an inference backend that scores the student's tokens (e.g. {{backend: hf, model_path: <teacher "
                f"with the student's tokenizer>}})"]

    def initialize_workers(self) -> None:
        super().initialize_workers()
        if self.teacher is None:
            self.teacher = self.create_reference_service()
            if self.teacher is None:
                raise ConfigError(self.check_recipe({})[0])
            self._check_tokenizers()

    def _check_tokenizers(self) -> None:
        """The teacher scores the student's token ids: a teacher that shows its tokenizer must have
        the student's vocabulary."""
        student: Any = getattr(self.train_service, "tokenizer", None)
        teacher: Any = getattr(self.teacher, "tokenizer", None)
        if not (hasattr(student, "get_vocab") and hasattr(teacher, "get_vocab")):
            return
        mine, theirs = student.get_vocab(), teacher.get_vocab()
        if mine != theirs:
            differ = sum(1 for token, index in mine.items() if theirs.get(token) != index)
            raise ConfigError(f"{TEACHER}: the teacher's tokenizer is not the student's ({len(theirs)} vs {len(mine)} "
                              f"tokens, {differ} of the student's mapped differently); it scores the student's token "
                              f"ids, so both must share one vocabulary")

    def close(self) -> None:
        if self.teacher is not None:
            self.teacher.close()
        super().close()

    def _prepare_batch(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """The teacher's log-probs of the student's tokens; the student's own before the update when
        several updates or the KL quantiles need them; the tokens the loss trains on."""
        settings, v = self.settings, batch.values
        trained = v["response_mask"]  # every generated token the trajectories train on
        v["teacher_log_probs"] = served_log_probs(self.teacher, batch, TEACHER)
        v["opd_mask"] = trained.clone()
        select = trained.numpy()
        tokens, quantiles = settings.token_range, settings.kl_quantile_range
        if (tokens.start, tokens.end) != (0.0, 1.0):
            # Positions count per sample: a multi-turn trajectory's trained tokens end to end.
            view = TrajectoryView(batch.metadata["row_trajectory"], trained.shape[1])
            select = view.scatter(token_range_mask(view.gather(select), tokens.start, tokens.end))
        if self._ppo_epochs > 1 or (quantiles.start, quantiles.end) != (0.0, 1.0):
            tensors = {k: x for k, x in v.items() if isinstance(x, torch.Tensor)}
            v["old_log_probs"] = self.service.forward(tensors)
        if (quantiles.start, quantiles.end) != (0.0, 1.0):
            kl = (v["old_log_probs"] - v["teacher_log_probs"]).numpy()
            select = kl_quantile_mask(kl, select, quantiles.start, quantiles.end)
        v["response_mask"] = trained * torch.from_numpy(np.asarray(select, dtype=np.float32))
        total = float(trained.sum())
        metrics = {"train/opd_trained_token_share": float(v["response_mask"].sum()) / total if total else 0.0,
                   "train/opd_teacher_logprob_mean": float(masked_mean(v["teacher_log_probs"], trained))}
        return batch, metrics

    def _loss_fn(self, batch: Batch) -> LossFn:
        settings = self.settings
        clip = (settings.clip.ratio_low, settings.clip.ratio_high) if settings.clip.enabled else None
        max_response_length = settings.max_response_length or batch.metadata["max_tokens"]

        def loss_fn(log_probs: torch.Tensor, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
            # On-policy shortcut: without a precomputed old log-prob, the current one (detached) is it.
            old = mb["old_log_probs"] if "old_log_probs" in mb else log_probs.detach()
            context = LossContext(batch_num_seqs=mb["batch_num_seqs"], batch_num_tokens=mb["batch_num_tokens"],
                                  max_response_length=max_response_length)
            loss, metrics = reverse_kl_loss(log_probs, old, mb["teacher_log_probs"], mb["response_mask"], context,
                                            kl_coef=settings.kl_coef, clip=clip,
                                            loss_agg_mode=settings.loss_agg_mode)
            with torch.no_grad():  # per row, over every generated token (the selection aside): the step's KL
                generated = mb["opd_mask"].to(old.dtype)
                rows = {"opd_kl_sum": ((old.detach() - mb["teacher_log_probs"]) * generated).sum(-1),
                        "opd_student_sum": (old.detach() * generated).sum(-1),
                        "opd_tokens": generated.sum(-1)}
            return loss, {**metrics, ROW_OUTPUTS: rows}
        return loss_fn

    def _update(self, batch: Batch, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """The updates; then the step's reverse KL from the per-row sums of the first one (the
        student as the step found it, whatever the selection trains on)."""
        metrics = super()._update(batch, tensors)
        rows = batch.metadata.get(ROW_OUTPUTS) or {}
        if "opd_kl_sum" in rows:
            tokens = float(np.sum(rows["opd_tokens"]))
            if tokens:
                metrics["train/opd_reverse_kl"] = float(np.sum(rows["opd_kl_sum"])) / tokens
                metrics["train/opd_student_logprob_mean"] = float(np.sum(rows["opd_student_sum"])) / tokens
        return metrics
