"""nexrl-grpo: the self-hosted GRPO and SFT algorithms (trainers, losses, critic). They train through
nexrl-torch's local train service and generate with its in-process engine."""
