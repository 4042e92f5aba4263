"""nexrl-grpo: the self-hosted GRPO, SFT and on-policy distillation algorithms (trainers, losses,
critic). They train through nexrl-torch's local train service and generate with its in-process engine."""
