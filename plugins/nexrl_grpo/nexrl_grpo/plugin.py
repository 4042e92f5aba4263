"""Entry point of nexrl-grpo: registers its trainers (GRPO, SFT, on-policy distillation) and policy
losses. The model, train service and in-process engine they run on are nexrl-torch's."""

from nexrl_core import hookimpl

from . import losses
from .opd import SelfHostedOpdTrainer
from .trainers import SelfHostedCrossEntropyTrainer, SelfHostedGrpoTrainer


@hookimpl
def nexrl_trainers():
    return {"self_hosted_grpo": SelfHostedGrpoTrainer, "self_hosted_cross_entropy": SelfHostedCrossEntropyTrainer,
            "self_hosted_opd": SelfHostedOpdTrainer}


@hookimpl
def nexrl_policy_losses():
    return dict(losses.POLICY_LOSSES)
