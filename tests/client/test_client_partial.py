"""The partial-JSON parser: every prefix of a document parses to a value consistent with the final one."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from client_helpers import consistent
from hypothesis import given, settings
from hypothesis import strategies as st

from structgen.client.partial import MISSING, parse_partial

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)


def prefixes(document: str) -> list[str]:
    return [document[:i] for i in range(len(document) + 1)]


@settings(max_examples=100, deadline=None)
@given(JSON_VALUES, st.booleans(), st.booleans())
def test_every_prefix_is_consistent_with_the_final_value(value: Any, pretty: bool, ascii_only: bool) -> None:
    document = json.dumps(value, indent=2 if pretty else None, ensure_ascii=ascii_only)
    for prefix in prefixes(document):
        partial = parse_partial(prefix)
        assert partial is MISSING or consistent(partial, value), (prefix, partial)
    # The whole document shows the whole value, except a bare top-level number that may still go on.
    full = parse_partial(document)
    if isinstance(value, int | float) and not isinstance(value, bool):
        assert full is MISSING
    else:
        assert full == value and consistent(full, value)
    assert parse_partial(document + " ") == value


@settings(max_examples=40, deadline=None)
@given(JSON_VALUES)
def test_partials_only_grow(value: Any) -> None:
    """A partial never takes back what an earlier (shorter) prefix showed."""
    document = json.dumps({"v": value})
    shown: list[Any] = [p for p in map(parse_partial, prefixes(document)) if p is not MISSING]
    for earlier, later in itertools.pairwise(shown):
        if "v" in earlier:
            assert consistent(earlier["v"], later["v"]), (earlier, later)


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("", MISSING),
        ("  ", MISSING),
        ("{", {}),
        ('{"na', {}),
        ('{"name"', {}),
        ('{"name": ', {}),
        ('{"name": "Ma', {"name": "Ma"}),
        ('{"name": "Maria", "age": 3', {"name": "Maria"}),
        ('{"name": "Maria", "age": 34', {"name": "Maria"}),
        ('{"name": "Maria", "age": 34,', {"name": "Maria", "age": 34}),
        ('{"ok": tr', {}),
        ('{"ok": true', {"ok": True}),
        ('{"tags": ["a", "b', {"tags": ["a", "b"]}),
        ('{"tags": [1, 2', {"tags": [1]}),
        ('{"a": {"b": [{"c": nul', {"a": {"b": [{}]}}),
        ('"line\\', "line"),
        ('"tab\\tx', "tab\tx"),
        ('"\\u00e', ""),
        ('"x\\u00e9y', "xéy"),
        ('"\\ud83d', ""),
        ('"\\ud83d\\ude0', ""),
        ('"\\ud83d\\ude00!', "😀!"),
        ("[1.5e", []),
        ("-", MISSING),
        ("[]", []),
        ('{"a": []}', {"a": []}),
    ],
)
def test_documented_rule(prefix: str, expected: Any) -> None:
    assert parse_partial(prefix) == expected


@pytest.mark.parametrize("bad", ["x", "{1", '{"a" 1', "[1 2", '{"a": 1} x', "[tru3", '"\\q', "{,}", "[1,]"])
def test_text_that_cannot_start_a_json_document_raises(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_partial(bad)
