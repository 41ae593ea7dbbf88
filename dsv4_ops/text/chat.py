"""DeepSeek-V4's chat format, written from its description (serving_design.md §5).

A conversation is ``<｜begin▁of▁sentence｜>``, the system prompt(s) as plain text, then the turns::

    user turn        <｜User｜>{content}
    assistant turn   <｜Assistant｜></think>{content}<｜end▁of▁sentence｜>                    reasoning not shown
                     <｜Assistant｜><think>{reasoning_content}</think>{content}<｜end▁of▁sentence｜>   shown
    generation       <｜Assistant｜><think>     (thinking mode: the model writes its reasoning, ``</think>``,
                                               then the answer)
                     <｜Assistant｜></think>    (chat mode: the answer directly)

Reasoning is shown only in thinking mode, and with ``drop_thinking=True`` (the default) only for
assistant turns after the last user message: earlier turns keep their answers and lose their
reasoning, as the model saw conversations in training. Tools (DSML tags, ``<tool_result>``) and
``reasoning_effort`` are not encoded yet.

``encode_chat`` gives the string, ``encode_chat_ids`` the token ids: special tokens by id and
message text read as plain text (a message cannot forge a turn by containing ``<｜User｜>``); the
two agree (``tokenizer.encode(encode_chat(m)) == encode_chat_ids(tokenizer, m)``) whenever no
message contains a special token's string.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

__all__ = ["BOS", "EOS", "USER", "ASSISTANT", "THINK_START", "THINK_END", "SPECIAL_TOKENS", "encode_chat",
           "encode_chat_ids", "chat_segments"]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)
ROLES = ("system", "user", "assistant")


class Segment(NamedTuple):
    """A piece of an encoded conversation: a special token (by its string) or plain text."""

    text: str
    special: bool


def _content(i: int, message: Mapping, key: str, optional: bool) -> str:
    """``message[key]`` as a string: a string, or OpenAI-style text parts ``[{"type": "text", "text": ...}]``."""
    role = message["role"]
    if key not in message or message[key] is None:
        if optional:
            return ""
        raise ValueError(f"messages[{i}] ({role}) has no {key!r}")
    value = message[key]
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        parts = []
        for j, part in enumerate(value):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"messages[{i}] ({role}) {key}[{j}] must be a text part "
                                 f"{{'type': 'text', 'text': str}}, got {part!r:.80}")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"messages[{i}] ({role}) {key} must be a string or a list of text parts, "
                     f"got {type(value).__name__}")


def _check(messages) -> list[tuple[str, str, str]]:
    """``messages`` -> ``(role, content, reasoning)`` per message, or a ValueError saying what is wrong."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one user message")
    out, prev = [], None
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            what = "has no 'role'" if role is None else f"has unknown role {role!r}"
            raise ValueError(f"messages[{i}] {what}; roles are {', '.join(ROLES)}")
        if m.get("tool_calls"):
            raise ValueError(f"messages[{i}] ({role}) has tool_calls: tool calls are not encoded yet")
        if role != "assistant" and m.get("reasoning_content") is not None:
            raise ValueError(f"messages[{i}] ({role}) has reasoning_content: only assistant messages have one")
        content = _content(i, m, "content", optional=role == "assistant")
        reasoning = _content(i, m, "reasoning_content", optional=True) if role == "assistant" else ""
        if role == "system" and prev not in (None, "system"):
            raise ValueError(f"messages[{i}]: a system message after the conversation started; system messages "
                             "come first")
        if role == "assistant" and prev != "user":
            raise ValueError(f"messages[{i}]: an assistant message must follow a user message, not "
                             f"{'the start' if prev in (None, 'system') else prev + ' message'}")
        if role == "user" and prev == "user":
            raise ValueError(f"messages[{i}]: two user messages in a row; merge them into one")
        out.append((role, content, reasoning))
        prev = role
    return out


def chat_segments(messages: Sequence[Mapping], thinking: bool = False, drop_thinking: bool = True,
                  add_generation_prompt: bool = True) -> list[Segment]:
    """The encoded conversation as special tokens and plain-text pieces (empty texts left out);
    arguments as :func:`encode_chat`."""
    turns = _check(messages)
    if add_generation_prompt and turns[-1][0] != "user":
        last = "only system messages" if turns[-1][0] == "system" else "an assistant turn"
        raise ValueError(f"the conversation ends with {last} (messages[{len(turns) - 1}]); add_generation_prompt=True "
                         "needs it to end with a user message (or pass add_generation_prompt=False)")
    last_user = max((i for i, (role, _, _) in enumerate(turns) if role == "user"), default=-1)
    out = [Segment(BOS, True)]

    def text(s: str) -> None:
        if s:
            out.append(Segment(s, False))

    for i, (role, content, reasoning) in enumerate(turns):
        if role == "system":
            text(content)
        elif role == "user":
            out.append(Segment(USER, True))
            text(content)
        else:
            out.append(Segment(ASSISTANT, True))
            if thinking and (not drop_thinking or i > last_user):
                out.append(Segment(THINK_START, True))
                text(reasoning)
            out.append(Segment(THINK_END, True))
            text(content)
            out.append(Segment(EOS, True))
    if add_generation_prompt:
        out += [Segment(ASSISTANT, True), Segment(THINK_START if thinking else THINK_END, True)]
    return out


def encode_chat(messages: Sequence[Mapping], thinking: bool = False, drop_thinking: bool = True,
                add_generation_prompt: bool = True) -> str:
    """A conversation in DeepSeek-V4's chat format, as a string.

    Args:
        messages: ``{"role": "system" | "user" | "assistant", "content": str}`` dicts (content may
            also be OpenAI text parts): system messages first, then user and assistant turns in
            turn; an assistant message may carry ``reasoning_content``.
        thinking: thinking mode (the generation prompt opens ``<think>``) or chat mode (``</think>``).
        drop_thinking: leave out the reasoning of assistant turns before the last user message
            (thinking mode only; chat mode never shows reasoning).
        add_generation_prompt: end with the assistant's opening (the conversation must end with a
            user message); False encodes the messages only (e.g. a finished conversation).

    Raises:
        ValueError: a malformed conversation (unknown role, missing content, turns out of order,
            tool calls, no final user message when a generation prompt is asked); the message
            names the offending ``messages[i]``.

    >>> encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    '<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>'
    """
    return "".join(s.text for s in chat_segments(messages, thinking, drop_thinking, add_generation_prompt))


def encode_chat_ids(tokenizer, messages: Sequence[Mapping], thinking: bool = False, drop_thinking: bool = True,
                    add_generation_prompt: bool = True) -> list[int]:
    """:func:`encode_chat`'s conversation as token ids of ``tokenizer`` (a ``dsv4_ops.text.Tokenizer``):
    special tokens by id, message text as plain text. A ValueError names a V4 special token the
    tokenizer lacks."""
    ids = []
    for seg in chat_segments(messages, thinking, drop_thinking, add_generation_prompt):
        ids += [tokenizer.token_id(seg.text)] if seg.special else tokenizer.encode_text(seg.text)
    return ids
