"""RL math shared by every trainer: pure functions on numpy arrays, registered by name. No torch.

- :mod:`.advantages`: advantage estimators (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_plus_plus``,
  ``gae``) and their statistics;
- :mod:`.kl`: the k1/k2/k3 KL estimators (numpy or torch), KL controllers, the KL reward penalty;
- :mod:`.rollout_correction`: rollout-vs-trainer log-prob mismatch metrics, truncated IS weights;
- :mod:`.reward_processing`: sample-level masks and reward post-processing (normalisation by
  group / batch / running statistics, clipping, scaling), per domain;
- :mod:`.metrics`: how per-micro-batch metrics combine (``_max``/``_min``/weighted mean);
- :mod:`.registry`: the named registries plugins fill through ``nexrl_advantage_estimators`` /
  ``nexrl_policy_losses``, and how a recipe's ``algorithm`` section selects from them.

A self-hosted trainer converts its tensors to numpy and calls these; a remote trainer (Tinker)
calls the same functions on the arrays it has. Policy losses need autograd and live in the
distribution that owns torch (``nexrl-grpo``), registered through the same registry.
"""

from .advantages import (
    AdvantageInputs,
    discounted_returns,
    dr_grpo,
    gae,
    group_stats,
    grpo,
    masked_whiten,
    reinforce_plus_plus,
    rloo,
    scores_to_token_level,
)
from .kl import (
    KL_CTRL_DEFAULTS,
    KL_CTRL_OPTIONS,
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    KlCtrlSettings,
    apply_kl_penalty,
    array_namespace,
    get_kl_controller,
    kl_penalty,
)
from .metrics import aggregate_metrics, reduction
from .registry import (
    ALGORITHM_KINDS,
    AlgorithmFunction,
    AlgorithmRegistry,
    AlgorithmSelection,
    algorithm_keys,
    option_defaults,
    select_algorithms,
    unknown_name_error,
)
from .reward_processing import (
    NORM_MODES,
    OVERLONG_MODES,
    REWARD_OPTIONS,
    REWARD_PROCESSING_OPTIONS,
    ProcessedRewards,
    RewardProcessingSettings,
    RewardProcessor,
    RewardSettings,
    RunningMoments,
    domain_settings,
    flat_group_rows,
    get_sample_level_mask,
    process_rewards,
    response_truncated,
    reward_postprocess,
)
from .rollout_correction import (
    ROLLOUT_CORRECTION_DEFAULTS,
    ROLLOUT_CORRECTION_OPTIONS,
    RolloutCorrectionSettings,
    check_cap,
    rollout_mismatch_metrics,
    rollout_mismatch_per_row,
    sample_logprob_gaps,
    truncated_is_weights,
)

__all__ = [
    "ALGORITHM_KINDS", "KL_CTRL_DEFAULTS", "NORM_MODES", "OVERLONG_MODES", "REWARD_OPTIONS",
    "REWARD_PROCESSING_OPTIONS", "ProcessedRewards", "RewardProcessor", "RunningMoments", "domain_settings",
    "flat_group_rows", "get_sample_level_mask", "process_rewards", "response_truncated", "reward_postprocess", "KL_CTRL_OPTIONS", "KL_KINDS", "ROLLOUT_CORRECTION_DEFAULTS",
    "ROLLOUT_CORRECTION_OPTIONS", "AdaptiveKLController", "KlCtrlSettings", "RewardProcessingSettings",
    "RewardSettings", "RolloutCorrectionSettings",
    "AdvantageInputs", "AlgorithmFunction", "AlgorithmRegistry", "AlgorithmSelection", "FixedKLController",
    "aggregate_metrics", "algorithm_keys", "apply_kl_penalty", "array_namespace", "check_cap",
    "discounted_returns", "dr_grpo", "gae", "get_kl_controller", "group_stats", "grpo", "kl_penalty",
    "masked_whiten", "option_defaults", "reduction", "reinforce_plus_plus", "rloo",
    "rollout_mismatch_metrics", "rollout_mismatch_per_row", "sample_logprob_gaps", "scores_to_token_level",
    "select_algorithms", "truncated_is_weights",
    "unknown_name_error",
]
