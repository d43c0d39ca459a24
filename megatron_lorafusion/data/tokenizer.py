"""A byte-level tokenizer that needs no download: ids 0..255 are bytes, then pad, bos, eos."""

from __future__ import annotations


class ByteTokenizer:
    """UTF-8 bytes as tokens.

    Attributes:
        pad_id: 256, never trained on.
        bos_id: 257, starts every sample.
        eos_id: 258, ends every sample (and is trained on, so the model learns to stop).
        vocab_size: 259.
    """

    pad_id = 256
    bos_id = 257
    eos_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special tokens are dropped, broken UTF-8 is replaced."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
