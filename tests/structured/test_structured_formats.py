"""Outputs are judged on every JSON Schema format as the standard's libraries judge them (jsonschema's
`format-nongpl` extras): each case below is decided by calling the library itself, and the output check must
agree, for a valid and an invalid string of every format."""

from __future__ import annotations

from collections.abc import Callable

import fqdn
import idna
import isoduration
import jsonpointer
import pytest
import rfc3339_validator
import rfc3986_validator
import rfc3987_syntax
import uri_template

from structgen.structured import formats
from structgen.structured.validate import validate_json


def _raises_not(check: Callable[[str], object], *errors: type[Exception]) -> Callable[[str], bool]:
    def judge(value: str) -> bool:
        try:
            check(value)
        except errors:
            return False
        return True

    return judge


def _duration(value: str) -> bool:
    # jsonschema's rule: what isoduration parses, ending in a unit (isoduration also takes "P1D" forms only)
    return _raises_not(isoduration.parse_duration, isoduration.DurationParsingException)(
        value
    ) and value.endswith(tuple("DMYWHMS"))


LIBRARY: dict[str, Callable[[str], bool]] = {
    "date-time": lambda v: bool(rfc3339_validator.validate_rfc3339(v.upper())),
    "time": lambda v: bool(rfc3339_validator.validate_rfc3339("1970-01-01T" + v.upper())),
    "duration": _duration,
    "hostname": lambda v: bool(fqdn.FQDN(v, min_labels=1).is_valid) if v else False,
    "idn-hostname": _raises_not(idna.encode, idna.IDNAError, UnicodeError),
    "uri": lambda v: bool(rfc3986_validator.validate_rfc3986(v, rule="URI")),
    "uri-reference": lambda v: bool(rfc3986_validator.validate_rfc3986(v, rule="URI_reference")),
    "iri": lambda v: bool(rfc3987_syntax.is_valid_syntax("iri", v)),
    "iri-reference": lambda v: bool(rfc3987_syntax.is_valid_syntax("iri_reference", v)),
    "uri-template": lambda v: bool(uri_template.validate(v)),
    "json-pointer": _raises_not(jsonpointer.JsonPointer, jsonpointer.JsonPointerException),
}

CASES: list[tuple[str, str]] = [
    ("date-time", "2024-02-29T12:00:00+01:00"),
    ("date-time", "2022-01-01t12:00:00.5z"),
    ("date-time", "2023-02-29T12:00:00Z"),  # no 29 February in 2023
    ("date-time", "2022-01-01T12:00:00"),  # the offset is required
    ("date-time", "2022-01-01T25:00:00Z"),
    ("time", "23:59:59Z"),
    ("time", "08:30:00.25+05:30"),
    ("time", "24:00:00Z"),
    ("time", "12:00:00"),
    ("duration", "P3DT4H"),
    ("duration", "P1W"),
    ("duration", "PT0.5S"),
    ("duration", "P"),
    ("duration", "P1DT"),
    ("duration", "3 days"),
    ("hostname", "a-b.example.com"),
    ("hostname", "localhost"),
    ("hostname", "-bad-.com"),
    ("hostname", "a..b"),
    ("hostname", "x" * 64 + ".com"),
    ("idn-hostname", "例え.jp"),
    ("idn-hostname", "bücher.example"),
    ("idn-hostname", "a" * 64),
    ("idn-hostname", "-x.de"),
    ("uri", "https://example.com/a?b=c#d"),
    ("uri", "urn:isbn:0451450523"),
    ("uri", "not-an-iri"),
    ("uri", "https://exa mple.com"),
    ("uri", "://"),
    ("uri-reference", "../a/b?c"),
    ("uri-reference", "#frag"),
    ("uri-reference", "://"),  # the issue's case: no scheme before "://"
    ("uri-reference", "a b"),
    ("iri", "https://例え.jp/ä"),
    ("iri", "例え"),
    ("iri", "http://[bad"),
    ("iri-reference", "/ä/ö"),
    ("iri-reference", "a b"),
    ("uri-template", "http://example.com/resource/{id}"),
    ("uri-template", "/search{?q,lang}"),
    ("uri-template", "http://example.com/resource/{"),  # the issue's case: an unclosed expression
    ("uri-template", "/a/{b}}"),
    ("json-pointer", "/a/b~1c"),
    ("json-pointer", ""),
    ("json-pointer", "a/b"),
    ("json-pointer", "/a~2"),
]


@pytest.mark.parametrize(("fmt", "value"), CASES)
def test_outputs_are_judged_as_the_library_judges(fmt: str, value: str) -> None:
    expected = LIBRARY[fmt](value)
    result = validate_json(f'"{value}"', {"type": "string", "format": fmt})
    assert result.valid == expected, f"{fmt} {value!r}: library says {expected}"
    if not expected:
        assert result.keyword == "format"


def test_every_library_format_has_a_valid_and_an_invalid_case() -> None:
    verdicts: dict[str, set[bool]] = {}
    for fmt, value in CASES:
        verdicts.setdefault(fmt, set()).add(LIBRARY[fmt](value))
    assert set(verdicts) == set(LIBRARY)
    assert all(v == {True, False} for v in verdicts.values()), verdicts


def test_the_issues_examples_are_invalid() -> None:
    assert not validate_json('"://"', {"format": "uri-reference"}).valid
    assert not validate_json('"http://example.com/resource/{"', {"format": "uri-template"}).valid


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [
        ("relative-json-pointer", "0/a", "01/a"),
        ("relative-json-pointer", "2#", "/a"),
        ("email", "a@b.example", "no-at-sign"),
        ("ipv4", "192.168.0.1", "300.1.1.1"),
        ("ipv6", "::1", "1::2::3"),
        ("uuid", "0e4a1f39-2fd8-4d69-9d30-2b37a11e3a7f", "0e4a1f392fd84d699d302b37a11e3a7f"),
        ("date", "2024-02-29", "2023-02-29"),
        ("regex", "^a+$", "("),
    ],
)
def test_formats_jsonschema_checks_itself(fmt: str, good: str, bad: str) -> None:
    assert validate_json(f'"{good}"', {"type": "string", "format": fmt}).valid
    assert not validate_json(f'"{bad}"', {"type": "string", "format": fmt}).valid


def test_every_format_of_the_draft_is_checked() -> None:
    checker = formats.format_checker()
    assert set(formats.DRAFT_2020_12_FORMATS) <= set(checker.checkers)


def test_a_broken_install_is_refused_with_the_package_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import jsonschema

    checkers = dict(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
    checkers.pop("uri-template")
    monkeypatch.setattr(jsonschema.Draft202012Validator.FORMAT_CHECKER, "checkers", checkers)
    with pytest.raises(formats.FormatCheckError, match=r"missing uri-template.*format-nongpl"):
        formats.format_checker()
