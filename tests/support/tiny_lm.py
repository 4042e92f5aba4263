"""Tiny causal LMs for tests: a 2-layer Llama and a byte-level BPE tokenizer, built offline in seconds."""

from __future__ import annotations

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


def build_model(tokenizer, seed: int = 0, max_positions: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        # Wider init than a real model: peaked logits keep greedy argmax away from near-ties.
        initializer_range=0.2,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


TOOL_CORPUS = CORPUS + [
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "# Tools\n\nYou can call these functions (JSON schemas, one per line):",
    '{"name": "add", "description": "Adds two numbers.", "parameters": {"type": "object", "properties": '
    '{"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}',
    "What is 2 + 3? The answer is 5. tool system user assistant",
] * 4


def build_byte_tokenizer(corpus: list[str] = TOOL_CORPUS, vocab_size: int = 420):
    """A byte-level BPE tokenizer that can encode any text (all 256 byte symbols are in its
    vocabulary), merged on ``corpus``; same specials and chat template as :func:`build_tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok
