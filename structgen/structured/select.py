"""The `auto` policy: which backend serves a spec, and how.

For a JSON Schema: normalize (exact rewrites), then try each backend in preference order on the rewritten
schema; a backend whose support table flags a keyword is skipped without compiling, because it would
loosen it silently. A schema with reference cycles that no backend takes is tried again unrolled to
`recursion_depth` (`unroll.py`: the "restricted" path). If none can take it, relax (per backend, only the
keywords it cannot enforce) and serve under validation. Other kinds go to the first backend that compiles them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from structgen.structured.backend import Grammar, StructuredBackend
from structgen.structured.errors import CompileTimeoutError, UnsupportedSchemaError
from structgen.structured.normalize import SchemaChange, ServingPath, normalize_schema, serving_path
from structgen.structured.pick_hints import PickHints
from structgen.structured.relax import relax
from structgen.structured.schema_walk import resolve_pointer
from structgen.structured.spec import StructuredSpec
from structgen.structured.support import Unsupported
from structgen.structured.unroll import DEFAULT_RECURSION_DEPTH, unroll_cycles

AUTO_ORDER = ("llguidance", "xgrammar", "outlines")
_MAX_RELAX_STEPS = 32


@dataclass(frozen=True, slots=True)
class CompiledSpec:
    """A compiled spec: who serves it, how, and a pristine grammar that each request gets a copy of."""

    spec: StructuredSpec
    backend: str
    serving_path: ServingPath
    changes: tuple[SchemaChange, ...]
    prototype: Grammar
    compile_time_s: float
    refusals: tuple[str, ...] = ()
    # How lazy picks fared where, for every request this compile serves (a cost guess; see `pick_hints`).
    pick_hints: PickHints = field(default_factory=PickHints.shared, compare=False, repr=False)

    @property
    def needs_validation(self) -> bool:
        """Relaxed grammars accept more than the schema: outputs must be validated (and retried)."""
        return self.serving_path == "relaxed"

    def new_grammar(self) -> Grammar:
        return self.prototype.clone()


def compile_spec(
    spec: StructuredSpec,
    backends: Sequence[StructuredBackend],
    *,
    time_limit_s: float | None = None,
    recursion_depth: int = DEFAULT_RECURSION_DEPTH,
) -> CompiledSpec:
    """Compile with the first backend that can serve `spec` (see the module docstring). Past `time_limit_s`
    no further attempt starts (one already running in a library cannot be interrupted). `recursion_depth` 0
    turns the unrolling of reference cycles off."""
    start = time.perf_counter()
    deadline = None if time_limit_s is None else start + time_limit_s
    refusals: list[UnsupportedSchemaError] = []

    def done(backend: StructuredBackend, grammar: Grammar, changes: Sequence[SchemaChange]) -> CompiledSpec:
        return CompiledSpec(
            spec=spec,
            backend=backend.name,
            serving_path=serving_path(tuple(changes)),
            changes=tuple(changes),
            prototype=grammar,
            compile_time_s=time.perf_counter() - start,
            refusals=tuple(str(r) for r in refusals),
        )

    if spec.kind != "json_schema":
        for backend in backends:
            if spec.kind not in backend.kinds:
                continue
            _check_deadline(deadline, time_limit_s, spec)
            try:
                return done(backend, backend.compile(spec), ())
            except UnsupportedSchemaError as e:
                refusals.append(e)
        raise _final_error(spec, refusals, backends)

    normalized = normalize_schema(spec.schema())
    if normalized.schema is False:
        why = next((c.note for c in normalized.changes if c.path == "#"), "the schema is `false`")
        raise UnsupportedSchemaError(f"no JSON value satisfies this schema ({why})", path="#")

    def exact(candidate: Any, changes: list[SchemaChange]) -> CompiledSpec | None:
        """The first backend that takes `candidate` as it is, or None."""
        for backend in backends:
            found = backend.find_unsupported(candidate)
            if found:
                refusals.append(_as_error(found[0], backend.name))
                continue
            _check_deadline(deadline, time_limit_s, spec)
            try:
                return done(backend, backend.compile(spec.with_schema(candidate)), changes)
            except UnsupportedSchemaError as e:
                refusals.append(e)
        return None

    candidates: list[tuple[Any, list[SchemaChange]]] = [(normalized.schema, list(normalized.changes))]
    if (compiled := exact(*candidates[0])) is not None:
        return compiled
    candidates += _unrolled(*candidates[0], recursion_depth)  # tried next, before relaxing anything
    for candidate, changes in candidates[1:]:
        if (compiled := exact(candidate, changes)) is not None:
            return compiled

    for base, base_changes in candidates:
        for backend in backends:
            schema: Any = base
            changes = list(base_changes)
            for _ in range(_MAX_RELAX_STEPS):
                found = backend.find_unsupported(schema)
                if not found:
                    _check_deadline(deadline, time_limit_s, spec)
                    try:
                        return done(backend, backend.compile(spec.with_schema(schema)), changes)
                    except UnsupportedSchemaError as e:
                        if e.keyword is None or e.path is None:
                            refusals.append(e)
                            break
                        found = [Unsupported(e.keyword, e.path, str(e))]
                blocker = next((f for f in found if not _validatable(f, schema)), None)
                if blocker is not None:
                    refusals.append(_as_error(blocker, backend.name, validatable=False))
                    break
                widened, relaxed = relax(schema, found)
                if widened == schema:  # nothing left to widen there: this backend cannot serve the schema
                    refusals.append(_as_error(found[0], backend.name))
                    break
                schema = widened
                changes.extend(relaxed)
    raise _final_error(spec, refusals, backends)


def _unrolled(schema: Any, changes: list[SchemaChange], depth: int) -> list[tuple[Any, list[SchemaChange]]]:
    """`schema` with its reference cycles unrolled to `depth`, then shallower: a backend that refuses the deep
    form as too large may take a shallower one (at most three forms, each a full compile attempt)."""
    out = []
    for level in dict.fromkeys((depth, depth // 2, 1)) if depth > 0 else ():
        if level >= 1 and (unrolled := unroll_cycles(schema, depth=level)) is not None:
            out.append((unrolled[0], [*changes, *unrolled[1]]))
    return out


def _validatable(found: Unsupported, schema: Any) -> bool:
    """Dropping a keyword is only safe if `jsonschema` will still check it on the output."""
    if found.keyword == "properties":
        return False  # a compile-cost bound: dropping every property would leave no useful grammar
    if found.keyword in ("$ref", "$dynamicRef", "$recursiveRef"):
        # Keywords next to a $ref can be dropped; a reference that cannot be resolved cannot be checked.
        return found.keyword == "$ref" and ("next to $ref" in found.reason or "sibling keys" in found.reason)
    if found.keyword in ("pattern", "patternProperties"):
        try:
            node = resolve_pointer(schema, found.path)
        except (KeyError, IndexError, ValueError):
            return False
        regexes = (
            [node.get("pattern")] if found.keyword == "pattern" else list(node.get("patternProperties", {}))
        )
        for regex in regexes:
            if isinstance(regex, str):
                try:
                    re.compile(regex)
                except re.error:
                    return False  # Python's re (what jsonschema uses) cannot read it either
    return True


def _as_error(found: Unsupported, backend: str, *, validatable: bool = True) -> UnsupportedSchemaError:
    reason = found.reason if validatable else f"{found.reason}, and it cannot be validated afterwards"
    return UnsupportedSchemaError(reason, keyword=found.keyword, path=found.path, backend=backend)


def _check_deadline(deadline: float | None, limit_s: float | None, spec: StructuredSpec) -> None:
    if deadline is not None and limit_s is not None and time.perf_counter() > deadline:
        raise CompileTimeoutError(limit_s, spec.describe())


def _final_error(
    spec: StructuredSpec, refusals: list[UnsupportedSchemaError], backends: Sequence[StructuredBackend]
) -> UnsupportedSchemaError:
    names = ", ".join(b.name for b in backends)
    if not refusals:
        return UnsupportedSchemaError(f"no backend among ({names}) supports {spec.kind} specs")
    # Name the keyword: prefer a refusal that points at one, from the most preferred backend.
    best = next((r for r in refusals if r.keyword is not None), refusals[0])
    detail = "; ".join(dict.fromkeys(str(r) for r in refusals))
    return UnsupportedSchemaError(
        f"no backend among ({names}) can enforce this {spec.kind} ({detail})",
        keyword=best.keyword,
        path=best.path,
    )
