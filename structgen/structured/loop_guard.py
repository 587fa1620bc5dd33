"""Ending the values a small model loops in: `"Sakura_2026_2026_2026…`, `["Sakura","Sakura","Sakura",…`.

A grammar keeps every such output valid but cannot stop it: the loop runs until `max_tokens` and the output is
cut. `LoopGuard` watches the tokens entering the grammar for a period of 1-32 tokens repeated back to back
(at least `MIN_REPEATS` times over at least `MIN_SPAN` tokens: what content does not do and degenerate loops do
at once), finds the value the repetition sits in (the string or number it lies inside, else the innermost
array whose items repeat) and ends that value by the closing walk (`closing.walk`): the string's quote, the
array's bracket, with whatever the grammar requires before them. A number whose text grows past
`max_number_digits` characters is ended the same way. Where whole top-level values repeat (the same tool call
over and over) the output itself is ended, by its shortest completion. The grammar checks every byte of that,
so the guard can only ever produce output the grammar accepts; the model then carries on after the ended value.
"""

from __future__ import annotations

from collections.abc import Sequence

from structgen.structured.backend import Grammar
from structgen.structured.closing import ByteTokens, walk
from structgen.structured.json_scan import ARRAY, NUMBER, OBJECT, STRING, JsonScanner

MAX_PERIOD = 32
MIN_REPEATS = 4
MIN_SPAN = 24
DEFAULT_MAX_NUMBER_DIGITS = (
    24  # characters of one JSON number: a double needs 24 at most (-1.2345678901234567e-308)
)
_NUMBER_BYTES = b"0123456789+-.eE"
_MAX_END_BYTES = 64


class LoopGuard:
    """Per sequence: fed every token that enters the grammar; says what to append to end a looping value."""

    __slots__ = ("_offsets", "_quiet_until", "_seen", "_tokens", "hints", "max_number_digits", "tokens")

    def __init__(
        self,
        tokens: ByteTokens,
        *,
        max_number_digits: int = DEFAULT_MAX_NUMBER_DIGITS,
        hints: Sequence[bytes] = (),
    ):
        self.tokens = tokens
        self.max_number_digits = max_number_digits
        self.hints = tuple(hints)
        self.reset()

    def reset(self) -> None:
        self._tokens: list[int] = []
        self._offsets: list[int] = []  # byte offset in the output where each token starts
        self._quiet_until = 0  # after an ended loop, its tokens no longer count as a repetition
        # token -> its indices among the last MAX_PERIOD + 1 tokens: the only periods a new token can close
        self._seen: dict[int, list[int]] = {}

    def copy(self) -> LoopGuard:
        twin = LoopGuard(self.tokens, max_number_digits=self.max_number_digits, hints=self.hints)
        twin._tokens, twin._offsets = list(self._tokens), list(self._offsets)
        twin._quiet_until = self._quiet_until
        twin._seen = {token: list(at) for token, at in self._seen.items()}
        return twin

    def step(
        self,
        grammar: Grammar,
        scanner: JsonScanner,
        new_tokens: Sequence[int],
        start: int,
        *,
        room: int | None,
    ) -> tuple[list[int], bool]:
        """Record `new_tokens` (already in the grammar and fed to `scanner`; their bytes begin at output offset
        `start`). Returns the tokens that end a looping value, for the caller to accept ([] if none), and whether
        they end the whole output (the repetition spans whole top-level values: the same tool call again and
        again). `room`: the tokens the output may still take (None: no limit); an ending that does not fit is
        left to the budget closing."""
        vocab = self.tokens.info.vocab
        loop_start = None
        for token in new_tokens:
            span = self._push(token, start)
            start += len(vocab[token])
            if span and len(self._tokens) - span >= self._quiet_until:
                loop_start = self._offsets[len(self._tokens) - span]
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
            return [], False
        until = depth or None  # 0: end the output, to where the grammar may end
        found = walk(
            grammar,
            self.tokens,
            scanner,
            max_bytes=_MAX_END_BYTES,
            until_depth=until,
            skip=skip,
            hints=self.hints,
        )
        if not found or (until is not None and not found[0]) or (room is not None and len(found[0]) > room):
            if loop_start is not None:
                # This repetition cannot be ended here (an array below its minItems, a walk past its bytes):
                # count afresh instead of walking again at each of its next tokens (≈ 1 failed walk a step on
                # 32 outputs of repeated records, 3.5 ms of a 185 ms SmolLM2 step, BENCHMARKS.md issue 22).
                self._quiet_until = len(self._tokens)
            return [], False
        for token in found[0]:
            self._push(token, start)
            start += len(vocab[token])
        self._quiet_until = len(self._tokens)  # the loop is over: count afresh
        return found[0], until is None

    def _push(self, token: int, offset: int) -> int:
        """Append one token; returns the length of the looping stretch it completes (ending here), or 0."""
        history = self._tokens
        history.append(token)
        self._offsets.append(offset)
        n = len(history)
        # A period p needs history[n - 1 - p] == token: only the token's own recent places are candidates
        # (checking every period up to 32 a token was most of the guard's time on outputs with many tokens).
        at = self._seen.get(token)
        if at is None:
            self._seen[token] = [n - 1]
            return 0
        oldest = n - 2 - MAX_PERIOD
        if at[0] < oldest:
            at[:] = [i for i in at if i >= oldest]
        found = 0
        longest = min(MAX_PERIOD, n // MIN_REPEATS)
        for i in reversed(at):  # the shortest period first, as before
            p = n - 1 - i
            if p > longest:
                break
            span = max(MIN_REPEATS * p, -(-MIN_SPAN // p) * p)
            if span <= n and history[n - span + p :] == history[n - span : n - p]:
                found = span
                break
        at.append(n - 1)
        return found


def _looping_value(scanner: JsonScanner, loop_start: int) -> int | None:
    """The depth to close down to (`until_depth`) to end the value a repetition from `loop_start` sits in:
    the string or number it lies inside, else the innermost array it spans items of; 0 when it spans whole
    top-level values (the output is ended); None inside an object's members alone (nothing the guard may end)."""
    for i in range(len(scanner.stack) - 1, -1, -1):
        kind, begin = scanner.stack[i]
        if begin >= loop_start:
            continue  # opened inside the repetition: part of it
        if kind in (STRING, NUMBER, ARRAY):
            return i + 1
        if kind == OBJECT:
            return None
    return 0
