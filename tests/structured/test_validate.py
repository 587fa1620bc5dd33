"""Post-validation of finished outputs (jsonschema with format checking; regex; choice)."""

from __future__ import annotations

import pytest

from structgen.structured import StructuredOutputsParams, validate_output
from structgen.structured.validate import validate_json


def test_json_outputs() -> None:
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["tags"],
    }
    assert validate_json('{"tags":["a"]}', schema).valid
    bad = validate_json('{"tags":["a",3]}', schema)
    assert (
        not bad.valid and bad.keyword == "type" and bad.path == "/tags/1" and "3 is not of type" in bad.error
    )
    truncated = validate_json('{"tags":["a"', schema)
    assert not truncated.valid and truncated.keyword == "json" and "not valid JSON" in truncated.error


def test_formats_are_checked() -> None:
    schema = {"type": "string", "format": "email"}
    assert validate_json('"a@b.co"', schema).valid
    assert validate_json('"not an email"', schema).keyword == "format"
    assert not validate_json('"2024-13-45"', {"format": "date"}).valid
    assert not validate_json('"300.1.1.1"', {"format": "ipv4"}).valid


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [
        ("date-time", "2024-02-29T12:00:00+01:00", "2023-02-29T12:00:00Z"),  # no 29 Feb in 2023
        ("date-time", "2022-01-01T12:00:00.5Z", "2022-01-01T12:00:00"),  # the offset is required
        ("time", "23:59:60Z", "24:00:00Z"),
        ("duration", "P3DT4H", "P"),
        ("uri", "urn:isbn:0451450523", "not-an-iri"),
        ("uri", "https://example.com/a?b=c#d", "https://exa mple.com"),
        ("iri", "https://例え.jp/ä", "例え"),
        ("uri-reference", "../a/b?c", "a b"),
        ("hostname", "a-b.example.com", "-bad-.com"),
        ("json-pointer", "/a/b~1c", "a/b"),
    ],
)
def test_formats_jsonschema_skips_without_extras_are_checked(fmt: str, good: str, bad: str) -> None:
    assert validate_json(f'"{good}"', {"type": "string", "format": fmt}).valid
    result = validate_json(f'"{bad}"', {"type": "string", "format": fmt})
    assert not result.valid and result.keyword == "format"


def test_the_schemas_own_draft_is_applied() -> None:
    # draft-04 has no `const`: a draft-04 validator ignores it, as the schema's author asked.
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "const": 1}
    assert validate_json("2", draft4).valid
    assert not validate_json("2", {"const": 1}).valid


def test_unresolvable_schema_is_never_reported_valid() -> None:
    result = validate_json("1", {"$ref": "https://example.com/remote.json"})
    assert not result.valid and result.keyword == "schema" and "cannot be checked" in result.error


def test_other_kinds() -> None:
    regex = StructuredOutputsParams(regex=r"[0-9]{3}").to_spec()
    assert validate_output(regex, "123").valid and not validate_output(regex, "1234").valid
    choice = StructuredOutputsParams(choice=["yes", "no"]).to_spec()
    assert validate_output(choice, "no").valid and not validate_output(choice, "maybe").valid
    grammar = StructuredOutputsParams(grammar='start: "x"').to_spec()
    assert validate_output(grammar, "x").checked is False  # the grammar itself is the only judge
    obj = StructuredOutputsParams(json_object=True).to_spec()
    assert validate_output(obj, '{"a":1}').valid and not validate_output(obj, "[1]").valid
