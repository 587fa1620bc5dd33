"""Prompt lookup by text: proposals for a value the output is copying from the prompt.

Token n-grams miss the most common copy in extraction: a value's first word in JSON (`"Chloe`) is tokenized
apart from the same word in running text (` Chloe`), so from there on the output's token suffix never occurs in
the prompt. Matching characters instead finds it: the longest suffix of the output's recent text (at least
`MIN_CHARS`) that occurs in the prompt's text, and the text after it, tokenized, is the proposal.

Inside a JSON string the copy usually ends where the prompt's sentence punctuation begins (`Chloe Larsen,
engineering manager` becomes `"Chloe Larsen",`): there the proposal closes the string instead, with the first
closing the grammar takes (`",`, `"}`, `"]`, `"`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

MIN_CHARS = 3
MAX_CHARS = 32
_CONTINUATION_CHARS = 64
# Where a copied span ends inside a JSON string value: a list or clause separator, a line break, a quote, or a
# full stop followed by a space or the end (not the dots of an email address or a number).
_SPAN_END = re.compile(r'[,;\n"]|\.(?=\s|$)')
_CLOSINGS = ('",', '"}', '"]', '"')


@dataclass(slots=True)
class TextLookup:
    """Per engine: encodes continuations and knows the tokens that close a JSON string."""

    encode: Callable[[str], list[int]]
    closings: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def build(cls, encode: Callable[[str], list[int]]) -> TextLookup:
        return cls(encode, tuple(tuple(encode(text)) for text in _CLOSINGS))

    def propose(
        self, prompt_text: str, output_tail: str, *, k: int, in_string: bool
    ) -> tuple[list[int], bool]:
        """(up to `k` tokens continuing `output_tail` as the prompt does, whether the last closes a string
        and should be chosen among `closings` by the grammar); ([], False) when nothing matches."""
        tail = output_tail[-MAX_CHARS:]
        for length in range(len(tail), MIN_CHARS - 1, -1):
            found = prompt_text.rfind(tail[-length:])
            if found >= 0:
                break
        else:
            return [], False
        continuation = prompt_text[found + length : found + length + _CONTINUATION_CHARS]
        closes = False
        if in_string:
            end = _SPAN_END.search(continuation)
            if end is not None:
                continuation, closes = continuation[: end.start()], True
        tokens = self.encode(continuation)[:k] if continuation else []
        if closes and len(tokens) >= k:
            closes = False  # the span runs past the proposal: nothing to close yet
        return tokens, closes
