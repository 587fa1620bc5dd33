"""Stop strings over a stream of text deltas.

A stop string can arrive split across tokens ("<|" then "end|>"), so the text that could still become one
is held back: after each delta, the longest tail of the pending text that is a proper prefix of some stop
string stays pending, everything before it is safe to show. A stop string therefore never leaks into the
stream, not even partly, and the output is cut exactly at it.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopChecker:
    """Feed text deltas with `push`; get back (text safe to emit now, the stop string matched or None).

    On a match the emitted text ends right before the stop string (right after it with
    `include_stop_str_in_output`) and the checker is finished: later pushes return ("", that stop).
    When several stop strings match, the one that starts first wins (the longest, if they start together).
    """

    __slots__ = ("_include", "_pending", "_stops", "matched")

    def __init__(self, stop: Iterable[str], *, include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            stop = [stop]
        stops = list(stop)
        for s in stops:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}: {s!r}")
            if not s:
                raise ValueError("stop strings must be non-empty")
        # Longest first so that, among matches starting at the same place, the longest wins.
        self._stops = tuple(sorted(set(stops), key=len, reverse=True))
        self._include = include_stop_str_in_output
        self._pending = ""
        self.matched: str | None = None

    @property
    def pending(self) -> str:
        """Text held back because it may be the start of a stop string."""
        return self._pending

    def push(self, delta: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", self.matched
        if not self._stops:
            return delta, None
        text = self._pending + delta
        best_start, best_stop = -1, None
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best_start < 0 or start < best_start):
                best_start, best_stop = start, stop
        if best_stop is not None:
            self.matched = best_stop
            self._pending = ""
            end = best_start + len(best_stop) if self._include else best_start
            return text[:end], best_stop
        hold = self._partial_tail(text)
        self._pending = text[len(text) - hold :]
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """At the end of generation, the held-back text is not a stop string after all: release it."""
        if self.matched is not None:
            return ""
        pending, self._pending = self._pending, ""
        return pending

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
