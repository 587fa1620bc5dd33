"""What each backend enforces exactly, checked before compiling.

A backend that refuses a keyword is harmless (we fall back); one that compiles but ignores it is not, so
for xgrammar and outlines-core these tables are the authority: measured on probe schemas with labelled
instances, anything a backend was seen to ignore or loosen (xgrammar: `oneOf` → anyOf semantics, allOf
with several branches, length bounds next to a pattern/format/enum, `multipleOf` on non-integers,
`uniqueItems`, `contains`, `not`, `if`, `patternProperties`/`propertyNames`; outlines-core: numeric bounds,
`multipleOf`, `min/maxProperties`, `uniqueItems`, ...) is listed as unsupported and relaxed explicitly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from structgen.structured.schema_walk import ASSERTION_KEYWORDS, iter_subschemas, resolve_pointer

LENGTH_KEYWORDS = ("minLength", "maxLength")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_BACKREF = re.compile(r"\\[1-9]|\\k<")
_UNICODE_CLASS = re.compile(r"\\[pP]\{")


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A keyword (at a JSON pointer) that a backend cannot enforce exactly."""

    keyword: str
    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class SchemaSupport:
    keywords: frozenset[str]
    formats: frozenset[str]
    length_beside_pattern: bool = True  # minLength/maxLength next to pattern, format, enum or const
    multiple_of_non_integer: bool = True
    several_all_of: bool = True
    unicode_classes: bool = True  # \p{..} in patterns
    ref_siblings: bool = True  # keywords next to $ref
    # Past this many optional properties in one object the backend is not tried at all (None: no bound):
    # xgrammar's compile time grows steeply (5 s for 128 on cl100k, >100 s for 1,000); llguidance compiles
    # 1,000 in 0.3 s but then fails at the first `{` (an Earley row of 4n+7 items over its 2,000 limit).
    max_optional_properties: int | None = None

    def find_unsupported(self, schema: Any) -> list[Unsupported]:
        found: list[Unsupported] = []
        for path, node in iter_subschemas(schema):
            found.extend(self._check_node(node, path))
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                try:
                    resolve_pointer(schema, ref)
                except (KeyError, IndexError, ValueError):
                    # Some backends fail, others quietly allow anything there.
                    found.append(Unsupported("$ref", path, f"$ref {ref!r} points to nothing in the schema"))
        return found

    def _check_node(self, node: dict[str, Any], path: str) -> list[Unsupported]:
        out = []
        for key in node:
            if key in ASSERTION_KEYWORDS and key not in self.keywords:
                if key in ("then", "else") and "if" in node:
                    continue  # reported once, as `if`
                out.append(Unsupported(key, path, "not enforced by this backend"))
        fmt = node.get("format")
        if fmt is not None and "format" in self.keywords and fmt not in self.formats:
            out.append(Unsupported("format", path, f"format {fmt!r} is not enforced by this backend"))
        if not self.length_beside_pattern and any(k in node for k in LENGTH_KEYWORDS):
            beside = [k for k in ("pattern", "format", "enum", "const") if k in node]
            if beside:
                key = next(k for k in LENGTH_KEYWORDS if k in node)
                out.append(
                    Unsupported(key, path, f"length bounds next to {beside[0]} are ignored by this backend")
                )
        if not self.multiple_of_non_integer and "multipleOf" in node and node.get("type") != "integer":
            out.append(Unsupported("multipleOf", path, "multipleOf is enforced for integers only"))
        if not self.several_all_of and isinstance(node.get("allOf"), list):
            # Normalization folds mergeable branches into the node, so a lone branch left beside other
            # assertions (e.g. `type: string` + `allOf: [{type: integer}]`) still needs a real intersection.
            beside = [k for k in node if k in ASSERTION_KEYWORDS and k != "allOf"]
            if len(node["allOf"]) > 1 or (node["allOf"] and beside):
                out.append(Unsupported("allOf", path, "allOf is not intersected with other assertions"))
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            out.append(Unsupported("$ref", path, f"$ref {ref!r} is not local and cannot be fetched offline"))
        if not self.ref_siblings and "$ref" in node:
            beside = sorted(k for k in node if k in ASSERTION_KEYWORDS and k != "$ref")
            if beside:
                out.append(
                    Unsupported("$ref", path, f"keywords next to $ref ({', '.join(beside)}) are ignored")
                )
        props = node.get("properties")
        if self.max_optional_properties is not None and isinstance(props, dict):
            required = node.get("required") if isinstance(node.get("required"), list) else []
            optional = len(props.keys() - set(required))
            if optional > self.max_optional_properties:
                out.append(
                    Unsupported(
                        "properties",
                        path,
                        f"{optional} optional properties compile too slowly in this backend "
                        f"(bound: {self.max_optional_properties})",
                    )
                )
        if isinstance(node.get("pattern"), str):
            reason = self.regex_problem(node["pattern"])
            if reason:
                out.append(Unsupported("pattern", path, reason))
        if isinstance(node.get("patternProperties"), dict) and "patternProperties" in self.keywords:
            for regex in node["patternProperties"]:
                reason = self.regex_problem(regex)
                if reason:
                    out.append(Unsupported("patternProperties", path, reason))
                    break
        return out

    def regex_problem(self, regex: str) -> str | None:
        if _LOOKAROUND.search(regex):
            return "look-around in a regex is not supported"
        if _BACKREF.search(regex):
            return "backreferences in a regex are not supported"
        if not self.unicode_classes and _UNICODE_CLASS.search(regex):
            return "unicode classes (\\p{..}) in a regex are not supported"
        return None


_CORE = frozenset(
    {
        "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "anyOf", "$ref",
    }
)  # fmt: skip
_NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_XGRAMMAR_FORMATS = frozenset(
    {
        "date-time", "time", "date", "duration", "email", "ipv4", "ipv6", "uri", "uuid", "json-pointer",
        "relative-json-pointer",
    }
)  # fmt: skip

LLGUIDANCE_SUPPORT = SchemaSupport(
    keywords=_CORE | _NUMERIC | {"allOf", "oneOf", "patternProperties", "minProperties", "maxProperties"},
    formats=frozenset(
        {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"}
    ),
    max_optional_properties=400,
)
XGRAMMAR_SUPPORT = SchemaSupport(
    # min/maxProperties: seen ignored next to optional properties.
    keywords=_CORE | _NUMERIC | {"allOf"},
    formats=_XGRAMMAR_FORMATS,
    length_beside_pattern=False,
    multiple_of_non_integer=False,
    several_all_of=False,
    unicode_classes=False,
    ref_siblings=False,
    max_optional_properties=64,
)
OUTLINES_SUPPORT = SchemaSupport(
    keywords=_CORE,
    # Its date-time and time patterns make the UTC offset optional: looser than RFC 3339.
    formats=frozenset({"date", "email", "uri", "uuid"}),
    length_beside_pattern=False,
    unicode_classes=False,
    ref_siblings=False,
    max_optional_properties=64,
)
