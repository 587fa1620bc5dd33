"""Post-validation of finished outputs: JSON outputs against the original schema with `jsonschema` (format
checking on), regex outputs by full match, choices by membership. The result is attached to each output, so
the server and the CLI can report it; an output that fails is never presented as valid.

Patterns (`pattern`, regex outputs) are matched with a time limit: Python's backtracking engine takes
exponential time on patterns such as `^((?:[a-z0-9]+-?)+[a-z0-9]/)?...$` against a long run of letters, and
validation runs on the engine's step thread, where one such output would stall every request. Past the limit
the same question goes to a linear-time engine (`jsonschema_rs`, Rust's regex crate), so the answer is still
exact.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import regex
from jsonschema import exceptions as js_exceptions
from jsonschema.validators import extend

from structgen.structured.formats import format_checker
from structgen.structured.normalize import detect_draft
from structgen.structured.spec import StructuredSpec, canonical_json

FORMAT_CHECKER = format_checker()
# A pattern search that takes longer than this is backtracking its way through exponentially many paths.
PATTERN_TIME_LIMIT_S = 0.05


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> Any:
    return regex.compile(pattern)


def pattern_search(pattern: str, text: str, *, whole: bool = False) -> bool:
    """Whether `pattern` matches somewhere in `text` (JSON Schema's `pattern`), or all of it (`whole`), in
    bounded time."""
    compiled = _compiled(pattern)
    try:
        found = (compiled.fullmatch if whole else compiled.search)(text, timeout=PATTERN_TIME_LIMIT_S)
        return found is not None
    except TimeoutError:
        import jsonschema_rs

        linear = f"^(?:{pattern})$" if whole else pattern
        return bool(jsonschema_rs.is_valid({"type": "string", "pattern": linear}, text))


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "string") and not pattern_search(pattern, instance):
        yield js_exceptions.ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if pattern_search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, additional: Any, instance: Any, schema: Any) -> Any:
    """jsonschema's own, with keys matched against `patternProperties` in bounded time."""
    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = sorted(
        (k for k in instance if k not in properties and not any(pattern_search(p, k) for p in patterns)),
        key=str,
    )
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        joined = ", ".join(repr(each) for each in extras)
        if patterns:
            verb = "does" if len(extras) == 1 else "do"
            regexes = ", ".join(repr(each) for each in sorted(patterns))
            yield js_exceptions.ValidationError(f"{joined} {verb} not match any of the regexes: {regexes}")
        else:
            verb = "was" if len(extras) == 1 else "were"
            yield js_exceptions.ValidationError(
                f"Additional properties are not allowed ({joined} {verb} unexpected)"
            )


# Every keyword that matches a pattern, in bounded time (`propertyNames` goes through `pattern`).
_BOUNDED = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
}
_VALIDATORS: dict[str, type[Any]] = {
    name: extend(cls, _BOUNDED)
    for name, cls in (
        ("draft4", jsonschema.Draft4Validator),
        ("draft6", jsonschema.Draft6Validator),
        ("draft7", jsonschema.Draft7Validator),
        ("draft2019-09", jsonschema.Draft201909Validator),
        ("draft2020-12", jsonschema.Draft202012Validator),
    )
}


@dataclass(frozen=True, slots=True)
class ValidationResult:
    """`valid` with, on failure, the first error: message, failing keyword, and JSON pointer in the output.
    `checked` is False when no independent check exists (a grammar spec; a regex Python cannot read)."""

    valid: bool
    error: str | None = None
    keyword: str | None = None
    path: str | None = None
    checked: bool = True


def validate_output(spec: StructuredSpec, text: str, *, schema: Any = None) -> ValidationResult:
    """Validate a finished output against what the request asked for (`schema` overrides the spec's)."""
    if spec.kind in ("json_schema", "json_object"):
        return validate_json(text, spec.schema() if schema is None else schema)
    if spec.kind == "choice":
        if text in spec.choices():
            return ValidationResult(True)
        return ValidationResult(False, f"{text!r} is not one of the choices", keyword="choice")
    if spec.kind == "regex":
        try:
            re.compile(spec.text)
        except re.error:
            return ValidationResult(True, checked=False)
        if pattern_search(spec.text, text, whole=True):
            return ValidationResult(True)
        return ValidationResult(
            False, f"output does not fully match the regex {spec.text!r}", keyword="pattern"
        )
    return ValidationResult(True, checked=False)


def validate_json(text: str, schema: Any) -> ValidationResult:
    try:
        instance = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        return ValidationResult(False, f"output is not valid JSON: {e}", keyword="json")
    return validate_instance(instance, schema)


def validate_instance(instance: Any, schema: Any) -> ValidationResult:
    try:
        validator = _validator(canonical_json(schema))
        error = js_exceptions.best_match(validator.iter_errors(instance))
    except Exception as e:
        # An unresolvable $ref, a regex Python cannot read, a recursion limit: not checked is not valid.
        return ValidationResult(
            False, f"schema cannot be checked: {type(e).__name__}: {_one_line(e)}", keyword="schema"
        )
    if error is None:
        return ValidationResult(True)
    path = "".join(f"/{p}" for p in error.absolute_path) or "/"
    return ValidationResult(False, _one_line(error.message), keyword=str(error.validator), path=path)


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    schema = json.loads(schema_json)
    cls = _VALIDATORS[detect_draft(schema)]
    return cls(schema, format_checker=FORMAT_CHECKER)


def _one_line(e: object) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."
