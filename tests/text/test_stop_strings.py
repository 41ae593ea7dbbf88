"""Stop strings over streamed text (dsv4_ops.text.StopStrings).

Specification:
* the text shown is the full text up to the start of the first stop string to complete (ties: the
  one that starts first), however the text is cut into deltas;
* a stop string may span deltas; what might still become one is held back, never shown and then
  taken back: the text shown so far is always a prefix of the final result;
* with no stop string, ``flush()`` hands out what was held back; bad stop lists raise.
"""
from __future__ import annotations

import random

import pytest

from dsv4_ops.text import StopStrings


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """The full text cut before the stop string that completes first (then the one starting first)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    if not hits:
        return text, False
    return text[: min(hits)[1]], True


def feed(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    checker, shown = StopStrings(stops), ""
    final, _ = reference("".join(deltas), stops)
    for d in deltas:
        text, stopped = checker.push(d)
        shown += text
        assert final.startswith(shown), (shown, final)
        if stopped:
            return shown, True
    return shown + checker.flush(), False


def test_stop_spanning_deltas_is_held_back_then_cut():
    s = StopStrings(["\n\n"])
    assert s.push("x = 1\n") == ("x = 1", False)  # the "\n" might start "\n\n"
    assert s.push("\nprint(x)") == ("", True)
    assert s.matched == "\n\n" and s.push("more") == ("", True) and s.flush() == ""


def test_a_held_prefix_that_does_not_complete_is_released():
    s = StopStrings(["STOP"])
    assert s.push("go ST") == ("go ", False)
    assert s.push("OP") == ("", True)
    s = StopStrings(["STOP"])
    assert s.push("go ST") == ("go ", False)
    assert s.push("Ay") == ("STAy", False)
    assert s.push("ST") == ("", False)
    assert s.flush() == "ST"


def test_first_to_complete_wins_then_first_to_start():
    assert feed(["abc", "b"], ["ab", "c"]) == ("a", True)  # "b" completes before "abc" could
    assert feed(["abc", "bc"], ["abc"]) == ("", True)  # both end at "c": "abc" starts first
    assert feed(["world", "o w"], ["hello world"]) == ("hell", True)


@pytest.mark.parametrize("seed", range(5))
def test_any_cut_into_deltas_gives_the_full_text_result(seed):
    rng = random.Random(seed)
    alphabet = "ab\n ✓"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, max(0, len(text) - 1)))) if len(text) > 1 else []
        deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        assert feed(stops, deltas) == reference(text, stops), (text, stops, deltas)


@pytest.mark.parametrize("stops, match", [("x", "must be a list"), ([""], r"stops\[0\] must be a non-empty"),
                                          (["a", 3], r"stops\[1\] must be a non-empty")])
def test_bad_stop_lists_raise(stops, match):
    with pytest.raises(ValueError, match=match):
        StopStrings(stops)
