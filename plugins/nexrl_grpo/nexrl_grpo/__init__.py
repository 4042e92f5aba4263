"""nexrl-grpo: self-hosted GRPO and SFT on torch/transformers, an in-process HF inference engine,
and in-process weight sync."""

import warnings

# decoding.py passes the KV cache as `past_key_values`, the name every transformers version this
# plugin supports (>= 4.50) accepts; 5.x renamed it `cache` and warns on each run. Only that notice
# is silenced.
warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated and will be removed in version \S+ for "
                                          r"`\w+\.forward`\. Use `cache` instead", category=FutureWarning)
