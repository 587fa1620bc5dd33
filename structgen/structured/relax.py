"""Relaxation: for a keyword no chosen grammar can enforce, generate under the nearest schema it can enforce
(a superset of the valid instances) and validate each output against the original schema afterwards.

Only the reported keyword at the reported JSON pointer is widened, so the rest of the schema stays exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from structgen.structured.normalize import SchemaChange
from structgen.structured.schema_walk import ASSERTION_KEYWORDS, map_subschemas
from structgen.structured.support import Unsupported

# Keywords that only mean something together are widened together.
_GROUPS = {
    "contains": ("contains", "minContains", "maxContains"),
    "minContains": ("contains", "minContains", "maxContains"),
    "maxContains": ("contains", "minContains", "maxContains"),
    "minProperties": ("minProperties", "maxProperties"),
    "maxProperties": ("minProperties", "maxProperties"),
    "minLength": ("minLength", "maxLength"),
    "maxLength": ("minLength", "maxLength"),
    "dependentRequired": ("dependentRequired", "dependentSchemas"),
    "dependentSchemas": ("dependentRequired", "dependentSchemas"),
}


def relax(schema: Any, findings: Iterable[Unsupported]) -> tuple[Any, list[SchemaChange]]:
    """Widen each finding's keyword at its path; returns the new schema and what was done."""
    todo: dict[str, dict[str, Unsupported]] = {}
    for f in findings:
        todo.setdefault(f.path, {}).setdefault(f.keyword, f)
    changes: list[SchemaChange] = []

    def visit(node: Any, path: str) -> Any:
        if not isinstance(node, dict):
            return node
        node = map_subschemas(node, path, visit)
        for keyword, finding in todo.get(path, {}).items():
            node = _widen(node, keyword)
            changes.append(SchemaChange(path, keyword, "relax", finding.reason))
        return node

    return visit(schema, "#"), changes


def _widen(node: dict[str, Any], keyword: str) -> dict[str, Any]:
    node = dict(node)
    if keyword == "oneOf" and isinstance(node.get("oneOf"), list):
        # anyOf accepts every instance oneOf accepts (and those matching several branches).
        branches = node.pop("oneOf")
        if "anyOf" in node:
            node["allOf"] = [*node.get("allOf", []), {"anyOf": branches}]
        else:
            node["anyOf"] = branches
    elif keyword in ("if", "then", "else"):
        cond, then, other = node.pop("if", True), node.pop("then", True), node.pop("else", True)
        if other is not True:
            # (if and then) or (not-if and else) ⊆ (if and then) or else
            node["allOf"] = [*node.get("allOf", []), {"anyOf": [{"allOf": [cond, then]}, other]}]
    elif keyword == "patternProperties" and isinstance(node.get("patternProperties"), dict):
        # Keys outside `properties` then take any pattern's schema (or additionalProperties'): a superset.
        patterns = list(node.pop("patternProperties").values())
        extra = node.get("additionalProperties", True)
        if extra is not True and patterns:
            branches = patterns + ([] if extra is False else [extra])
            node["additionalProperties"] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    elif keyword == "$ref" and "$ref" in node:
        # Keep the reference, drop what a backend would have ignored next to it.
        node = {k: v for k, v in node.items() if k == "$ref" or k not in ASSERTION_KEYWORDS}
    elif keyword == "$ref":
        # An applicator over references: keep it, drop the keywords it would have to be intersected with.
        keep = ("anyOf", "oneOf", "allOf")
        node = {k: v for k, v in node.items() if k in keep or k not in ASSERTION_KEYWORDS}
    elif keyword == "allOf" and isinstance(node.get("allOf"), list):
        node["allOf"] = node["allOf"][:1]
    else:
        for key in _GROUPS.get(keyword, (keyword,)):
            node.pop(key, None)
    return node
