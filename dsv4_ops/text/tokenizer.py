"""A checkpoint's tokenizer, loaded offline: ``tokenizer.json`` through the ``tokenizers`` library
(no hub, no network), with the BOS / EOS / pad tokens of ``tokenizer_config.json`` when the
directory has one. V4 checkpoints ship exactly these two files and no chat template
(serving_design.md §5): the chat format is ``chat.py``.

>>> tok = load_tokenizer(dsv4_ops.pretrained.tiny())
>>> tok.decode(tok.encode("def f(x):"))
'def f(x):'
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

__all__ = ["Tokenizer", "load_tokenizer"]

# DeepSeek's own names, used when a directory has no tokenizer_config.json
DEFAULT_SPECIAL = dict(bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>", pad_token="<｜▁pad▁｜>")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` (``backend``) plus the names of its BOS / EOS / pad tokens.

    Args:
        backend: the ``tokenizers.Tokenizer``.
        bos_token, eos_token, pad_token: those tokens' strings (None: the tokenizer has none).
        source: where it was loaded from, for error messages.
        model_max_length: ``tokenizer_config.json``'s limit on a sequence's tokens (None: not given).
    """

    def __init__(self, backend, bos_token: str | None = DEFAULT_SPECIAL["bos_token"],
                 eos_token: str | None = DEFAULT_SPECIAL["eos_token"],
                 pad_token: str | None = DEFAULT_SPECIAL["pad_token"], source: str = "the tokenizer",
                 model_max_length: int | None = None) -> None:
        self.backend = backend
        self.source = source
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.model_max_length = model_max_length
        self._literal = None  # a copy that reads special-token strings as plain text (encode_text)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.token_id(self.pad_token)

    def token_id(self, token: str) -> int:
        """The id of one token given by its exact string; a ValueError naming the token and the
        tokenizer when it has no such token."""
        i = self.backend.token_to_id(token)
        if i is None:
            raise ValueError(f"{self.source} has no token {token!r} (a DeepSeek-V4 tokenizer has it; its special "
                             f"tokens: {sorted(self.special_tokens())})")
        return i

    def special_tokens(self) -> dict[str, int]:
        """The added special tokens: string -> id."""
        return {t.content: i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<｜User｜>``) become those tokens.
        Adds nothing (no BOS): V4 tokenizers have no post-processor."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` read as plain text: a special token's string in it is spelled
        with ordinary tokens (what message contents need, so they cannot forge a turn)."""
        if self._literal is None:
            from tokenizers import Tokenizer as Backend

            self._literal = Backend.from_str(self.backend.to_str())
            self._literal.encode_special_tokens = True
        return self._literal.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source}, vocab {self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r})"


def _token_name(value) -> str | None:
    """A ``tokenizer_config.json`` token entry: a string, or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a checkpoint directory (or of a ``tokenizer.json`` file given directly).

    Reads ``tokenizer.json`` and, beside it, ``tokenizer_config.json`` when present (its
    ``bos_token``, ``eos_token``, ``pad_token``, ``model_max_length``); without that file the
    DeepSeek names are assumed. Nothing is downloaded.

    Raises:
        FileNotFoundError: the directory or its ``tokenizer.json`` does not exist (the message names the path).
        ValueError: a file is not valid JSON or not a tokenizer.
    """
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint directory: {path}")
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: the checkpoint directory needs its tokenizer.json")
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(file))
    except Exception as e:  # the library raises a bare Exception for malformed files
        raise ValueError(f"{file} is not a tokenizers tokenizer.json: {e}") from None
    names = dict(DEFAULT_SPECIAL)
    max_len = None
    config = file.parent / "tokenizer_config.json"
    if config.is_file():
        data = _read_json(config)
        for key in names:
            if key in data:
                names[key] = _token_name(data[key])
        limit = data.get("model_max_length")
        max_len = limit if isinstance(limit, int) and 0 < limit < 10**12 else None  # HF writes 1e30 for "none"
    return Tokenizer(backend, **names, source=str(file), model_max_length=max_len)
