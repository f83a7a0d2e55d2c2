"""The built-in byte-level tokenizer used by toy models and test fixtures.

A real ``PreTrainedTokenizerFast`` (built with the ``tokenizers`` library, no files, no network):
256 byte tokens plus ``<bos> <eos> <pad> <unk>``. Every UTF-8 string round-trips, so text in and
text out work exactly as with a hub model, and all toy models share it (cross-model maps apply).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

SPECIALS = ("<bos>", "<eos>", "<pad>", "<unk>")
BOS_ID, EOS_ID, PAD_ID, UNK_ID = range(4)
VOCAB_SIZE = len(SPECIALS) + 256
NAME = "lensdiv-bytes"


@lru_cache(maxsize=1)
def byte_tokenizer() -> Any:
    """Return the shared byte-level tokenizer (prepends ``<bos>`` like GPT-style bridges expect)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    # TransformerLens re-creates tokenizers without add_bos_token from `name_or_path`;
    # declaring both keeps it from trying (and failing) to load one from the hub.
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos_token=True,
        name_or_path=NAME,
        model_max_length=1 << 20,
    )
