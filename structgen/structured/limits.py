"""Pre-compile complexity limits: refuse a spec whose compile cost could be unbounded before any backend
(or the normalizer, which recurses) sees it.

Backends compile in native code that cannot be interrupted, and some are super-linear in the width of an
object or an enum (llguidance takes 45 s for 10,000 optional properties), so the only reliable bound on
compile time is a bound on the input. The walk here is iterative (a 1,000-level schema must not hit Python's
recursion limit) and stops at the first violation; the error names the keyword, its JSON path and the limit.
The defaults keep all 8,865 JSONSchemaBench schemas inside (their maxima: depth 63, 8,726 JSON values,
133 properties in one object, 1,554 enum values, a 5,153-character pattern, 136 KB, 32 anyOf branches).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from structgen.structured.errors import UnsupportedSchemaError
from structgen.structured.schema_walk import LIST_SUBSCHEMA, MAP_SUBSCHEMA, SINGLE_SUBSCHEMA, pointer

if TYPE_CHECKING:  # spec.py imports this module lazily (deep schemas), so no import cycle at run time
    from structgen.structured.spec import StructuredSpec

_BRANCH_KEYWORDS = ("anyOf", "oneOf", "allOf")
# What a keyword's value holds; anything else (enum/const/default, annotations, unknown keywords) is data:
# counted toward the size limits, never read as keywords.
_ROLES = {**dict.fromkeys(SINGLE_SUBSCHEMA + LIST_SUBSCHEMA, "schema"), **dict.fromkeys(MAP_SUBSCHEMA, "map")}
_MAX_PATH_CHARS = 160


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """Bounds on what one spec may contain; each is checked before compiling (fields of
    `StructuredOutputConfig.limits`)."""

    max_depth: int = 128  # nesting of JSON containers (a subschema level is two: `properties` + the name)
    max_nodes: int = 50_000  # JSON values in the whole schema
    max_properties: int = 1_000  # entries of one `properties`
    max_enum_values: int = 10_000  # values of one `enum`; also the entries of a `choice` spec
    max_branches: int = 1_000  # entries of one anyOf / oneOf / allOf
    max_pattern_length: int = 10_000  # characters of one `pattern` / patternProperties key / regex spec
    max_spec_bytes: int = 1_000_000  # the canonical spec text (schema JSON, regex or grammar source)

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SchemaLimits.{name} must be a positive int, got {value!r}")

    def check(self, spec: StructuredSpec) -> None:
        """Raise UnsupportedSchemaError if `spec` exceeds a limit."""
        size = len(spec.text.encode("utf-8"))
        # A spec far over the size limit is not even parsed; otherwise the walk names the keyword to blame.
        if size > 8 * self.max_spec_bytes:
            raise self._too_big(spec, size)
        if spec.kind == "regex" and len(spec.text) > self.max_pattern_length:
            raise _over(
                f"the regex has {len(spec.text):,} characters", "max_pattern_length", self.max_pattern_length
            )
        if spec.kind == "choice":
            n = len(spec.choices())
            if n > self.max_enum_values:
                raise _over(f"{n:,} choices", "max_enum_values", self.max_enum_values)
        if spec.kind == "json_schema":
            try:
                schema = spec.schema()
            except RecursionError:
                raise _over("the schema nests too deeply to be parsed", "max_depth", self.max_depth) from None
            self.check_schema(schema)
        if size > self.max_spec_bytes:
            raise self._too_big(spec, size)

    def _too_big(self, spec: StructuredSpec, size: int) -> UnsupportedSchemaError:
        return _over(f"the {spec.kind} spec has {size:,} bytes", "max_spec_bytes", self.max_spec_bytes)

    def check_schema(self, schema: Any) -> None:
        """Walk a JSON Schema without recursion; raise at the first value past a limit."""
        # (value, JSON pointer, depth, keyword it sits under, role): role "schema" is a subschema, "map"
        # the name → subschema object of `properties` etc., "data" the inside of enum/const/default.
        stack: list[tuple[Any, str, int, str | None, str]] = [(schema, "#", 1, None, "schema")]
        nodes = 0
        while stack:
            value, path, depth, keyword, role = stack.pop()
            nodes += 1
            if nodes > self.max_nodes:
                raise _over(
                    f"the schema has more than {self.max_nodes:,} JSON values", "max_nodes", self.max_nodes
                )
            if depth > self.max_depth and isinstance(value, dict | list):
                raise _over(
                    f"the schema nests deeper than {self.max_depth} levels",
                    "max_depth",
                    self.max_depth,
                    keyword=keyword,
                    path=path,
                )
            if isinstance(value, dict):
                if role == "schema":
                    self._check_node(value, path)
                for key, child in value.items():
                    if role == "schema":
                        child_role = _ROLES.get(key, "data")
                        stack.append((child, pointer(path, key), depth + 1, key, child_role))
                    else:  # a property name (role "map") or data: the keyword stays the enclosing one
                        stack.append(
                            (
                                child,
                                pointer(path, key),
                                depth + 1,
                                keyword,
                                "data" if role == "data" else "schema",
                            )
                        )
            elif isinstance(value, list):
                for i, child in enumerate(value):
                    stack.append((child, pointer(path, i), depth + 1, keyword, role))

    def _check_node(self, node: dict[str, Any], path: str) -> None:
        for keyword, ok, what in _SHAPES:
            if keyword in node and not ok(node[keyword]):
                # A malformed keyword is refused here: some backends would compile it as if it were absent
                # (outlines takes 20 s on `{"type": "object", "required": "a"}`).
                got = json.dumps(node[keyword], ensure_ascii=False, default=str)
                got = got if len(got) <= 60 else got[:57] + "..."
                raise UnsupportedSchemaError(
                    f"the value must be {what}, got {got}", keyword=keyword, path=_short(path)
                )
        for keyword, attr, what in (
            ("properties", "max_properties", "properties"),
            ("enum", "max_enum_values", "values"),
            *((k, "max_branches", "branches") for k in _BRANCH_KEYWORDS),
        ):
            value = node.get(keyword)
            limit = getattr(self, attr)
            if isinstance(value, dict | list) and len(value) > limit:
                raise _over(f"{len(value):,} {what}", attr, limit, keyword=keyword, path=path)
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns.extend(node["patternProperties"])
        for regex in patterns:
            if len(regex) > self.max_pattern_length:
                keyword = "pattern" if regex is node.get("pattern") else "patternProperties"
                raise _over(
                    f"a pattern of {len(regex):,} characters",
                    "max_pattern_length",
                    self.max_pattern_length,
                    keyword=keyword,
                    path=path,
                )


def too_deep(value: Any) -> str:
    """Why a value too deep for Python's JSON encoder is refused (the default limits name keyword, path and
    limit; that encoder gives up near 1,000 levels, far past `max_depth`)."""
    try:
        SchemaLimits().check_schema(value)
    except UnsupportedSchemaError as error:
        return str(error)
    return "the schema nests too deeply to be serialized as JSON"


_JSON_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})


def _is_type(value: Any) -> bool:
    if isinstance(value, str):
        return value in _JSON_TYPES
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, str) and t in _JSON_TYPES for t in value)
    )


def _is_schema(value: Any) -> bool:
    return isinstance(value, dict | bool)


def _is_branches(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(map(_is_schema, value))


_SHAPES: tuple[tuple[str, Any, str], ...] = (
    ("type", _is_type, "a JSON type name or a non-empty list of them"),
    ("required", lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v), "an array of strings"),
    (
        "properties",
        lambda v: isinstance(v, dict) and all(map(_is_schema, v.values())),
        "an object of schemas",
    ),
    ("enum", lambda v: isinstance(v, list), "an array"),
    ("pattern", lambda v: isinstance(v, str), "a string"),
    ("items", lambda v: _is_schema(v) or isinstance(v, list), "a schema"),
    ("additionalProperties", _is_schema, "a schema"),
    *((k, _is_branches, "a non-empty array of schemas") for k in _BRANCH_KEYWORDS),
)


def _short(path: str) -> str:
    if len(path) <= _MAX_PATH_CHARS:
        return path
    return f"{path[: _MAX_PATH_CHARS // 2]}/…/{path[-_MAX_PATH_CHARS // 2 :]}"


def _over(
    what: str, attr: str, limit: int, *, keyword: str | None = None, path: str | None = None
) -> UnsupportedSchemaError:
    return UnsupportedSchemaError(
        f"{what}, over the limit of {limit:,} (StructuredOutputConfig.limits.{attr})",
        keyword=keyword,
        path=None if path is None else _short(path),
    )
