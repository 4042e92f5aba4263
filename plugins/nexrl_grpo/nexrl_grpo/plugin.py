"""Entry point of nexrl-grpo: registers its trainers (GRPO, SFT, on-policy distillation) and policy
losses. The model, train service and in-process engine they run on are nexrl-torch's. Registered
lazily: they import torch, which a recipe of other components never loads."""

from nexrl_core import Lazy, hookimpl


@hookimpl
def nexrl_trainers():
    return {"self_hosted_grpo": Lazy("nexrl_grpo.trainers:SelfHostedGrpoTrainer"),
            "self_hosted_cross_entropy": Lazy("nexrl_grpo.trainers:SelfHostedCrossEntropyTrainer"),
            "self_hosted_opd": Lazy("nexrl_grpo.opd:SelfHostedOpdTrainer")}


@hookimpl
def nexrl_policy_losses():  # the names of losses.POLICY_LOSSES
    return {name: Lazy(f"nexrl_grpo.losses:{name}") for name in ("ppo_clip", "dual_clip", "gspo", "topr")}
