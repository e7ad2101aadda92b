"""A byte-level tokenizer with Megatron-Core's tokenizer interface: no vocabulary file, no download.

Token ids 0..255 are the UTF-8 bytes, 256 is end-of-document, 257 is padding.
"""

from __future__ import annotations

import numpy
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer as MegatronTokenizer

__all__ = ["ByteTokenizer"]


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
