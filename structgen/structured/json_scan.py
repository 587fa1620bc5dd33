"""Where a JSON output stands, byte by byte: the open objects, arrays, strings and numbers, and where each began.

The closing walk reads it to know whether it is inside a string (where `}` and `]` are content, not closers),
and the loop guard to find the value a repetition sits in. It is a scanner, not a validator: the grammar has
already checked every byte. Text outside any JSON value (a tool-call wrapper such as `<tool_call>`) is
skipped, except that a quote, a digit, `{` or `[` there starts a value.
"""

from __future__ import annotations

OBJECT, ARRAY, STRING, NUMBER = 1, 2, 3, 4
_NUMBER_BYTES = frozenset(b"0123456789+-.eE")
_NUMBER_START = frozenset(b"-0123456789")
_QUOTE, _BACKSLASH, _ZERO = ord('"'), ord("\\"), ord("0")
_SPACE = frozenset(b" \t\n\r")
_OPEN = {ord("{"): OBJECT, ord("["): ARRAY}
_CLOSE = {ord("}"): OBJECT, ord("]"): ARRAY}


class JsonScanner:
    """Feed output bytes in order; `stack` holds (kind, start offset) of each value still open."""

    __slots__ = ("_escaped", "after", "offset", "stack")

    def __init__(self) -> None:
        self.stack: list[tuple[int, int]] = []
        self.offset = 0  # bytes fed so far
        # The last byte outside string content that is not white space (`"` for a string's closing quote, `0`
        # for a number that ended); 0 before any.
        self.after = 0
        self._escaped = False

    def copy(self) -> JsonScanner:
        twin = JsonScanner()
        twin.stack = list(self.stack)
        twin.offset = self.offset
        twin.after = self.after
        twin._escaped = self._escaped
        return twin

    @property
    def depth(self) -> int:
        return len(self.stack)

    @property
    def innermost(self) -> int | None:
        return self.stack[-1][0] if self.stack else None

    def feed(self, data: bytes) -> None:
        stack = self.stack
        i, n = 0, len(data)
        while i < n:
            top = stack[-1][0] if stack else None
            if top == STRING:
                if self._escaped:
                    self._escaped = False
                    i += 1
                    continue
                # Skip string content in one go, up to the next quote or backslash.
                q = data.find(b'"', i)
                bs = data.find(b"\\", i)
                if bs != -1 and (q == -1 or bs < q):
                    self._escaped = True
                    i = bs + 1
                    continue
                if q == -1:
                    i = n
                    continue
                stack.pop()
                self.after = _QUOTE
                i = q + 1
                continue
            byte = data[i]
            if top == NUMBER:
                if byte in _NUMBER_BYTES:
                    i += 1
                    continue
                stack.pop()  # the number ended; this byte is read again outside it
                self.after = _ZERO
                continue
            if byte not in _SPACE:
                self.after = byte
            if byte == _QUOTE:
                stack.append((STRING, self.offset + i))
            elif byte in _OPEN:
                stack.append((_OPEN[byte], self.offset + i))
            elif byte in _CLOSE and stack and stack[-1][0] == _CLOSE[byte]:
                stack.pop()
            elif byte in _NUMBER_START and (not stack or stack[-1][0] in (OBJECT, ARRAY)):
                stack.append((NUMBER, self.offset + i))
            i += 1
        self.offset += n
