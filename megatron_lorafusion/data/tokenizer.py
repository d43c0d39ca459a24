"""Tokenizers: a byte-level one that needs no download, and `transformers`' from a folder.

Byte ids 0..255 are bytes, then pad, bos, eos. `HFTokenizer` wraps ``AutoTokenizer`` (with its
chat template) behind the same ``encode``/``bos_id``/``eos_id`` API.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from megatron_lorafusion.data._errors import DataError


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

    def identity(self) -> str:
        """What the token ids depend on (part of the tokenised-dataset cache key)."""
        return "byte"


class HFTokenizer:
    """A ``transformers.AutoTokenizer`` read from a local folder, behind the same small API.

    Args:
        folder: holds ``tokenizer.json``/``tokenizer_config.json`` (e.g. the model's folder).

    Attributes:
        bos_id: id put before every prompt, or None when the tokenizer has no BOS.
        eos_id: id ending every response (trained on).
        vocab_size: ids in use, special tokens included.

    Raises:
        DataError: when the folder holds no loadable tokenizer or it has no EOS token.
        ImportError: without transformers, naming the ``hf`` extra.
    """

    def __init__(self, folder: str | Path):
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ImportError(
                f"data.tokenizer {str(folder)!r} needs transformers: pip install "
                "'megatron_lorafusion[hf]'"
            ) from err

        self.folder = Path(folder)
        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
        except (OSError, ValueError) as err:
            raise DataError(
                f"data.tokenizer {str(self.folder)!r} holds no loadable tokenizer: {err}"
            ) from err
        if self._tok.eos_token_id is None:
            raise DataError(f"data.tokenizer {str(self.folder)!r} has no EOS token")
        self.bos_id: int | None = self._tok.bos_token_id
        self.eos_id: int = self._tok.eos_token_id
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens kept)."""
        return self._tok.decode(ids)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Token ids of a rendered chat and, per id, 1 inside an assistant turn.

        The text of each assistant turn is what rendering ``messages[:i + 1]`` adds to
        rendering ``messages[:i]`` with the generation prompt (content plus end-of-turn
        marker); segments are tokenised one by one so the mask is exact.

        Raises:
            DataError: when the tokenizer has no chat template, or the template does not
                render a conversation as an extension of its prefixes.
        """
        if not self._tok.chat_template:
            raise DataError(f"data.tokenizer {str(self.folder)!r} has no chat template")
        full = self._render(messages, False)
        ids: list[int] = []
        trained: list[int] = []
        done = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = self._render(messages[:i], True)
            end = self._render(messages[: i + 1], False)
            if not (full.startswith(end) and end.startswith(start) and len(start) >= done):
                raise DataError(
                    "the chat template does not render a conversation as an "
                    "extension of its prefixes; assistant turns cannot be masked"
                )
            for text, flag in ((full[done : len(start)], 0), (full[len(start) : len(end)], 1)):
                piece = self.encode(text)
                ids += piece
                trained += [flag] * len(piece)
            done = len(end)
        rest = self.encode(full[done:])
        return ids + rest, trained + [0] * len(rest)

    def identity(self) -> str:
        """SHA-256 of the tokenizer's files (part of the tokenised-dataset cache key)."""
        digest = hashlib.sha256()
        for path in sorted(self.folder.iterdir()):
            if path.is_file() and path.name.startswith(
                ("tokenizer", "special_tokens", "chat_", "vocab", "merges")
            ):
                digest.update(path.name.encode() + path.read_bytes())
        return digest.hexdigest()


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(name: str, vocab_size: int) -> Tokenizer:
    """The tokenizer named by ``data.tokenizer``: ``byte`` or a local folder.

    Args:
        name: ``"byte"`` or a folder.
        vocab_size: the model's vocabulary size, which must cover every id.

    Raises:
        DataError: for an unloadable folder, or a tokenizer larger than the model's vocabulary.
    """
    tokenizer = ByteTokenizer() if name == "byte" else HFTokenizer(name)
    if tokenizer.vocab_size > vocab_size:
        raise DataError(
            f"data.tokenizer {name!r} has {tokenizer.vocab_size} ids, more than "
            f"model.vocab_size={vocab_size}"
        )
    return tokenizer
