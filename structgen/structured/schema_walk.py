"""Where subschemas live in a JSON Schema, and a walk over all of them with their JSON pointers.

Every module that inspects or rewrites schemas (normalization, relaxation, the per-backend support checks)
uses these tables, so "which keys hold subschemas" is decided once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

# Keys whose value is one subschema.
SINGLE_SUBSCHEMA = (
    "additionalProperties",
    "propertyNames",
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
)
# Keys whose value maps names to subschemas.
MAP_SUBSCHEMA = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keys whose value is a list of subschemas.
LIST_SUBSCHEMA = ("allOf", "anyOf", "oneOf", "prefixItems")

# Keywords that constrain instances. Anything else in a schema object is an annotation or unknown, and a
# validator ignores it ("format" is listed: it is an assertion wherever a checker exists for its value).
ASSERTION_KEYWORDS = frozenset(
    {
        "type", "enum", "const",
        "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
        "maxLength", "minLength", "pattern", "format",
        "maxItems", "minItems", "uniqueItems", "maxContains", "minContains", "contains", "items", "prefixItems",
        "additionalItems", "unevaluatedItems",
        "maxProperties", "minProperties", "required", "dependentRequired", "dependentSchemas", "dependencies",
        "properties", "patternProperties", "additionalProperties", "propertyNames", "unevaluatedProperties",
        "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
        "$ref", "$dynamicRef", "$recursiveRef",
    }
)  # fmt: skip
# Kept although they constrain nothing themselves: `$ref` targets and the draft marker live here.
STRUCTURAL_KEYWORDS = frozenset({"$defs", "definitions", "$schema", "$id", "id", "$anchor", "$dynamicAnchor"})

JSON_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")


def pointer(path: str, *parts: str | int) -> str:
    """Extend a JSON pointer such as "#/properties/a" by escaped reference tokens."""
    for part in parts:
        path += "/" + str(part).replace("~", "~0").replace("/", "~1")
    return path


def iter_subschemas(schema: Any, path: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield `(json_pointer, subschema)` for the schema and every object subschema inside it, depth first.

    Boolean subschemas are skipped (they hold no keywords); values of `properties` maps are walked but the
    maps themselves are not schemas, and `enum`/`const`/`default` values are never entered.
    """
    stack: list[tuple[str, Any]] = [(path, schema)]
    while stack:
        here, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield here, node
        children: list[tuple[str, Any]] = []
        for key in SINGLE_SUBSCHEMA:
            if key in node:
                value = node[key]
                if isinstance(value, list):  # draft <= 2019-09 array form of `items`
                    children.extend((pointer(here, key, i), v) for i, v in enumerate(value))
                else:
                    children.append((pointer(here, key), value))
        for key in MAP_SUBSCHEMA:
            value = node.get(key)
            if isinstance(value, dict):
                children.extend((pointer(here, key, name), v) for name, v in value.items())
        for key in LIST_SUBSCHEMA:
            value = node.get(key)
            if isinstance(value, list):
                children.extend((pointer(here, key, i), v) for i, v in enumerate(value))
        deps = node.get("dependencies")
        if isinstance(deps, dict):
            children.extend(
                (pointer(here, "dependencies", k), v) for k, v in deps.items() if isinstance(v, dict)
            )
        stack.extend(reversed(children))


def find_keyword(schema: Any, keyword: str, value: Any = None) -> str | None:
    """JSON pointer of the first subschema holding `keyword` (with `value`, when given), or None."""
    for path, node in iter_subschemas(schema):
        if keyword in node and (value is None or node[keyword] == value):
            return path
    return None


def map_subschemas(node: dict[str, Any], path: str, fn: Callable[[Any, str], Any]) -> dict[str, Any]:
    """A copy of `node` with `fn(child, child_path)` applied to each direct subschema."""
    out = dict(node)
    for key in SINGLE_SUBSCHEMA:
        if key in out:
            value = out[key]
            if isinstance(value, list):
                out[key] = [fn(v, pointer(path, key, i)) for i, v in enumerate(value)]
            else:
                out[key] = fn(value, pointer(path, key))
    for key in MAP_SUBSCHEMA:
        value = out.get(key)
        if isinstance(value, dict):
            out[key] = {name: fn(v, pointer(path, key, name)) for name, v in value.items()}
    for key in LIST_SUBSCHEMA:
        value = out.get(key)
        if isinstance(value, list):
            out[key] = [fn(v, pointer(path, key, i)) for i, v in enumerate(value)]
    deps = out.get("dependencies")
    if isinstance(deps, dict):
        out["dependencies"] = {
            k: fn(v, pointer(path, "dependencies", k)) if isinstance(v, dict | bool) else v
            for k, v in deps.items()
        }
    return out


def resolve_pointer(root: Any, ref: str) -> Any:
    """Resolve a local `$ref` ("#", "#/$defs/x"); raises KeyError for anything else or a missing target."""
    if not ref.startswith("#"):
        raise KeyError(ref)
    node = root
    frag = ref[1:]
    if not frag:
        return node
    if not frag.startswith("/"):
        raise KeyError(ref)
    for token in frag[1:].split("/"):
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list):
            node = node[int(token)]
        elif isinstance(node, dict):
            node = node[token]
        else:
            raise KeyError(ref)
    return node
