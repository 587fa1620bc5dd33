"""The schema shapes of `structgen bench structured --parts s` (`SHAPES`), the prompts that ask for them and the
checks of their outputs; the closed loops that run them are in `structured_shapes` and `structured_http`."""

from __future__ import annotations

from typing import Any

from structgen.bench.structured_engine import LONG_SCHEMA


def _object(properties: dict[str, Any], *, required: list[str] | None = None) -> dict[str, Any]:
    """A closed object schema; every property required unless `required` says otherwise."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _array(items: dict[str, Any], *, min_items: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items}


SHAPES: dict[str, dict[str, Any]] = {
    # The issue's: 40+ small records; at ~15 tokens a record the output rarely fits 256 tokens.
    "items": _object(
        {
            "items": _array(
                _object(
                    {
                        "id": {"type": "integer"},
                        "label": {"type": "string", "maxLength": 12},
                        "ok": {"type": "boolean"},
                    }
                ),
                min_items=40,
            )
        }
    ),
    # A short output (~60 tokens): requests finish and are replaced often, keys are long forced runs.
    "nested": _object(
        {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": _object(
                {
                    "street": {"type": "string", "maxLength": 40},
                    "city": {"type": "string", "maxLength": 24},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                }
            ),
            "contact": _object(
                {
                    "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z0-9]{1,12}\\.[a-z]{2,4}$"},
                    "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"},
                }
            ),
        }
    ),
    "enums": _object(
        {
            "tasks": _array(
                _object(
                    {
                        "status": {"enum": ["todo", "in_progress", "blocked", "done"]},
                        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                        "score": {"type": "number", "minimum": 0, "maximum": 1},
                    }
                ),
                min_items=20,
            )
        }
    ),
    "optional_anyof": _object(
        {
            "entries": _array(
                _object(
                    {
                        "name": {"type": "string", "maxLength": 16},
                        "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
                        "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
                        "tags": {
                            "type": "array",
                            "items": {"type": "string", "maxLength": 10},
                            "maxItems": 4,
                        },
                    },
                    required=["name", "value"],
                ),
                min_items=10,
            )
        }
    ),
    # Part (a)'s shape, for the no-regression check: the grammar inside one long string.
    "in_string": LONG_SCHEMA,
}
_ASKS = {
    "items": "list the items of an inventory",
    "nested": "describe a person with address and contact",
    "enums": "list the tasks of a project with status, priority and score",
    "optional_anyof": "list the entries of a settings file",
    "in_string": "write a long text",
}


def prompt_format(shape: str, tag: str = "") -> str:
    """The prompts of a shape, with an `{index}` field (`tag` keeps two sides of one engine apart in its
    prefix cache)."""
    return f"Request {tag}{{index}}: {_ASKS.get(shape, 'reply')} as JSON."


def prompt(shape: str, index: int, tag: str = "") -> str:
    """A distinct prompt per request."""
    return prompt_format(shape, tag).format(index=index)


def validator(schema: dict[str, Any]) -> Any:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)
    return cls(schema)
