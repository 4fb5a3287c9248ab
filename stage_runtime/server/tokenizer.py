"""A byte-level tokenizer for the ``"text"`` field of the HTTP API.

The server needs token ids to drive a pipeline, and the reference models have no vocabulary of
their own, so the server ships the simplest tokenizer that is exact and reversible: the text is
encoded as UTF-8 and every byte becomes one token whose id is the byte's value (``0..255``).

* ``"hi"`` is ``[104, 105]``; ``"é"`` (two UTF-8 bytes) is ``[195, 169]``.
* Equal text prefixes give equal token prefixes, so prompts that share a prefix share cache
  entries exactly as token prompts do.
* The token count of a text is its UTF-8 length in bytes.

It is not a language model's tokenizer (those merge bytes into sub-words); a real deployment
passes ``"tokens"`` produced by the model's own tokenizer. A model with a vocabulary of its own
(a Llama model) tokenizes text with its ``tokenizer.json`` (:class:`HuggingFaceTokenizer`), and
without one refuses it (:class:`NoTokenizer`) rather than take bytes for its ids.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime.errors import ConfigError

__all__ = [
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "NoTokenizer",
    "TextTokenizer",
    "model_tokenizer",
]


@attrs.frozen(kw_only=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids: one token per byte, id equal to the byte value."""

    tokenizer_id: str = "utf8-bytes"
    """Names the scheme in logs and responses."""

    vocab_size: int = 256
    """Number of distinct token ids the tokenizer produces (``0..255``)."""

    def encode(self, text: str) -> npt.NDArray[np.int32]:
        """Turn text into token ids.

        Args:
            text: Any string; lone surrogates are rejected because UTF-8 cannot encode them.

        Returns:
            A 1-D ``int32`` array with one id per UTF-8 byte of ``text``.

        Raises:
            ConfigError: ``text`` cannot be encoded as UTF-8.
        """
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            msg = f"text must be encodable as utf-8, got a lone surrogate at index {exc.start}"
            raise ConfigError(msg) from exc
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, tokens: Sequence[int] | npt.NDArray[np.integer]) -> str:
        """Turn token ids back into text (invalid UTF-8 sequences become U+FFFD).

        Raises:
            ConfigError: a token id lies outside ``0..255``.
        """
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            msg = f"tokens must be byte ids in 0..{self.vocab_size - 1}, got {bad}"
            raise ConfigError(msg)
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class TextTokenizer(Protocol):
    """What the server needs of a tokenizer for the ``"text"`` field."""

    @property
    def tokenizer_id(self) -> str:
        """Names the tokenizer in logs and answers."""
        ...

    def encode(self, text: str) -> npt.NDArray[np.int32]:
        """Token ids of ``text`` (1-D int32); raises ConfigError for text it cannot encode."""
        ...


@attrs.frozen(kw_only=True)
class HuggingFaceTokenizer:
    """A model's own tokenizer, from the ``tokenizer.json`` of its Hugging Face directory
    (through the ``tokenizers`` package: ``pip install 'stage-runtime[llama]'``). Special tokens
    are added as the tokenizer's post-processor says (a Llama tokenizer's leading BOS)."""

    tokenizer_id: str
    _tokenizer: Any = attrs.field(repr=False)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> HuggingFaceTokenizer:
        """Load ``path`` (a ``tokenizer.json``).

        Raises:
            ConfigError: ``tokenizers`` is not installed, or the file cannot be loaded.
        """
        try:
            from tokenizers import Tokenizer
        except ImportError:
            msg = "text needs the tokenizers package: pip install 'stage-runtime[llama]'"
            raise ConfigError(msg) from None
        try:
            loaded = Tokenizer.from_file(os.fspath(path))
        except Exception as exc:  # tokenizers raises its own Exception subclasses
            msg = f"{os.fspath(path)}: cannot load the tokenizer: {exc}"
            raise ConfigError(msg) from None
        return cls(tokenizer_id=os.fspath(path), tokenizer=loaded)

    def encode(self, text: str) -> npt.NDArray[np.int32]:
        """The token ids of ``text``.

        Raises:
            ConfigError: the text cannot be encoded (a lone surrogate).
        """
        try:
            ids = self._tokenizer.encode(text).ids
        except Exception as exc:
            msg = f"text cannot be tokenized: {exc}"
            raise ConfigError(msg) from None
        return np.asarray(ids, dtype=np.int32)


@attrs.frozen(kw_only=True)
class NoTokenizer:
    """Refuses the ``"text"`` field, for a model with a vocabulary of its own whose tokenizer
    the server does not have: byte ids (:class:`ByteTokenizer`) would mean nothing to it."""

    reason: str
    """Why there is none, completing the refusal: ``"the model has none (...)"``."""

    tokenizer_id: str = "none"
    """Names the (missing) tokenizer in logs."""

    def encode(self, text: str) -> npt.NDArray[np.int32]:
        """Refuse ``text``.

        Raises:
            ConfigError: always, saying why and to send token ids in ``tokens`` instead.
        """
        msg = f"text needs the model's own tokenizer, and {self.reason}: send token ids in tokens"
        raise ConfigError(msg)


def model_tokenizer(directory: str | os.PathLike[str]) -> HuggingFaceTokenizer | None:
    """The tokenizer of a model directory (its ``tokenizer.json``), None when it has none."""
    path = Path(directory) / "tokenizer.json"
    return HuggingFaceTokenizer.from_file(path) if path.exists() else None
