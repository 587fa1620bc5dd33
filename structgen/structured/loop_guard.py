"""Ending the values a small model loops in: `"Sakura_2026_2026_2026…`, `["Sakura","Sakura","Sakura",…`.

A grammar keeps every such output valid but cannot stop it: the loop runs until `max_tokens` and the output is
cut. `LoopGuard` watches the tokens entering the grammar for a period of 1-16 tokens repeated back to back
(at least `MIN_REPEATS` times over at least `MIN_SPAN` tokens: what content does not do and degenerate loops do
at once), finds the value the repetition sits in (the string or number it lies inside, else the innermost
array whose items repeat) and ends that value by the closing walk (`closing.walk`): the string's quote, the
array's bracket, with whatever the grammar requires before them. A number whose text grows past
`max_number_digits` characters is ended the same way. The grammar checks every byte of that, so the guard
can only ever produce output the grammar accepts; the model then carries on after the ended value.
"""

from __future__ import annotations

from collections.abc import Sequence

from structgen.structured.backend import Grammar
from structgen.structured.closing import ByteTokens, walk
from structgen.structured.json_scan import ARRAY, NUMBER, OBJECT, STRING, JsonScanner

MAX_PERIOD = 16
MIN_REPEATS = 4
MIN_SPAN = 24
DEFAULT_MAX_NUMBER_DIGITS = (
    24  # characters of one JSON number: a double needs 24 at most (-1.2345678901234567e-308)
)
_NUMBER_BYTES = b"0123456789+-.eE"
_MAX_END_BYTES = 64


class LoopGuard:
    """Per sequence: fed every token that enters the grammar; says what to append to end a looping value."""

    __slots__ = ("_offsets", "_runs", "_tokens", "max_number_digits", "tokens")

    def __init__(self, tokens: ByteTokens, *, max_number_digits: int = DEFAULT_MAX_NUMBER_DIGITS):
        self.tokens = tokens
        self.max_number_digits = max_number_digits
        self.reset()

    def reset(self) -> None:
        self._tokens: list[int] = []
        self._offsets: list[int] = []  # byte offset in the output where each token starts
        self._runs = [0] * (MAX_PERIOD + 1)  # _runs[p]: tokens in a row equal to the one p before

    def copy(self) -> LoopGuard:
        twin = LoopGuard(self.tokens, max_number_digits=self.max_number_digits)
        twin._tokens, twin._offsets, twin._runs = list(self._tokens), list(self._offsets), list(self._runs)
        return twin

    def step(
        self, grammar: Grammar, scanner: JsonScanner, new_tokens: Sequence[int], start: int
    ) -> list[int]:
        """Record `new_tokens` (already in the grammar and fed to `scanner`; their bytes begin at output offset
        `start`). Returns the tokens that end a looping value, for the caller to accept, or []."""
        vocab = self.tokens.info.vocab
        loop_start = None
        for token in new_tokens:
            period = self._push(token, start)
            start += len(vocab[token])
            if period:
                loop_start = self._offsets[len(self._tokens) - self._runs[period] - period]
        depth = None
        skip = b""
        if loop_start is not None:
            depth = _looping_value(scanner, loop_start)
        if (
            depth is None
            and self.max_number_digits
            and scanner.innermost == NUMBER
            and scanner.offset - scanner.stack[-1][1] > self.max_number_digits
        ):
            depth, skip = scanner.depth, _NUMBER_BYTES
        if depth is None:
            return []
        found = walk(grammar, self.tokens, scanner, max_bytes=_MAX_END_BYTES, until_depth=depth, skip=skip)
        if not found or not found[0]:
            return []
        self._runs = [0] * (MAX_PERIOD + 1)  # the loop is over: count afresh
        for token in found[0]:
            self._push(token, start)
            start += len(vocab[token])
        return found[0]

    def _push(self, token: int, offset: int) -> int:
        """Append one token; returns the period of a loop it completes, or 0."""
        history, runs = self._tokens, self._runs
        history.append(token)
        self._offsets.append(offset)
        n = len(history)
        found = 0
        for p in range(1, min(MAX_PERIOD, n - 1) + 1):
            if history[n - 1 - p] == token:
                runs[p] += 1
                if not found and runs[p] + p >= MIN_SPAN and runs[p] >= (MIN_REPEATS - 1) * p:
                    found = p
            else:
                runs[p] = 0
        return found


def _looping_value(scanner: JsonScanner, loop_start: int) -> int | None:
    """The depth to close down to (`until_depth`) to end the value a repetition from `loop_start` sits in:
    the string or number it lies inside, else the innermost array it spans items of; None inside an object's
    members alone (nothing the guard may end)."""
    for i in range(len(scanner.stack) - 1, -1, -1):
        kind, begin = scanner.stack[i]
        if begin >= loop_start:
            continue  # opened inside the repetition: part of it
        if kind in (STRING, NUMBER, ARRAY):
            return i + 1
        if kind == OBJECT:
            return None
    return None
