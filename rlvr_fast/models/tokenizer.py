"""Tokenizer of a Hugging Face checkpoint directory, read with the ``tokenizers`` library.

Only ``tokenizer.json`` is needed; the end-of-sequence ids come from ``generation_config.json``,
then ``config.json``, then the ``eos_token`` named in ``tokenizer_config.json``, the order in which
Hugging Face's ``generate`` resolves them. No special tokens are added on encode: the study feeds
Qwen3-Base the plain prompt text.

Text is text: ``encode`` reads a special token's spelling inside the text (``<|endoftext|>`` in
a question) as the ordinary characters it is, never as the special token, so no data file can
end a prompt early or inject a control token. ``encode(text, special_tokens=True)`` parses them
(a chat-templated prompt, as TRL's tokenizer does).

The files are read bounded and must be regular files inside the model directory
(``rlvr_fast.utils.files.model_file``): a FIFO or a link out of the directory is refused.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer

from rlvr_fast.utils.files import UnreadableFileError, model_file, read_json, read_text

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


# Qwen3's tokenizer.json is 11 MB; the caps are checked before reading.
MAX_TOKENIZER_BYTES = 256 << 20
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20


class TokenizerError(ValueError):
    """A checkpoint directory has no usable tokenizer or no end-of-sequence token."""


class Tokenizer:
    def __init__(self, backend: RustTokenizer, eos_token_ids: list[int], pad_token_id: int) -> None:
        if not eos_token_ids:
            raise TokenizerError("tokenizer: no end-of-sequence token id")
        backend.encode_special_tokens = True
        self.backend = backend
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]:
        backend = self.markup_backend if special_tokens else self.backend
        return backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], *, special_tokens: bool = False) -> list[list[int]]:
        backend = self.markup_backend if special_tokens else self.backend
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    @functools.cached_property
    def markup_backend(self) -> RustTokenizer:
        """A copy of the backend that parses special tokens' spellings in the text."""
        backend = RustTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = False
        return backend

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, rows: list[list[int]], *, skip_special_tokens: bool = True) -> list[str]:
        return self.backend.decode_batch(
            [list(r) for r in rows], skip_special_tokens=skip_special_tokens
        )

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @functools.cached_property
    def newline_token_ids(self) -> frozenset[int]:
        """Ids whose text contains a newline: the boundaries tree rollouts may split at."""
        texts = self.decode_batch([[i] for i in range(self.vocab_size)])
        return frozenset(i for i, text in enumerate(texts) if "\n" in text)

    @classmethod
    def from_directory(cls, directory: str | Path) -> "Tokenizer":
        directory = Path(directory)
        path = _model_file(directory, "tokenizer.json")
        if path is None:
            raise TokenizerError(f"{directory}: no tokenizer.json")
        try:
            text = read_text(path, MAX_TOKENIZER_BYTES, "tokenizer")
            backend = RustTokenizer.from_str(text)
        except UnreadableFileError as err:
            raise TokenizerError(str(err)) from None
        except Exception as err:  # the tokenizers library raises a bare Exception
            raise TokenizerError(
                f"{path}: unreadable tokenizer ({str(err).splitlines()[0]})"
            ) from None
        tok_config = _read_json(directory, "tokenizer_config.json")
        eos = _eos_ids(directory, tok_config, backend)
        pad = _token_id(tok_config.get("pad_token"), backend)
        return cls(backend, eos, eos[0] if pad is None else pad)


def _model_file(directory: Path, name: str) -> Path | None:
    try:
        return model_file(directory, name)
    except UnreadableFileError as err:
        raise TokenizerError(str(err)) from None


def _read_json(directory: Path, name: str) -> dict:
    path = _model_file(directory, name)
    if path is None:
        return {}
    try:
        data = read_json(path, MAX_TOKENIZER_CONFIG_BYTES, "tokenizer config")
    except UnreadableFileError as err:
        raise TokenizerError(str(err)) from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_id(token: str | dict | None, backend: RustTokenizer) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _eos_ids(directory: Path, tok_config: dict, backend: RustTokenizer) -> list[int]:
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(directory, name).get("eos_token_id")
        if eos is None:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or not all(
            isinstance(i, int)
            and not isinstance(i, bool)
            and 0 <= i < backend.get_vocab_size(with_added_tokens=True)
            for i in ids
        ):
            raise TokenizerError(
                f"{directory / name}: eos_token_id must be token ids of the tokenizer, got {eos!r}"
            )
        return ids
    eos = _token_id(tok_config.get("eos_token"), backend)
    if eos is None:
        raise TokenizerError(
            f"{directory}: no eos_token_id in generation_config.json or "
            "config.json and no eos_token in tokenizer_config.json"
        )
    return [eos]
