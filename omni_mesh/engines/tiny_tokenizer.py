"""A small byte-level BPE tokenizer trained in-process, for the tiny test checkpoints: real
tokenizer code, a Qwen-style chat template, nothing downloaded."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Qwen's chat template, reduced to text turns (what the engines send).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Text the BPE merges are learned from: enough variety for short English prompts.
_CORPUS = [
    "Hello, how are you today? I am fine, thank you. What a lovely day it is.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "omni-mesh serves thinker, talker and code2wav stages as a mesh of services.",
    "Speech, audio, text and images: an omni model reads them all and answers aloud.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation . , ; : ! ? ' \" ( ) - are common.",
]


def save_tiny_tokenizer(
    directory: Path, special_tokens: Sequence[str], *, vocab_size: int = 400, named_tokens: dict[str, str] | None = None,
    chat_template: str = CHAT_TEMPLATE,
) -> Any:
    """Train a byte-level BPE of about `vocab_size` ids, add `special_tokens` after it (in order),
    set the chat template, save it into `directory` and return it (a PreTrainedTokenizerFast).
    `named_tokens` names some of them as a multimodal processor reads them (`image_token`: ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown token
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer.add_special_tokens(list(special_tokens))  # ids in the order given, after the BPE's
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(special_tokens),
        model_specific_special_tokens=dict(named_tokens or {}),
    )
    fast.chat_template = chat_template
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return fast
