"""Where a JSON output stands, byte by byte: the open objects, arrays, strings and numbers, and where each began.

The closing walk reads it to know whether it is inside a string (where `}` and `]` are content, not closers),
the loop guard to find the value a repetition sits in, and the pick hints which member's value is being written
(`member`: the keys of the open objects, so that a zip code's digits are told from a name's letters). It is a
scanner, not a validator: the grammar has already checked every byte. Text outside any JSON value (a tool-call
wrapper such as `<tool_call>`) is skipped, except that a quote, a digit, `{` or `[` there starts a value.
"""

from __future__ import annotations

from zlib import crc32

OBJECT, ARRAY, STRING, NUMBER = 1, 2, 3, 4
_NUMBER_BYTES = frozenset(b"0123456789+-.eE")
_NUMBER_START = frozenset(b"-0123456789")
_QUOTE, _BACKSLASH, _ZERO = ord('"'), ord("\\"), ord("0")
_SPACE = frozenset(b" \t\n\r")
_OPEN = {ord("{"): OBJECT, ord("["): ARRAY}
_CLOSE = {ord("}"): OBJECT, ord("]"): ARRAY}
_OPEN_OBJECT = ord("{")
_BEFORE_KEY = frozenset(b"{,")  # inside an object, a string opened after these is a key


class JsonScanner:
    """Feed output bytes in order; `stack` holds (kind, start offset) of each value still open."""

    __slots__ = ("_escaped", "_key", "after", "keys", "offset", "stack")

    def __init__(self) -> None:
        self.stack: list[tuple[int, int]] = []
        self.offset = 0  # bytes fed so far
        # The last byte outside string content that is not white space (`"` for a string's closing quote, `0`
        # for a number that ended); 0 before any.
        self.after = 0
        # Per open object, outermost first: the CRC-32 of its last key's bytes as written (0 before its first).
        # A CRC, not a running hash of the pieces: the same key gives the same value however it was split.
        self.keys: list[int] = []
        self._key = -1  # the CRC so far of the key being written; -1 outside a key
        self._escaped = False

    def copy(self) -> JsonScanner:
        twin = JsonScanner()
        twin.stack = list(self.stack)
        twin.offset = self.offset
        twin.after = self.after
        twin.keys = list(self.keys)
        twin._key = self._key
        twin._escaped = self._escaped
        return twin

    @property
    def member(self) -> int:
        """Which member's value the output is in, as one number: the keys of every open object (an array's
        items share their array's member). 0 outside any object."""
        return hash(tuple(self.keys)) if self.keys else 0

    @property
    def in_key(self) -> bool:
        """Inside an object's key (where `member` still names the member before it)."""
        return self._key >= 0

    @property
    def escaped(self) -> bool:
        """Right after a backslash inside a string (an escape's letter comes next)."""
        return self._escaped

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
                    end = i + 1
                else:  # string content in one go, up to the next quote or backslash
                    q = data.find(b'"', i)
                    bs = data.find(b"\\", i)
                    if bs != -1 and (q == -1 or bs < q):
                        self._escaped = True
                        end = bs + 1
                    else:
                        end = n if q == -1 else q
                if self._key >= 0:
                    self._key = crc32(data[i:end], self._key)
                if end == n or data[end] != _QUOTE or self._escaped:
                    i = end
                    continue
                stack.pop()  # the closing quote
                if self._key >= 0:
                    self.keys[-1], self._key = self._key, -1
                self.after = _QUOTE
                i = end + 1
                continue
            byte = data[i]
            if top == NUMBER:
                if byte in _NUMBER_BYTES:
                    i += 1
                    continue
                stack.pop()  # the number ended; this byte is read again outside it
                self.after = _ZERO
                continue
            before = self.after
            if byte not in _SPACE:
                self.after = byte
            if byte == _QUOTE:
                if top == OBJECT and before in _BEFORE_KEY:
                    self._key = 0
                stack.append((STRING, self.offset + i))
            elif byte in _OPEN:
                stack.append((_OPEN[byte], self.offset + i))
                if byte == _OPEN_OBJECT:
                    self.keys.append(0)
            elif byte in _CLOSE and stack and stack[-1][0] == _CLOSE[byte]:
                if stack.pop()[0] == OBJECT:
                    self.keys.pop()
            elif byte in _NUMBER_START and (not stack or stack[-1][0] in (OBJECT, ARRAY)):
                stack.append((NUMBER, self.offset + i))
            i += 1
        self.offset += n
