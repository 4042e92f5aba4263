"""Tiny models for the GRPO plugin tests: a 2-layer Llama and a byte-level BPE tokenizer built offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is two plus three? the answer is five.",
    "count: one, two, three, four, five, six, seven, eight, nine, ten",
    "hello world! grpo trains language models with group relative advantages",
    "user\nassistant\nsystem\n",
] * 4


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=200,
        special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        # Only the corpus's (ASCII) characters: any token sequence then decodes to clean text,
        # so prefixes of a decoded response are decodings of prefixes of its tokens.
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tokenizer, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        # Wider init than a real model: peaked logits keep greedy argmax away from near-ties.
        initializer_range=0.2,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and OpenMP barriers stall badly when the
    other core is busy (tests often share the machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """An HF folder (safetensors + tokenizer) holding the tiny model, built once per session."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture()
def tiny_model_and_tokenizer(tiny_model_dir):
    from nexrl_grpo.modeling import load_causal_lm

    return load_causal_lm(tiny_model_dir)


@pytest.fixture()
def build_tiny_model():
    """``build(tokenizer, seed)``: a fresh tiny model (different seeds give different weights)."""
    return build_model
