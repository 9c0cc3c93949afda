"""A byte-level tokenizer for the named (randomly initialised) models, built locally with `tokenizers`.

One token per byte (ids 0-255, GPT-2's byte-to-unicode alphabet) plus ChatML special tokens, and a ChatML chat
template, so every text round-trips and the ids fit any vocabulary of at least 260 entries.
"""

from __future__ import annotations

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` with 256 byte tokens + 4 special tokens (vocab size 260)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(alphabet) == 256
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   bos_token=None, unk_token=None, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 30
    return fast
