"""Two proofs the normalizer needs: the exact negation of a (simple) schema, and that two schemas can never
both hold for one instance. Both answer only what they can prove; `None`/`False` means "don't know", and
the caller then keeps the original keyword (to be relaxed and validated later, never silently loosened)."""

from __future__ import annotations

import json
import math
from typing import Any

from structgen.structured.schema_walk import JSON_TYPES, resolve_pointer

_ALL_TYPES = frozenset(JSON_TYPES) - {"integer"}  # "number" already covers the integers


def negate(schema: Any) -> dict[str, Any] | bool | None:
    """A schema that holds exactly where `schema` fails, or None when that needs `not` itself."""
    if schema is True:
        return False
    if schema is False:
        return True
    if not isinstance(schema, dict):
        return None
    keys = set(schema)
    if not keys:
        return False
    if keys == {"not"}:
        return schema["not"]
    if keys == {"type"}:
        return _negate_type(schema["type"])
    if keys == {"required"}:
        required = schema["required"]
        if not isinstance(required, list):
            return None
        if not required:
            return False
        # An instance fails `required` iff it is an object missing one of the names.
        # An instance fails `required` iff it is an object missing one of the names (non-objects pass it).
        branches = [{"type": "object", "properties": {name: False}} for name in dict.fromkeys(required)]
        return branches[0] if len(branches) == 1 else {"anyOf": branches}
    if keys == {"anyOf"} and isinstance(schema["anyOf"], list):
        parts = [negate(s) for s in schema["anyOf"]]
        return None if any(p is None for p in parts) else {"allOf": parts}
    if keys == {"allOf"} and isinstance(schema["allOf"], list):
        parts = [negate(s) for s in schema["allOf"]]
        return None if any(p is None for p in parts) else {"anyOf": parts}
    if "type" in keys and len(keys) > 1:
        # not (T and rest) == (not T) or (T and not rest)
        rest = {k: v for k, v in schema.items() if k != "type"}
        not_type, not_rest = _negate_type(schema["type"]), negate(rest)
        if not_type is None or not_rest is None:
            return None
        return {"anyOf": [not_type, not_rest]}
    if keys == {"properties"} and isinstance(schema["properties"], dict) and len(schema["properties"]) == 1:
        ((name, sub),) = schema["properties"].items()
        not_sub = negate(sub)
        if not_sub is None:
            return None
        return {"type": "object", "required": [name], "properties": {name: not_sub}}
    return None


def _negate_type(value: Any) -> dict[str, Any] | bool | None:
    types = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else None
    if types is None or not types <= set(JSON_TYPES):
        return None
    if "integer" in types and "number" not in types:
        return None  # the non-integer numbers have no type name of their own
    rest = sorted(_ALL_TYPES - types)
    if not rest:
        return False
    return {"type": rest[0] if len(rest) == 1 else rest}


def disjoint(a: Any, b: Any, root: Any, depth: int = 0) -> bool:
    """True only if no instance can satisfy both `a` and `b` (local `$ref`s resolved against `root`)."""
    if depth > 8:
        return False
    a, b = _deref(a, root), _deref(b, root)
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not (va & vb):
        return True
    ta, tb = _types(a), _types(b)
    if va is not None and all(_type_of(json.loads(v)) not in tb for v in va):
        return True
    if vb is not None and all(_type_of(json.loads(v)) not in ta for v in vb):
        return True
    common = ta & tb
    if not common:
        return True
    # Every shared type must be ruled out on its own.
    return all(_disjoint_within(t, a, b, root, depth) for t in common)


def _disjoint_within(t: str, a: dict[str, Any], b: dict[str, Any], root: Any, depth: int) -> bool:
    if t in ("number", "integer"):
        return _apart(_interval(a), _interval(b)) or _apart(_interval(b), _interval(a))
    if t != "object":
        return False
    req_a, req_b = set(a.get("required") or ()), set(b.get("required") or ())
    props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
    for name in req_a & req_b:
        if name in props_a and name in props_b and disjoint(props_a[name], props_b[name], root, depth + 1):
            return True
    # A name one side requires and the other forbids (closed object, or `false` for that property).
    for req, other, other_props in ((req_a, b, props_b), (req_b, a, props_a)):
        for name in req:
            if other_props.get(name) is False:
                return True
            if (
                name not in other_props
                and other.get("additionalProperties") is False
                and not other.get("patternProperties")
            ):
                return True
    return False


def _deref(schema: Any, root: Any) -> Any:
    seen = 0
    while isinstance(schema, dict) and set(schema) == {"$ref"} and seen < 16:
        try:
            schema = resolve_pointer(root, schema["$ref"])
        except (KeyError, IndexError, ValueError):
            return schema
        seen += 1
    return schema


def _values(schema: dict[str, Any]) -> set[str] | None:
    """The finite set of allowed instances (as typed canonical JSON), if `const`/`enum` bound it."""
    if "const" in schema:
        return {_canon(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {_canon(v) for v in schema["enum"]}
    return None


def _canon(value: Any) -> str:
    # Python says True == 1 == 1.0; JSON Schema says true != 1 but 1 == 1.0.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value, sort_keys=True)


def _types(schema: dict[str, Any]) -> set[str]:
    t = schema.get("type")
    if t is None:
        types = set(JSON_TYPES)
    else:
        types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set(JSON_TYPES)
    if "number" in types:
        types.add("integer")
    return types


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


Bound = tuple[float, bool]  # (value, strict)


def _interval(schema: dict[str, Any]) -> tuple[Bound, Bound]:
    lo: Bound = (-math.inf, False)
    hi: Bound = (math.inf, False)
    for key, strict in (("minimum", False), ("exclusiveMinimum", True)):
        v = schema.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and (v, strict) > lo:
            lo = (float(v), strict)
    for key, strict in (("maximum", False), ("exclusiveMaximum", True)):
        v = schema.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and (v, not strict) < (hi[0], not hi[1]):
            hi = (float(v), strict)
    return lo, hi


def _apart(a: tuple[Bound, Bound], b: tuple[Bound, Bound]) -> bool:
    """Every number `a` allows lies below every number `b` allows."""
    (_, (hi, hi_strict)), ((lo, lo_strict), _) = a, b
    return hi < lo or (hi == lo and (hi_strict or lo_strict))
