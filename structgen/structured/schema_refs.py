"""`$ref` housekeeping before normalization: references every backend can follow.

Targets under non-schema keys are hoisted into `$defs`, plain-name fragments ("#foo", from `$anchor` or a
draft-4..7 `id`) become JSON pointers, and references to a boolean schema become that boolean.
"""

from __future__ import annotations

import copy
from typing import Any

from structgen.structured.schema_walk import iter_subschemas, map_subschemas, resolve_pointer


def hoist_ref_targets(root: Any) -> Any:
    """Copy every `$ref` target other than the root or a top-level `$defs`/`definitions` entry into `$defs`,
    and point the references there. Pointers such as `#/ddd/x` (under a non-schema key, where a backend
    does not look) or `#/allOf/1/not` (into a spot normalization rewrites) then stay valid."""
    if not isinstance(root, dict):
        return root
    hoisted: dict[str, str] = {}
    copied = False
    for _ in range(64):
        stray = [
            (node, node["$ref"])
            for _, node in iter_subschemas(root)
            if isinstance(node.get("$ref"), str)
            and node["$ref"].startswith("#/")
            and not _stable(node["$ref"])
        ]
        movable = []
        for node, ref in stray:
            try:
                movable.append((node, ref, resolve_pointer(root, ref)))
            except (KeyError, IndexError, ValueError):
                continue  # dangling: reported by the support checks
        if not movable:
            return root
        if not copied:
            root, copied = copy.deepcopy(root), True
            continue  # find the same nodes again in the copy
        for node, ref, target in movable:
            if ref not in hoisted:
                name = f"structgen_ref{len(hoisted)}"
                root.setdefault("$defs", {})[name] = copy.deepcopy(target)
                hoisted[ref] = f"#/$defs/{name}"
            node["$ref"] = hoisted[ref]
    return root


def _stable(ref: str) -> bool:
    parts = ref[2:].split("/")
    return len(parts) == 2 and parts[0] in ("$defs", "definitions")


def inline_boolean_refs(node: Any, root: Any = None) -> Any:
    """`{"$ref": p}` whose target is `true`/`false` becomes that boolean (llguidance refuses a reference to
    `false` even where it is meaningful, as in `patternProperties`)."""
    root = node if root is None else root
    if not isinstance(node, dict):
        return node
    if set(node) == {"$ref"} and isinstance(node["$ref"], str):
        try:
            target = resolve_pointer(root, node["$ref"])
        except (KeyError, IndexError, ValueError):
            target = None
        if isinstance(target, bool):
            return target
    return map_subschemas(node, "", lambda child, _: inline_boolean_refs(child, root))


def anchors(root: Any, *, legacy_ids: bool) -> dict[str, str]:
    """Plain-name fragments ("#foo") → JSON pointers of the subschemas that declare them (`$anchor`, or a
    fragment-only `id`/`$id` in drafts 4-7)."""
    out: dict[str, str] = {}
    for path, node in iter_subschemas(root):
        names = []
        if isinstance(node.get("$anchor"), str):
            names.append("#" + node["$anchor"])
        for key in ("id", "$id") if legacy_ids else ():
            value = node.get(key)
            if isinstance(value, str) and value.startswith("#") and len(value) > 1:
                names.append(value)
        for name in names:
            out.setdefault(name, path)
    return out
