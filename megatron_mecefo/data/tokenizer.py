"""A byte-level tokenizer with Megatron-Core's tokenizer interface: no vocabulary file, no download.

Token ids 0..255 are the UTF-8 bytes, 256 is end-of-document, 257 is padding.
"""

from __future__ import annotations

import numpy
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer as MegatronTokenizer

from megatron_mecefo.data import TOKENIZERS

__all__ = ["ByteTokenizer", "NullTokenizer", "TOKENIZERS", "build_tokenizer"]


class ByteTokenizer(MegatronTokenizer):
    EOD = 256
    PAD = 257

    def __init__(self) -> None:
        super().__init__("byte")

    def tokenize(self, text: str) -> numpy.ndarray:
        return numpy.frombuffer(text.encode("utf-8"), dtype=numpy.uint8).astype(numpy.int64)

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    @property
    def vocab(self):
        return {bytes([i]).decode("latin-1"): i for i in range(256)}

    @property
    def inv_vocab(self):
        return {i: bytes([i]).decode("latin-1") for i in range(256)}

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eod(self) -> int:
        return self.EOD

    @property
    def pad(self) -> int:
        return self.PAD


class NullTokenizer(MegatronTokenizer):
    """Token ids as they are: for .bin/.idx files made by another tokenizer (e.g. Megatron's
    tools/preprocess_data.py). Only the vocabulary size is needed; as in Megatron-LM's
    `--tokenizer-type NullTokenizer --vocab-size V`, end-of-document is id V and the model's
    vocabulary is V + 1 (before padding)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or vocab_size < 1:
            raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        super().__init__("null", vocab_size=vocab_size)
        self._size = int(vocab_size)

    def tokenize(self, text: str):
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary")

    @property
    def inv_vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary")

    @property
    def vocab_size(self) -> int:
        return self._size + 1

    @property
    def eod(self) -> int:
        return self._size



def build_tokenizer(tokenizer_type: str = "ByteTokenizer", vocab_size=None) -> MegatronTokenizer:
    """The tokenizer named by Megatron's `--tokenizer-type` (the ones that need no files)."""
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type must be one of {TOKENIZERS}, got {tokenizer_type!r}")
