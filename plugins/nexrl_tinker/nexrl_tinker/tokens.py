"""Prompt tokenization shared by the sampler (rollouts) and the trainer (text-only SFT data), so both
see the same token ids for the same prompt."""

from __future__ import annotations

from typing import Any

from nexrl_core import ConfigError


def load_tokenizer(folder: str, key: str) -> Any:
    """The tokenizer saved in a local ``folder`` (nothing is downloaded); ConfigError naming ``key``."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: no tokenizer in '{folder}' ({exc})") from None


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], chat_template: bool = True) -> list[int]:
    """Token ids of a text prompt, or of chat messages rendered with the tokenizer's chat template and
    its generation prompt (``chat_template`` false: the message contents joined by newlines)."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt).input_ids)
    if chat_template:
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(str(m.get("content", "")) for m in prompt)
    # The template already holds every special token it wants.
    return list(tokenizer(text, add_special_tokens=False).input_ids)
