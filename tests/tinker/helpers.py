"""Constants and datum builders shared by the Tinker tests."""

from __future__ import annotations

import numpy as np

API_KEY = "tml-test-0123456789"
MODEL = "tiny"


def sft_datum(tokenizer, text: str, prompt_len: int = 3):
    """A cross-entropy datum over ``text``: targets are the next tokens, the first ``prompt_len - 1`` unweighted."""
    from tinker import types

    ids = tokenizer(text).input_ids
    weights = np.ones(len(ids) - 1, dtype=np.float32)
    weights[:prompt_len - 1] = 0.0
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(ids[1:], dtype=np.int64), "weights": weights})
