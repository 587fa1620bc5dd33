"""The JSON scanner: open values and their offsets, across token boundaries, escapes and wrapper text."""

from __future__ import annotations

import pytest

from structgen.structured.json_scan import ARRAY, NUMBER, OBJECT, STRING, JsonScanner


def kinds(text: bytes, *, chunk: int = 1) -> list[int]:
    scanner = JsonScanner()
    for i in range(0, len(text), chunk):
        scanner.feed(text[i : i + chunk])
    assert scanner.offset == len(text)
    return [kind for kind, _ in scanner.stack]


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_stack_follows_the_text(chunk: int) -> None:
    assert kinds(b'{"a":[1,"x', chunk=chunk) == [OBJECT, ARRAY, STRING]
    assert kinds(b'{"a":[1,"x"]', chunk=chunk) == [OBJECT]
    assert kinds(b'{"a":[12', chunk=chunk) == [OBJECT, ARRAY, NUMBER]
    assert kinds(b'{"a":[12,', chunk=chunk) == [OBJECT, ARRAY]
    assert kinds(b'{"a":"q\\"}]', chunk=chunk) == [OBJECT, STRING]  # escaped quote: still inside
    assert kinds(b'{"a":"q\\\\"}', chunk=chunk) == []  # escaped backslash, then the closing quote
    assert kinds(b'{"k":"}]"}', chunk=chunk) == []  # closers inside strings are content


def after(text: bytes, *, chunk: int) -> str:
    scanner = JsonScanner()
    for i in range(0, len(text), chunk):
        scanner.feed(text[i : i + chunk])
    twin = scanner.copy()
    assert twin.after == scanner.after
    return chr(scanner.after)


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_after_is_the_last_byte_written_outside_strings(chunk: int) -> None:
    assert after(b'{"a"', chunk=chunk) == '"'  # a string closed (a key)
    assert after(b'{"a":', chunk=chunk) == ":"
    assert after(b'{"a": ', chunk=chunk) == ":"  # white space does not count
    assert after(b'{"a": "x,y:', chunk=chunk) == '"'  # inside the string: content does not count
    assert after(b'{"a": "x,y"', chunk=chunk) == '"'
    assert after(b'{"a": "x,y" ,', chunk=chunk) == ","
    assert after(b'{"a": "x", "b": [1, 22 ', chunk=chunk) == "0"  # a number that ended
    assert after(b'{"a": "x", "b": [1, 22]', chunk=chunk) == "]"
    assert after(b'{"a": "x", "b": [1, 22], "c": true', chunk=chunk) == "e"
    assert JsonScanner().after == 0


def test_wrapper_text_is_skipped_and_offsets_are_absolute() -> None:
    scanner = JsonScanner()
    scanner.feed(b'<tool_call>\n{"name": "f", "arguments": {"city": "Vie')
    assert [k for k, _ in scanner.stack] == [OBJECT, OBJECT, STRING]
    assert scanner.stack[0][1] == len(b"<tool_call>\n")
    scanner.feed(b'nna"}}\n</tool_call>')
    assert scanner.stack == []


def member(text: bytes, *, chunk: int) -> int:
    scanner = JsonScanner()
    for i in range(0, len(text), chunk):
        scanner.feed(text[i : i + chunk])
    assert scanner.copy().member == scanner.member
    return scanner.member


@pytest.mark.parametrize("chunk", [1, 2, 5, 100])
def test_member_names_the_keys_of_the_open_objects_however_the_text_was_split(chunk: int) -> None:
    whole = {text: member(text, chunk=100) for text in (b'{"zip": "1', b'{"name": "1', b'{"a": {"zip": "1')}
    assert len(set(whole.values())) == 3  # the same value position under different members
    for text, value in whole.items():
        assert member(text, chunk=chunk) == value
    assert member(b"", chunk=chunk) == 0 and member(b"[1, ", chunk=chunk) == 0  # outside any object
    # A value's string is not a key; items of an array share the array's member; a closed object is left.
    assert member(b'{"zip": "12", "x', chunk=chunk) == member(b'{"zip": "1', chunk=chunk)
    assert member(b'{"l": [{"id": 1}, {"id": 2', chunk=chunk) == member(b'{"l": [{"id": 1', chunk=chunk)
    assert member(b'{"a": {"zip": 1}, "b": 2', chunk=chunk) == member(b'{"b": 2', chunk=chunk)
    # Escapes are part of the key's bytes; a key with an escaped quote is one key.
    assert member(b'{"z\\"ip": 1', chunk=chunk) != member(b'{"zip": 1', chunk=chunk)
    assert member(b'{"z\\"ip": "q', chunk=chunk) == member(b'{"z\\"ip": 1', chunk=chunk)
