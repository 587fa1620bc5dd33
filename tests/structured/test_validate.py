"""Post-validation of finished outputs (jsonschema with format checking; regex; choice)."""

from __future__ import annotations

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


def test_a_pattern_that_backtracks_exponentially_is_checked_in_bounded_time() -> None:
    """Python's engine takes minutes on this GitHub schema's pattern against a long run of letters and digits
    (the whole string matches, but the optional owner group is tried first in 2^n ways); validation runs on the
    step thread, so the check goes to a linear-time engine past its time limit, with the same answer."""
    import time

    from structgen.structured.validate import pattern_search, validate_instance

    repo_list = (
        r"^(?:(?:(?:[A-Za-z0-9]+[-]?)+[A-Za-z0-9]/)?[A-Za-z0-9_-]+\s*,\s*)*"
        r"(?:(?:[A-Za-z0-9]+[-]?)+[A-Za-z0-9]/)?[A-Za-z0-9_-]+$"
    )
    schema = {"type": "object", "properties": {"repos": {"type": "string", "pattern": repo_list}}}
    start = time.perf_counter()
    assert validate_instance({"repos": "ghlint-repo-1234567890000000000000000000000000000"}, schema).valid
    result = validate_instance({"repos": "ghlint-repo-12345678900000000000000000000000000!"}, schema)
    assert not result.valid and result.keyword == "pattern"
    assert time.perf_counter() - start < 60  # a hang check: minutes before the time limit existed
    assert pattern_search("b+", "abbbc") and not pattern_search("b+", "abbbc", whole=True)
    assert pattern_search("(a+)+b", "a" * 40 + "b", whole=True)
    assert not pattern_search("(a+)+b", "a" * 40 + "c", whole=True)


def test_pattern_properties_and_additional_properties_match_keys_in_bounded_time() -> None:
    from structgen.structured.validate import validate_instance

    slow = r"^(?:(?:[a-z0-9]+-?)+[a-z0-9]/)?[a-z0-9_-]+$"  # backtracks exponentially on a long key
    schema = {
        "type": "object",
        "patternProperties": {slow: {"type": "integer"}},
        "additionalProperties": False,
    }
    key = "a" * 40 + "!"  # matches no pattern: an additional property
    result = validate_instance({key: 1}, schema)
    assert not result.valid and result.keyword == "additionalProperties"
    assert "does not match any of the regexes" in result.error
    good = "b" * 40
    assert validate_instance({good: 1}, schema).valid
    result = validate_instance({good: "x"}, schema)
    assert not result.valid and result.keyword == "type"
    plain = {"type": "object", "properties": {"a": {}}, "additionalProperties": False}
    result = validate_instance({"a": 1, "b": 2}, plain)
    assert not result.valid and "Additional properties are not allowed ('b' was unexpected)" in result.error
