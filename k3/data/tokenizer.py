"""Tokenizers: a byte-level fallback (no training needed) and byte-level BPE via the `tokenizers` library."""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS = "<|endoftext|>"


def byte_level_tokenizer() -> Tokenizer:
    """Id 0 is the end-of-text token; ids 1..256 are the 256 bytes. Every string round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {EOS: 0}
    for i, ch in enumerate(sorted(alphabet)):
        vocab[ch] = i + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load `tokenizer.json` from a file or a checkpoint directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(path)
