"""Recursive schemas served by a bounded unrolling of their `$ref` cycles: the `restricted` serving path.

Backends cannot follow every reference cycle: llguidance refuses "circular references with sibling keys", common
in document and content schemas (`{"$ref": "#/definitions/node", "description": ...}` inside the node it points
to, or an `anyOf` of such references next to a `type`). Unrolling turns each definition on a cycle into copies by
depth: copy i's references into the cycle point at copy i + 1, and the last copy's become `false`. The schema
then has no cycle left for a backend to refuse, and instances nest at most `depth` levels into each cycle.

Replacing a subschema by a stricter one only removes instances where it sits in a positive position (not under
`not`, `if` or `oneOf`, whose outcome can flip when a branch accepts less): there every output the unrolled
grammar allows is valid under the original schema, a *restriction*. Where a cycle is reachable through such a
position the unrolled schema is a "relax" change instead, so outputs are validated against the original (and
retried) as on the relaxed path.
"""

from __future__ import annotations

import copy
from typing import Any

from structgen.structured.normalize import SchemaChange
from structgen.structured.schema_walk import iter_subschemas, map_subschemas, pointer

DEFAULT_RECURSION_DEPTH = 4  # levels of each cycle the unrolled grammar generates
MAX_UNROLLED_DEFINITIONS = 2000  # beyond this the unrolled schema is more than any backend compiles quickly
_CONTAINERS = ("$defs", "definitions")
_ROOT_NAME = "structgen_root"
_NON_MONOTONE = ("not", "if", "oneOf")


def unroll_cycles(
    schema: Any, *, depth: int = DEFAULT_RECURSION_DEPTH
) -> tuple[Any, list[SchemaChange]] | None:
    """`schema` with its reference cycles unrolled to `depth`, and one change per definition on a cycle; None
    when it has no cycle, or references this cannot follow (anything but "#" and top-level definitions)."""
    if depth < 1:
        raise ValueError(f"recursion depth must be >= 1, got {depth}")
    if not isinstance(schema, dict):
        return None
    graph = _reference_graph(schema)
    if graph is None:
        return None
    cyclic = _cyclic(graph)
    if not cyclic:
        return None
    if len(cyclic) * depth > MAX_UNROLLED_DEFINITIONS:
        return None
    root = copy.deepcopy(schema)
    if "#" in cyclic:  # the root itself recurses: move its body into a definition, so it can be copied
        root, cyclic = _lift_root(root), {_lifted(p) for p in cyclic}
    monotone = not _reaches_through_negation(root, cyclic)

    def target(ref: str, level: int) -> str | None:
        """Where a reference from copy `level` of a cycle points; None past the depth (becomes `false`)."""
        if ref not in cyclic:
            return ref
        if level + 1 >= depth:
            return None
        return _copy_pointer(ref, level + 1)

    def rewrite(node: Any, level: int) -> Any:
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str):
            where = target(ref, level)
            if where is None:
                return False  # `false` and anything beside it is `false`
            node = {**node, "$ref": where}
        return map_subschemas(node, "", lambda child, _: rewrite(child, level))

    for ref in sorted(cyclic):
        container, name = _split(ref)
        body = root[container][name]
        for level in range(depth - 1, -1, -1):
            copy_name = name if level == 0 else _copy_name(name, level)
            root[container][copy_name] = rewrite(body, level)
    kind = "restrict" if monotone else "relax"
    why = "" if monotone else " (the cycle sits under not/if/oneOf: outputs are validated)"
    changes = [
        SchemaChange(
            ref,
            "$ref",
            kind,
            f"recursive reference unrolled to depth {depth}: deeper nesting is not generated{why}",
        )
        for ref in sorted(cyclic)
    ]
    return root, changes


def _reference_graph(schema: dict[str, Any]) -> dict[str, set[str]] | None:
    """Each node ("#" and every top-level definition) → the nodes it references."""
    nodes = {"#": _without_definitions(schema)}
    for container in _CONTAINERS:
        defs = schema.get(container)
        if isinstance(defs, dict):
            for name, body in defs.items():
                nodes[pointer("#/" + container, name)] = body
    graph: dict[str, set[str]] = {}
    for here, body in nodes.items():
        refs: set[str] = set()
        for _, node in iter_subschemas(body):
            ref = node.get("$ref")
            if isinstance(ref, str):
                if ref not in nodes:
                    return None  # a pointer into the middle of a schema, or remote: not followed here
                refs.add(ref)
        graph[here] = refs
    return graph


def _without_definitions(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k not in _CONTAINERS}


def _cyclic(graph: dict[str, set[str]]) -> set[str]:
    """Nodes on a cycle: in a strongly connected component of two or more, or referencing themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: set[str] = set()
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]  # iterative Tarjan: schemas can nest deeply
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    out.update(component)
    return out


def _lift_root(root: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in root.items() if k not in (*_CONTAINERS, "$schema", "$id", "id")}
    lifted = {k: v for k, v in root.items() if k in (*_CONTAINERS, "$schema", "$id", "id")}
    lifted.setdefault("$defs", {})
    lifted["$defs"] = {**lifted["$defs"], _ROOT_NAME: body}
    lifted["$ref"] = "#/$defs/" + _ROOT_NAME

    def repoint(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node.get("$ref") == "#":
            node = {**node, "$ref": "#/$defs/" + _ROOT_NAME}
        return map_subschemas(node, "", lambda child, _: repoint(child))

    return repoint(lifted)


def _lifted(ref: str) -> str:
    return "#/$defs/" + _ROOT_NAME if ref == "#" else ref


def _copy_name(name: str, level: int) -> str:
    return f"{name}__depth{level}"


def _split(ref: str) -> tuple[str, str]:
    """ "#/$defs/a~1b" → ("$defs", "a/b"): the container and the definition's own name."""
    container, token = ref[2:].split("/", 1)
    return container, token.replace("~1", "/").replace("~0", "~")


def _copy_pointer(ref: str, level: int) -> str:
    container, name = _split(ref)
    return pointer("#/" + container, _copy_name(name, level))


def _reaches_through_negation(root: dict[str, Any], cyclic: set[str]) -> bool:
    """Whether some cycle is reachable from under `not`, `if` or `oneOf` (where a stricter subschema can make the
    whole accept more)."""
    graph = _reference_graph(root) or {}
    reach: dict[str, set[str]] = {}

    def reachable(start: str) -> set[str]:
        if start not in reach:
            seen, todo = {start}, [start]
            while todo:
                for nxt in graph.get(todo.pop(), ()):
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
            reach[start] = seen
        return reach[start]

    for path, node in iter_subschemas(root):
        tokens = path.split("/")
        if not any(t in _NON_MONOTONE for t in tokens):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and reachable(ref) & cyclic:
            return True
    return False
