"""Partial JSON: the value a prefix of a JSON document already determines, for streaming partial objects.

The rule (one for every position, so a partial value never has to be taken back):

- objects and arrays appear as soon as they open, holding their complete members so far;
- an object member appears once its key is complete and its value has begun, if that value is a string,
  array or object (a string shows the prefix received so far, without an escape sequence cut in half);
- numbers, `true`, `false` and `null` appear only once complete: a number only when a delimiter follows it,
  since `12` may still become `123`.

So every partial value is *consistent* with the final one: each string is a prefix of the final string,
each array a prefix of the final array (its last element itself consistent), each object a subset of the
final object's members (each consistent), and every other value equal. The decoded values are plain JSON
(dicts, lists, str, int, float, bool, None).
"""

from __future__ import annotations

import json
from typing import Any

from structgen.client.targets import _MISSING

MISSING = _MISSING  # what `parse_partial` returns for a prefix that determines no value yet

_WHITESPACE = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"t": ("true", True), "f": ("false", False), "n": ("null", None)}


class _Unfinished(Exception):
    """The prefix ends inside a value that shows nothing until it is complete (a number or a literal)."""


def parse_partial(text: str) -> Any:
    """The value the JSON prefix `text` determines under the rule above (`MISSING` if none yet).

    Raises `ValueError` when `text` cannot be the start of any JSON document."""
    parser = _Parser(text)
    parser.skip_whitespace()
    if parser.pos == len(text):
        return MISSING
    try:
        value = parser.value()
    except _Unfinished:
        return MISSING
    if not parser.ended:
        parser.skip_whitespace()
        if parser.pos != len(text):
            raise ValueError(f"unexpected {text[parser.pos]!r} after the JSON value at {parser.pos}")
    return value


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.ended = False  # the prefix ran out inside a value: every enclosing container stops there

    def skip_whitespace(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
            self.pos += 1

    def at_end(self) -> bool:
        self.skip_whitespace()
        if self.pos == len(self.text):
            self.ended = True
        return self.ended

    def fail(self, expected: str) -> ValueError:
        found = repr(self.text[self.pos]) if self.pos < len(self.text) else "the end"
        return ValueError(f"expected {expected} at {self.pos}, found {found}")

    def value(self) -> Any:
        char = self.text[self.pos]
        if char == "{":
            return self.object()
        if char == "[":
            return self.array()
        if char == '"':
            return self.string()
        if char in _LITERALS:
            return self.literal(*_LITERALS[char])
        if char == "-" or char.isdigit():
            return self.number()
        raise self.fail("a JSON value")

    def object(self) -> dict[str, Any]:
        result: dict[str, Any] = {}
        more = self.opened("}")
        while more:
            if self.text[self.pos] != '"':
                raise self.fail("an object key")
            key = self.string()
            if self.ended or self.at_end():
                break
            if self.text[self.pos] != ":":
                raise self.fail("':'")
            self.pos += 1
            if self.at_end():
                break
            try:
                result[key] = self.value()
            except _Unfinished:
                break
            more = self.next_member("}")
        return result

    def array(self) -> list[Any]:
        result: list[Any] = []
        more = self.opened("]")
        while more:
            try:
                result.append(self.value())
            except _Unfinished:
                break
            more = self.next_member("]")
        return result

    def opened(self, closer: str) -> bool:
        """Step past a container's opening bracket; whether a member follows (not: closed, or the prefix ended)."""
        self.pos += 1
        if self.at_end():
            return False
        if self.text[self.pos] == closer:
            self.pos += 1
            return False
        return True

    def next_member(self, closer: str) -> bool:
        """Step past what follows a member; whether another member follows (not: closed, or the prefix ended)."""
        if self.ended or self.at_end():
            return False
        if self.text[self.pos] == closer:
            self.pos += 1
            return False
        if self.text[self.pos] != ",":
            raise self.fail(f"',' or {closer!r}")
        self.pos += 1
        return not self.at_end()

    def string(self) -> str:
        text, pos = self.text, self.pos + 1
        chunks: list[str] = []
        while True:
            end = pos
            while end < len(text) and text[end] not in '"\\':
                if text[end] < " ":
                    raise ValueError(f"control character in a string at {end}")
                end += 1
            chunks.append(text[pos:end])
            if end == len(text):
                self.pos, self.ended = end, True
                return "".join(chunks)
            if text[end] == '"':
                self.pos = end + 1
                return "".join(chunks)
            char, pos = self.escape(end)
            if char is None:  # an escape cut in half: the string so far, without it
                self.pos, self.ended = len(text), True
                return "".join(chunks)
            chunks.append(char)

    def escape(self, start: int) -> tuple[str | None, int]:
        """The character of the escape at `start` (a backslash) and where the string goes on; None if the
        prefix ends inside it."""
        text = self.text
        if start + 1 >= len(text):
            return None, start
        kind = text[start + 1]
        if kind in _ESCAPES:
            return _ESCAPES[kind], start + 2
        if kind != "u":
            raise ValueError(f"invalid escape \\{kind} at {start}")
        # `\uXXXX`, or a surrogate pair `\uD83D\uDE00` taken as one character.
        end = start + 6
        if 0xD800 <= _hex4(text, start + 2, 0xD800) < 0xDC00:
            if len(text) < end + 2:  # a low surrogate may still follow
                return None, start
            if text[end : end + 2] == "\\u":
                end += 6
        if end > len(text):
            return None, start
        return json.loads(f'"{text[start:end]}"'), end

    def literal(self, word: str, value: Any) -> Any:
        got = self.text[self.pos : self.pos + len(word)]
        if not word.startswith(got):
            raise self.fail(word)
        if len(got) < len(word):
            self.pos, self.ended = len(self.text), True
            raise _Unfinished
        self.pos += len(word)
        return value

    def number(self) -> int | float:
        end = self.pos
        while end < len(self.text) and self.text[end] in _NUMBER_CHARS:
            end += 1
        if end == len(self.text):  # no delimiter yet: the number may go on
            self.pos, self.ended = end, True
            raise _Unfinished
        try:
            value = json.loads(self.text[self.pos : end])
        except json.JSONDecodeError:
            raise self.fail("a number") from None
        self.pos = end
        return value  # type: ignore[no-any-return]


def _hex4(text: str, start: int, default: int) -> int:
    """The 4 hex digits at `start` (or `default` while they have not all arrived)."""
    digits = text[start : start + 4]
    if len(digits) < 4:
        return default
    try:
        return int(digits, 16)
    except ValueError:
        raise ValueError(f"invalid \\u escape at {start - 2}") from None
