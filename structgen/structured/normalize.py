"""Schema normalization: rewrite a user's JSON Schema into plain draft 2020-12 that the backends enforce
exactly, before any backend sees it.

Every change is recorded. "rewrite" changes keep the set of valid instances identical (draft-4/6/7 forms,
`oneOf` whose branches are provably disjoint → `anyOf`, `dependentRequired`/`dependentSchemas` → key-presence
cases, provable negations, unknown `format` values, which the spec makes annotations). Annotations and
unknown keywords are dropped silently: no validator looks at them. What cannot be rewritten exactly stays in
place for `relax.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from structgen.structured.schema_logic import disjoint, negate
from structgen.structured.schema_refs import anchors, hoist_ref_targets, inline_boolean_refs
from structgen.structured.schema_walk import (
    ASSERTION_KEYWORDS,
    JSON_TYPES,
    STRUCTURAL_KEYWORDS,
    iter_subschemas,
    map_subschemas,
)

Draft = Literal["draft4", "draft6", "draft7", "draft2019-09", "draft2020-12"]
ServingPath = Literal["exact", "rewritten", "restricted", "relaxed"]

_DRAFT_MARKERS: tuple[tuple[str, Draft], ...] = (
    ("draft-03", "draft4"),
    ("draft-04", "draft4"),
    ("draft-06", "draft6"),
    ("draft-07", "draft7"),
    ("2019-09", "draft2019-09"),
    ("2020-12", "draft2020-12"),
)
_LEGACY = ("draft4", "draft6", "draft7")
# Formats some backend enforces or our validator checks; any other value is an annotation.
ENFORCEABLE_FORMATS = frozenset(
    {
        "date-time", "time", "date", "duration", "email", "idn-email", "hostname", "idn-hostname",
        "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "json-pointer",
        "relative-json-pointer", "regex",
    }
)  # fmt: skip
# Applicators that evaluate properties/items in place, which `unevaluated*` would see.
_IN_PLACE = (
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "$ref",
    "$dynamicRef",
    "dependentSchemas",
)
_OBJECT_KEYWORDS = frozenset(
    {
        "properties", "patternProperties", "additionalProperties", "unevaluatedProperties", "required",
        "minProperties", "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas",
    }
)  # fmt: skip
# Keywords whose meaning depends on their neighbours in the same object: an allOf branch holding one of a
# group is merged into its parent only if the parent holds none of that group.
_ADJACENT = (
    frozenset({"properties", "patternProperties", "additionalProperties", "unevaluatedProperties"}),
    frozenset({"prefixItems", "items", "contains", "unevaluatedItems"}),
    frozenset({"contains", "minContains", "maxContains"}),
    frozenset({"if", "then", "else"}),
)


@dataclass(frozen=True, slots=True)
class SchemaChange:
    """One change made to serve a schema: `kind` "rewrite" keeps its meaning, "restrict" narrows it (every
    instance it allows is valid under the original: a recursion depth limit, `unroll.py`), "relax" widens it
    (outputs are then validated against the original)."""

    path: str
    keyword: str
    kind: Literal["rewrite", "restrict", "relax"]
    note: str


@dataclass(frozen=True, slots=True)
class NormalizedSchema:
    schema: dict[str, Any] | bool
    changes: tuple[SchemaChange, ...]
    draft: Draft

    @property
    def serving_path(self) -> ServingPath:
        return serving_path(self.changes)


def serving_path(changes: tuple[SchemaChange, ...] | list[SchemaChange]) -> ServingPath:
    if any(c.kind == "relax" for c in changes):
        return "relaxed"
    if any(c.kind == "restrict" for c in changes):
        return "restricted"
    return "rewritten" if changes else "exact"


def detect_draft(schema: Any) -> Draft:
    """The draft a validator would apply: `$schema` when it names one, else draft 7 if the schema uses
    forms that 2020-12 dropped (array `items`, `additionalItems`, `dependencies`), else 2020-12."""
    if isinstance(schema, dict) and isinstance(schema.get("$schema"), str):
        for marker, draft in _DRAFT_MARKERS:
            if marker in schema["$schema"]:
                return draft
    for _, node in iter_subschemas(schema):
        if isinstance(node.get("items"), list) or "additionalItems" in node or "dependencies" in node:
            return "draft7"
        if isinstance(node.get("exclusiveMinimum"), bool) or isinstance(node.get("exclusiveMaximum"), bool):
            return "draft4"
    return "draft2020-12"


def normalize_schema(schema: Any) -> NormalizedSchema:
    draft = detect_draft(schema)
    schema = hoist_ref_targets(schema)
    normalizer = _Normalizer(draft, schema)
    out = inline_boolean_refs(normalizer.visit(schema, "#"))
    return NormalizedSchema(schema=out, changes=tuple(normalizer.changes), draft=draft)


class _Normalizer:
    def __init__(self, draft: Draft, root: Any):
        self.draft = draft
        self.root = root
        self.changes: list[SchemaChange] = []
        self.anchors = anchors(root, legacy_ids=draft in _LEGACY)

    def rewrite(self, path: str, keyword: str, note: str) -> None:
        self.changes.append(SchemaChange(path, keyword, "rewrite", note))

    def visit(self, node: Any, path: str) -> Any:
        if not isinstance(node, dict):
            return node
        node = self._legacy_forms(dict(node), path)
        node = {k: v for k, v in node.items() if k in ASSERTION_KEYWORDS or k in STRUCTURAL_KEYWORDS}
        # The output is 2020-12 whatever the input's draft; a stale `$schema` would make a draft-aware
        # backend ignore keywords the older draft lacks (llguidance drops `const` under draft-04).
        node.pop("$schema", None)
        node = map_subschemas(node, path, self.visit)
        for step in (
            self._simple_forms,
            self._impossible_objects,
            self._format,
            self._integer_bounds,
            self._one_of,
            self._dependencies,
            self._not,
            self._if_then_else,
            self._unevaluated,
            self._merge_all_of,
        ):
            if not isinstance(node, dict):
                break
            node = step(node, path)
        return node

    # -- draft 4/6/7/2019-09 forms ------------------------------------------------------------------------

    def _legacy_forms(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        d = self.draft
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in self.anchors:
            node["$ref"] = self.anchors[ref]
            self.rewrite(path, "$ref", f"anchor {ref} → JSON pointer {self.anchors[ref]}")
        if "$ref" in node and d in _LEGACY:
            dropped = sorted(k for k in node if k in ASSERTION_KEYWORDS and k != "$ref")
            if dropped:
                self.rewrite(path, "$ref", f"{d} ignores keywords next to $ref: dropped {', '.join(dropped)}")
            node = {k: v for k, v in node.items() if k not in ASSERTION_KEYWORDS or k == "$ref"}
        for bound, exclusive in (("maximum", "exclusiveMaximum"), ("minimum", "exclusiveMinimum")):
            flag = node.get(exclusive)
            if isinstance(flag, bool):
                del node[exclusive]
                if flag and bound in node:
                    node[exclusive] = node.pop(bound)
                self.rewrite(path, exclusive, "draft-4 boolean form → numeric bound")
        items = node.get("items")
        if isinstance(items, list):
            node["prefixItems"] = items
            del node["items"]
            if "additionalItems" in node:
                node["items"] = node.pop("additionalItems")
            self.rewrite(path, "items", "array form of items → prefixItems")
        elif "additionalItems" in node:
            del node["additionalItems"]  # ignored unless `items` is an array
        deps = node.pop("dependencies", None)
        if isinstance(deps, dict) and d not in ("draft2019-09", "draft2020-12"):
            required = {k: v for k, v in deps.items() if isinstance(v, list)}
            schemas = {k: v for k, v in deps.items() if not isinstance(v, list)}
            if required:
                node["dependentRequired"] = {**node.get("dependentRequired", {}), **required}
            if schemas:
                node["dependentSchemas"] = {**node.get("dependentSchemas", {}), **schemas}
            self.rewrite(path, "dependencies", "dependencies → dependentRequired / dependentSchemas")
        return node

    # -- exact rewrites --------------------------------------------------------------------------------

    def _simple_forms(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) == 1 and "const" not in node:
            node["const"] = enum[0]
            del node["enum"]
        t = node.get("type")
        if isinstance(t, list):
            t = list(dict.fromkeys(t))
            node["type"] = t[0] if len(t) == 1 else t
        if isinstance(node.get("allOf"), list) and not node["allOf"]:
            del node["allOf"]
        return node

    def _impossible_objects(self, node: dict[str, Any], path: str) -> Any:
        # A required name that `properties`/`additionalProperties` forbid: no object fits. Said plainly, so
        # a backend refuses it instead of quietly dropping the `required` (xgrammar does).
        if not isinstance(node.get("required"), list):
            return node
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        closed = node.get("additionalProperties") is False and not node.get("patternProperties")
        blocked = [r for r in node["required"] if props.get(r) is False or (closed and r not in props)]
        if not blocked:
            return node
        self.rewrite(path, "required", f"required {blocked[0]!r} is forbidden here: no object is valid")
        types = node.get("type")
        allowed = (
            [types]
            if isinstance(types, str)
            else list(types)
            if isinstance(types, list)
            else list(JSON_TYPES)
        )
        allowed = [t for t in allowed if t != "object"]
        if not allowed:
            return False
        # Non-objects still face every other keyword; the object-only ones no longer matter.
        node = {k: v for k, v in node.items() if k not in _OBJECT_KEYWORDS}
        node["type"] = allowed[0] if len(allowed) == 1 else allowed
        return node

    def _format(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        fmt = node.get("format")
        if fmt is not None and fmt not in ENFORCEABLE_FORMATS:
            del node["format"]
            self.rewrite(path, "format", f"unknown format {fmt!r} is an annotation")
        return node

    def _integer_bounds(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        # Some backends take only whole bounds for integers; the integers inside are the same.
        if node.get("type") != "integer":
            return node
        for key, rounding in (
            ("minimum", math.ceil),
            ("maximum", math.floor),
            ("exclusiveMinimum", lambda v: math.floor(v) + 1),
            ("exclusiveMaximum", lambda v: math.ceil(v) - 1),
        ):
            v = node.get(key)
            if isinstance(v, float) and math.isfinite(v) and not v.is_integer():
                bound = "minimum" if "inimum" in key else "maximum"
                del node[key]
                new = int(rounding(v))
                old = node.get(bound)
                node[bound] = new if old is None else (max(old, new) if bound == "minimum" else min(old, new))
        return node

    def _one_of(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        branches = node.get("oneOf")
        if not isinstance(branches, list):
            return node
        pairs = ((a, b) for i, a in enumerate(branches) for b in branches[i + 1 :])
        if not all(disjoint(a, b, self.root) for a, b in pairs):
            return node
        del node["oneOf"]
        if "anyOf" in node:
            node["allOf"] = [*node.get("allOf", []), {"anyOf": branches}]
        else:
            node["anyOf"] = branches
        if len(branches) > 1:
            self.rewrite(path, "oneOf", "branches are pairwise disjoint: oneOf → anyOf")
        return node

    def _dependencies(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        cases = []
        for key, needed in (node.pop("dependentRequired", None) or {}).items():
            if isinstance(needed, list) and needed:
                cases.append({"anyOf": [{"properties": {key: False}}, {"required": [key, *needed]}]})
        for key, sub in (node.pop("dependentSchemas", None) or {}).items():
            if sub is not True and sub != {}:
                cases.append({"anyOf": [{"properties": {key: False}}, {"required": [key], "allOf": [sub]}]})
        if cases:
            node["allOf"] = [*node.get("allOf", []), *cases]
            self.rewrite(path, "dependentRequired", "key dependencies → anyOf of key-presence cases")
        return node

    def _not(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        if "not" not in node:
            return node
        negation = negate(node["not"])
        if negation is None:
            return node
        del node["not"]
        if negation is not True:
            node["allOf"] = [*node.get("allOf", []), negation]
        self.rewrite(path, "not", "negation rewritten without `not`")
        return node

    def _if_then_else(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        if "if" not in node:
            node.pop("then", None)
            node.pop("else", None)
            return node
        cond = node["if"]
        then, other = node.get("then", True), node.get("else", True)
        if then is True and other is True:
            for k in ("if", "then", "else"):
                node.pop(k, None)
            return node
        not_cond = negate(cond)
        if not_cond is None:
            return node
        for k in ("if", "then", "else"):
            node.pop(k, None)
        node["allOf"] = [
            *node.get("allOf", []),
            {"anyOf": [{"allOf": [cond, then]}, {"allOf": [not_cond, other]}]},
        ]
        self.rewrite(path, "if", "if/then/else → anyOf of (if and then) / (not-if and else)")
        return node

    def _unevaluated(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        if any(k in node for k in _IN_PLACE):
            return node
        if "unevaluatedProperties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = node.pop("unevaluatedProperties")
            self.rewrite(
                path, "unevaluatedProperties", "no in-place applicator: same as additionalProperties"
            )
        if "unevaluatedItems" in node and "items" not in node and "contains" not in node:
            node["items"] = node.pop("unevaluatedItems")
            self.rewrite(path, "unevaluatedItems", "no in-place applicator: same as items")
        return node

    def _merge_all_of(self, node: dict[str, Any], path: str) -> Any:
        # allOf[{properties...}, {required...}] is one object schema; backends that cannot intersect
        # several branches (xgrammar) then see a single schema. Only exact merges are made.
        branches = node.get("allOf")
        if not isinstance(branches, list):
            return node
        if any(b is False for b in branches):
            return False  # one impossible branch: nothing is valid here
        merged = {k: v for k, v in node.items() if k != "allOf"}
        rest: list[Any] = []
        queue = list(branches)
        while queue:
            b = queue.pop(0)
            if b is True or b == {}:
                continue
            if isinstance(b, dict) and set(b) == {"allOf"} and isinstance(b["allOf"], list):
                queue[:0] = b["allOf"]
                continue
            if isinstance(b, dict) and self._mergeable(merged, b):
                merged.update(b)
            else:
                rest.append(b)
        if rest:
            merged["allOf"] = rest
        return merged

    @staticmethod
    def _mergeable(into: dict[str, Any], branch: dict[str, Any]) -> bool:
        keys = set(branch)
        if keys & set(into) or keys & STRUCTURAL_KEYWORDS:
            return False
        if ("$ref" in keys and into.keys() & ASSERTION_KEYWORDS) or ("$ref" in into and keys):
            return False  # keep `$ref` apart: some backends ignore keywords next to it
        return not any(keys & group and set(into) & group for group in _ADJACENT)
