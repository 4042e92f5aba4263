"""nexrl-grpo: self-hosted GRPO and SFT on torch/transformers, an in-process HF inference engine,
and in-process weight sync."""
