"""Streaming text out of token ids: incremental detokenisation and stop strings.

A byte-level BPE token can hold part of a UTF-8 character (a CJK character or an emoji is often
two or three tokens), so decoding each token alone prints replacement characters. ``Detokenizer``
decodes a short window of recent tokens and hands out text only up to a point where the bytes
form whole characters, holding back the rest until later tokens complete them (the offsets
scheme of HF text-generation-inference, written for this API).

``StopStrings`` cuts the text at the first stop string, which may span deltas: it holds back any
ending that could still grow into a stop string until it does or cannot.
"""
from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["Detokenizer", "StopStrings"]

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Token ids in, one at a time; text deltas out.

    Guarantees, for any ids: the deltas of ``push`` (and ``extend``) followed by ``flush()``
    concatenate to ``tokenizer.decode(ids, skip_special_tokens)``; every delta is text that
    decode shows at that place (no replacement character for a character split across tokens:
    incomplete bytes wait for the token that completes them); special tokens appear, or not,
    as ``decode`` shows them.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``: a
            ``dsv4_ops.text.Tokenizer`` or a ``tokenizers.Tokenizer``.
        skip_special_tokens: as ``decode``'s (default True: special tokens print nothing).

    >>> detok = Detokenizer(tok)
    >>> "".join(detok.push(i) for i in tok.encode("中文")) + detok.flush()
    '中文'
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # what the deltas handed out so far
        # ids[prefix:read] decoded to the text that ended the last delta (context for the next
        # window, so decoders that treat a sequence's start specially see the same start);
        # ids[read:] are not handed out yet
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; the text it completes ("" while the window ends inside a character)."""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        # hand out text only when the window grew past the context and ends on a whole character
        # (bytes cut short decode to a trailing replacement character)
        if len(window) <= len(before) or window.endswith(REPLACEMENT) or not window.startswith(before):
            return ""
        delta = window[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def extend(self, token_ids: Iterable[int]) -> str:
        """``push`` each of ``token_ids``; their deltas joined."""
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """The text still held back, as ``decode`` shows it (replacement characters for bytes
        that never completed); call it when the sequence ends."""
        before = self._decode(self.ids[self._prefix:self._read])
        delta = self._decode(self.ids[self._prefix:])[len(before):]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta


class StopStrings:
    """Cuts streamed text at the first stop string.

    ``push(delta)`` returns ``(text, stopped)``: the text that may be shown now, and whether a
    stop string has completed (the text then ends just before it, and the stream should end).
    The first stop string is the one that completes first; of several that complete at the
    same character, the one that starts first. The result never depends on how the text was
    cut into deltas: the pushed texts joined equal the full text up to the start of that stop
    string. Text that might begin a stop string is held back until it is known not to.

    Args:
        stops: the stop strings (non-empty strings).

    >>> stops = StopStrings(["\\n\\n"])
    >>> stops.push("x = 1\\n"), stops.push("\\nprint(x)")
    (('x = 1', False), ('', True))
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str) or not isinstance(stops, (list, tuple)):
            raise ValueError(f"stops must be a list of strings, got {type(stops).__name__}")
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stops[{i}] must be a non-empty string, got {s!r}")
        self.stops = tuple(dict.fromkeys(stops))
        self.matched: str | None = None  # the stop string that ended the text
        self._held = ""

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, delta: str) -> tuple[str, bool]:
        """The text of ``delta`` (with what was held back before it) that can be shown now, and
        whether a stop string completed. After a stop, pushes return ``("", True)``."""
        if self.stopped:
            return "", True
        # no stop string can start in text already shown (it was never a possible stop prefix),
        # and none completed before this delta, so every candidate lies in held + delta
        buf = self._held + delta
        first = None  # (end, start, stop)
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first is None or (i + len(s), i) < first[:2]):
                first = (i + len(s), i, s)
        if first is not None:
            self.matched, self._held = first[2], ""
            return buf[: first[1]], True
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:n])), default=0)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, when the stream ends without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
