"""What `parse` can return: a Pydantic model, any type a `TypeAdapter` takes, or a raw JSON Schema dict.

Each becomes a `Target`: the JSON Schema sent as `response_format`, and how to turn the output text back into a
value. Non-object types (`list[Item]`, `int`, `Literal[...]`, an enum) travel wrapped in an object
`{"value": ...}`, because OpenAI's strict structured outputs (the strictest server we aim to work with) only
take an object at the root; the wrapper is removed before validation, so callers never see it.

Schemas built from Python types are made strict the way OpenAI's strict mode expects: every object with
`properties` lists all of them as `required` and gets `additionalProperties: false` (a field with a default
must still be written out, as `null` for an optional one). A raw schema dict is sent as given (apart from the
wrapper), since its author chose every keyword.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from structgen.client.errors import OutputValidationError

_WRAP_KEY = "value"
# Keywords whose value is a map of name -> subschema, a subschema, or a list of subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


@dataclass(slots=True, frozen=True)
class Target:
    """The schema to request and the way back from JSON text to a value."""

    name: str
    schema: dict[str, Any]  # as sent (wrapped when `wrapped`)
    wrapped: bool
    adapter: TypeAdapter[Any] | None  # None for a raw schema dict: validated with `jsonschema` instead
    raw_schema: dict[str, Any] | None = None

    def response_format(self, *, strict: bool = True) -> dict[str, Any]:
        return {
            "type": "json_schema",
            "json_schema": {"name": self.name, "schema": self.schema, "strict": strict},
        }

    def unwrap(self, data: Any) -> Any:
        """The caller's part of a (possibly partial) decoded output; `_MISSING` when it has not begun."""
        if not self.wrapped:
            return data
        return data.get(_WRAP_KEY, _MISSING) if isinstance(data, dict) else _MISSING

    def load(self, text: str | None) -> Any:
        """The validated value of a complete output; `OutputValidationError` (with the text) when it is not."""
        if text is None:
            raise OutputValidationError("the response has no content", raw_text=None)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise OutputValidationError(f"the output is not valid JSON: {error}", raw_text=text) from None
        value = self.unwrap(data)
        if value is _MISSING:
            raise OutputValidationError(f"the output lacks the {_WRAP_KEY!r} wrapper key", raw_text=text)
        if self.adapter is not None:
            try:
                return self.adapter.validate_python(value)
            except ValidationError as error:
                raise OutputValidationError(
                    f"the output does not validate as {self.name}: {error}",
                    raw_text=text,
                    errors=error.errors(),
                ) from None
        _check_raw(self.raw_schema or {}, value, text)
        return value


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"

    # One instance only, so that `is MISSING` holds for copies of values that hold it too.
    def __copy__(self) -> _Missing:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Missing:
        return self


_MISSING: Any = _Missing()


def as_target(target: Any, *, name: str | None = None) -> Target:
    """The `Target` for a Pydantic model, a `TypeAdapter`-able type, a `TypeAdapter`, or a raw schema dict."""
    if isinstance(target, dict):
        return _wrap(name or str(target.get("title") or "output"), dict(target), adapter=None, raw=target)
    if isinstance(target, TypeAdapter):
        adapter = target
    else:
        try:
            adapter = TypeAdapter(target)
        except Exception as error:  # pydantic raises several kinds for a type it cannot handle
            raise TypeError(f"cannot build a schema for {target!r}: {error}") from None
    try:
        schema = adapter.json_schema()
    except Exception as error:
        raise TypeError(f"cannot build a JSON Schema for {target!r}: {error}") from None
    default = target.__name__ if isinstance(target, type) else "output"
    return _wrap(name or default, strict_schema(schema), adapter=adapter, raw=None)


def _wrap(name: str, schema: dict[str, Any], *, adapter: TypeAdapter[Any] | None, raw: Any) -> Target:
    name = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64] or "output"
    if schema.get("type") == "object":
        return Target(name, schema, wrapped=False, adapter=adapter, raw_schema=raw)
    # Definitions stay at the root, where the inner schema's `#/$defs/...` references point.
    defs = {key: schema.pop(key) for key in ("$defs", "definitions") if key in schema}
    wrapper = {
        "type": "object",
        "properties": {_WRAP_KEY: schema},
        "required": [_WRAP_KEY],
        "additionalProperties": False,
        **defs,
    }
    return Target(name, wrapper, wrapped=True, adapter=adapter, raw_schema=raw)


def strict_schema(schema: Any) -> Any:
    """A copy of `schema` in which every object with `properties` requires all of them and allows no others."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub) for sub in out[key]]
    if isinstance(out.get("properties"), dict):
        out["required"] = list(out["properties"])
        out.setdefault("additionalProperties", False)
    return out


def _check_raw(schema: dict[str, Any], value: Any, text: str) -> None:
    import jsonschema  # lazily: only raw-schema targets need it

    validator_class = jsonschema.validators.validator_for(schema)
    errors = sorted(validator_class(schema).iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        where = "/".join(str(part) for part in first.absolute_path) or "(root)"
        raise OutputValidationError(
            f"the output does not match the schema at {where}: {first.message}",
            raw_text=text,
            errors=[e.message for e in errors],
        )
