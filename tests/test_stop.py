"""Stop strings over streamed text (runtime/stop.py): what is emitted, what is held back, where text ends."""

from __future__ import annotations

import random

import pytest

from pt2serve.runtime.stop import StopStringMatcher


def feed_all(stops: tuple[str, ...], deltas: list[str]) -> tuple[list[str], bool]:
    """Feed the deltas in order (the last one final) until a stop string hits; the emitted pieces and the hit."""
    matcher = StopStringMatcher(stops)
    emitted = []
    for i, delta in enumerate(deltas):
        text, hit = matcher.feed(delta, is_final=i == len(deltas) - 1)
        emitted.append(text)
        if hit:
            return emitted, True
    return emitted, False


def test_text_without_stop_strings_passes_through():
    matcher = StopStringMatcher(())
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.feed("STOP") == ("STOP", False)
    assert matcher.feed("", is_final=True)[0] == ""


def test_a_false_start_is_held_then_released():
    matcher = StopStringMatcher(("END",))
    assert matcher.feed("the E") == ("the ", False)  # "E" may begin "END": held
    assert matcher.feed("N") == ("", False)  # "EN" still may
    assert matcher.feed("D") == ("", True)  # the stop string is complete: nothing of it is emitted
    matcher = StopStringMatcher(("END",))
    assert matcher.feed("the E") == ("the ", False)
    assert matcher.feed("NT") == ("ENT", False)  # a false start: the held text comes back, in order
    assert matcher.feed("ry") == ("ry", False)


def test_held_text_is_flushed_when_the_request_ends_otherwise():
    matcher = StopStringMatcher(("</s>",))
    assert matcher.feed("done </") == ("done ", False)
    assert matcher.feed("", is_final=True)[0] == "</"
    assert matcher.feed("", is_final=True)[0] == ""  # flushed once


def test_final_delta_releases_what_is_held():
    matcher = StopStringMatcher(("END",))
    assert matcher.feed("x E") == ("x ", False)
    assert matcher.feed("N", is_final=True) == ("EN", False)


def test_a_stop_string_spanning_tokens():
    emitted, hit = feed_all(("stop here",), ["we s", "to", "p", " h", "ere and more"])
    assert hit and "".join(emitted) == "we "
    assert emitted == ["we ", "", "", "", ""]


def test_the_earliest_of_several_stop_strings_wins():
    # "cd" is complete first in the stream, but "b" starts earlier in the text: the text ends before "b".
    assert StopStringMatcher(("cd", "b")).feed("abcd") == ("a", True)
    emitted, hit = feed_all(("world", "lo w"), ["hel", "lo", " w", "orld"])
    assert hit and "".join(emitted) == "hel"
    # Two candidates held at once; the second to start is the one that completes.
    emitted, hit = feed_all(("abc", "bd"), ["a", "b", "d"])
    assert hit and "".join(emitted) == "a"


def test_a_repeated_prefix_is_released_one_character_at_a_time():
    emitted, hit = feed_all(("aab",), ["a", "a", "a", "b"])
    assert hit and "".join(emitted) == "a"  # "aaab" ends before its "aab"
    assert emitted == ["", "", "a", ""]


def test_stop_string_in_the_final_delta_still_hits():
    matcher = StopStringMatcher(("##",))
    assert matcher.feed("a #") == ("a ", False)
    assert matcher.feed("# tail", is_final=True) == ("", True)


def test_empty_stop_strings_are_ignored():
    matcher = StopStringMatcher(("", "x"))
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.feed("yxz") == ("y", True)


@pytest.mark.parametrize("seed", range(5))
def test_any_split_of_the_text_ends_where_the_first_completed_stop_string_starts(seed):
    """Against the definition: generation stops at the first delta after which the text holds a stop string
    (a longer one that started earlier but is not complete yet cannot be known to complete), and the
    output is the text before the earliest stop string found then; with none, all of it."""
    rng = random.Random(seed)
    alphabet = "ab c"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                      for _ in range(rng.randint(1, 3)))
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(0, len(text) - 1)))) if len(text) > 1 else []
        ends = [*cuts, len(text)]
        deltas = [text[a:b] for a, b in zip([0, *cuts], ends)]
        expected, expect_hit = text, False
        for end in ends:
            found = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
            if found:
                expected, expect_hit = text[: min(found)], True
                break
        emitted, hit = feed_all(stops, deltas)
        assert hit == expect_hit, (text, stops, deltas)
        assert "".join(emitted) == expected, (text, stops, deltas)
