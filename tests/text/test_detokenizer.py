"""Streaming detokenisation (dsv4_ops.text.Detokenizer) on the bundled byte-level BPE.

Specification, fed token by token:
* the deltas (then ``flush()``) join to ``tokenizer.decode(all ids)``, with and without special
  tokens, for text and for random ids (bytes that never form a character included);
* the text handed out so far is always a prefix of that full decode, so no delta carries a
  replacement character the full decode does not have; on real text (CJK, emoji with modifiers
  and joiners, combining marks, whitespace, code) no delta has one at all, though single tokens
  of it decode to broken bytes.
"""
from __future__ import annotations

import random

import pytest

import dsv4_ops
from dsv4_ops.text import Detokenizer, load_tokenizer

TEXTS = {
    "cjk": "中文分词测试：你好，世界。日本語のテキスト",
    "emoji": "ok 👍🏽 family 👨‍👩‍👧 flag 🇫🇷 done",
    "combining": "e\u0301te\u0301 n\u0303 a\u0308\u0304 Z\u0351\u0352",
    "whitespace": "  a\t\tb\n\n\n   c \r\n\u00a0\u2003 end  ",
    "code": 'def f(x: int) -> str:\n    """Doc."""\n    return f"{x!r:>8}"  # 注释 ✓\n',
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(dsv4_ops.pretrained.tiny())


def stream(tok, ids, skip_special_tokens=True):
    """Feed ids one at a time: the deltas, then the flushed rest, checking each step against the full decode."""
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    detok = Detokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = []
    for i in ids:
        deltas.append(detok.push(i))
        assert full.startswith(detok.text), (detok.text, full)
    deltas.append(detok.flush())
    assert "".join(deltas) == full == detok.text
    return deltas


@pytest.mark.parametrize("name", TEXTS)
def test_text_streams_back_whole_characters(name, tok):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # byte-level BPE round-trips
    deltas = stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas)
    if name in ("cjk", "emoji", "combining"):  # the case that needs holding back: tokens inside a character
        assert any("\ufffd" in tok.decode([i]) for i in ids)
        assert "" in deltas[:-1]


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_as_the_full_decode_shows_them(skip, tok):
    ids = [0] + tok.encode("中") + [3] + tok.encode("文 x") + [5, 1]
    # a special token between a character's bytes too
    cjk = tok.encode("语")
    ids += cjk[:1] + [4] + cjk[1:]
    deltas = stream(tok, ids, skip_special_tokens=skip)
    assert ("<｜User｜>" in "".join(deltas)) is not skip


def test_random_ids_join_to_the_full_decode(tok):
    rng = random.Random(0)
    vocab = tok.vocab_size
    for _ in range(300):
        ids = [rng.randrange(vocab) if rng.random() > 0.1 else rng.randrange(7) for _ in range(rng.randint(1, 24))]
        stream(tok, ids, skip_special_tokens=rng.random() < 0.5)


def test_extend_is_push_each(tok):
    ids = tok.encode(TEXTS["emoji"])
    a, b = Detokenizer(tok), Detokenizer(tok)
    assert a.extend(ids) + a.flush() == "".join(b.push(i) for i in ids) + b.flush() == TEXTS["emoji"]
    assert a.ids == ids
