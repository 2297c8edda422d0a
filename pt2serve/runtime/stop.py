"""Stop strings over streamed text: emit what cannot be the start of a stop string, hold back the rest."""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop_strings: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stop_strings if s)
        self._held = ""

    def feed(self, delta: str, is_final: bool = False) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit); text from the stop string on is dropped."""
        if not self._stops:
            return delta, False
        text = self._held + delta
        hits = [i for i in (text.find(stop) for stop in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return text[: min(hits)], True
        if is_final:
            self._held = ""
            return text, False
        hold = max((_overlap(text, stop) for stop in self._stops), default=0)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for length in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-length:]):
            return length
    return 0
