"""nexrl-torch: the torch + transformers backend. ``models`` and ``logprobs`` are shared by
``train/`` (the ``local_torch`` train service and its ranks) and ``rollout/`` (the ``hf``
in-process engine and the ``in_process`` weight sync); neither side imports the other."""

import warnings

# decoding.py passes the KV cache as `past_key_values`, the name every transformers version this
# backend supports (>= 4.50) accepts; 5.x renamed it `cache` and warns on each run. Only that notice
# is silenced.
warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated and will be removed in version \S+ for "
                                          r"`\w+\.forward`\. Use `cache` instead", category=FutureWarning)
