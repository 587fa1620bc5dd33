"""Making a structured output finish: budget-aware closing and the loop guard, around one request's grammar.

`Finisher.advance` takes each sampled token into the grammar and says what the engine appends after it: the
tokens the grammar forces (jump-forward), the end of a value the model loops in (`loop_guard.py`), or, when the
tokens left no longer cover what the output needs to finish from after that token, the shortest completion from
before it in its place (`closing.py`), which ends the output. Both are on by default for JSON outputs (JSON
Schema, `json_object`, and grammars that embed a JSON Schema, which is what tool calls are) and may be asked
for on any other.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from structgen.structured.backend import Grammar
from structgen.structured.budget_closer import BudgetCloser
from structgen.structured.closing import ByteTokens, initial_completion
from structgen.structured.errors import GrammarRejectedTokenError
from structgen.structured.json_scan import NUMBER, STRING, JsonScanner
from structgen.structured.loop_guard import LoopGuard
from structgen.structured.schema_walk import iter_subschemas
from structgen.structured.spec import StructuredSpec


@dataclass(slots=True)
class Advance:
    """What follows a sampled token. `kept` False: drop the sampled token and append `tokens` (the closing
    completion) instead. `end`: the output is complete after `tokens` and must stop there."""

    kept: bool
    tokens: list[int] = field(default_factory=list)
    end: bool = False


_MAX_HINTS = 16


# Every structured request asks for its spec's hints; a server sees the same few specs again and again, and
# parsing their patterns cost ~0.1 ms a request (`nested`'s two patterns), a twentieth of its CPU.
@functools.lru_cache(maxsize=256)
def pattern_hints(spec: StructuredSpec) -> tuple[bytes, ...]:
    """The literal runs (two characters or more) of the spec's patterns, shortest first: a string under
    `"pattern": "date-time"` can only end once it holds that text, which no single filler reaches."""
    if spec.kind == "regex":
        patterns = [spec.text]
    elif spec.kind == "json_schema" and '"pattern"' in spec.text:
        patterns = [
            node["pattern"]
            for _, node in iter_subschemas(spec.schema())
            if isinstance(node.get("pattern"), str)
        ]
    else:
        return ()
    found: set[bytes] = set()
    for pattern in patterns:
        found.update(_literal_runs(pattern))
    return tuple(sorted(found, key=lambda h: (len(h), h)))[:_MAX_HINTS]


def _literal_runs(pattern: str) -> list[bytes]:
    import re._parser as sre_parse  # the standard library's regex parser

    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return []
    runs: list[bytes] = []

    def visit(items: Any) -> None:
        run: list[int] = []
        for op, arg in items:
            if str(op) == "LITERAL" and 32 <= arg < 127 and arg not in (34, 92):  # printable, no quote or \\
                run.append(arg)
                continue
            if len(run) >= 2:
                runs.append(bytes(run))
            run = []
            for sub in _subpatterns(arg):
                visit(sub)
        if len(run) >= 2:
            runs.append(bytes(run))

    visit(parsed)
    return runs


def _subpatterns(arg: Any) -> list[Any]:
    """The nested sequences inside one regex item (groups, alternatives, repeats)."""
    out = []
    items = arg if isinstance(arg, list | tuple) else [arg]
    for item in items:
        if hasattr(item, "data"):  # a parsed sequence (sre's SubPattern)
            out.append(item)
        elif isinstance(item, list | tuple):
            out.extend(_subpatterns(item))
    return out


def emits_json(spec: StructuredSpec) -> bool:
    """Outputs that are JSON, or hold JSON values: where closing and the loop guard are on by default."""
    return spec.kind in ("json_schema", "json_object") or (spec.kind == "grammar" and "%json" in spec.text)


class Finisher:
    """Per sequence: where the output stands (`scanner`), the budget closer and the loop guard (either None
    when off), and what they did (`closed_at_budget`, `loops_ended`)."""

    __slots__ = ("closed_at_budget", "closer", "guard", "hints", "loops_ended", "scanner", "tokens")

    def __init__(
        self,
        tokens: ByteTokens,
        *,
        close: bool,
        guard: bool,
        max_number_digits: int,
        hints: tuple[bytes, ...] = (),
    ):
        self.tokens = tokens
        self.hints = hints  # literal parts of the spec's patterns (`pattern_hints`)
        self.scanner = JsonScanner()
        self.closer = BudgetCloser(tokens, hints=hints) if close else None
        self.guard = LoopGuard(tokens, max_number_digits=max_number_digits, hints=hints) if guard else None
        self.closed_at_budget = False
        self.loops_ended = 0

    def copy(self) -> Finisher:
        twin = Finisher.__new__(Finisher)
        twin.tokens, twin.hints = self.tokens, self.hints
        twin.scanner = self.scanner.copy()
        twin.closer = self.closer.copy() if self.closer is not None else None
        twin.guard = self.guard.copy() if self.guard is not None else None
        twin.closed_at_budget, twin.loops_ended = self.closed_at_budget, self.loops_ended
        return twin

    def reset(self) -> None:
        self.scanner = JsonScanner()
        if self.closer is not None:
            self.closer.reset()
        if self.guard is not None:
            self.guard.reset()
        self.closed_at_budget = False
        self.loops_ended = 0

    def prepare(self, key: tuple[Any, ...], new_grammar: Callable[[], Grammar]) -> None:
        """Before the first token: what the grammar (`key` names it) needs to finish from its start."""
        if self.closer is not None:
            self.closer.expect(initial_completion(self.tokens, key, new_grammar, hints=self.hints))

    def entered(self, token_ids: list[int]) -> None:
        """Tokens the grammar accepted (sampled or forced), in order."""
        self.scanner.feed(self.tokens.text(token_ids))

    def advance(
        self,
        grammar: Grammar,
        token_id: int,
        *,
        left: int | None,
        jump_forward: bool,
        taken: bool = False,
        forced: list[int] | None = None,
    ) -> Advance:
        """`token_id` was sampled (and is allowed by the grammar); `left`: the tokens the sequence may still
        take after it (None: no limit to close against); `taken`: the grammar has accepted it already (the
        sampler's check took it); `forced`, if not None: the tokens it forces after it, found by that check.
        Accepts what it returns into the grammar."""
        closer = self.closer if left is not None else None
        before = self.scanner.copy() if closer is not None else None  # the state to fall back to
        start = self.scanner.offset
        appended = [token_id]
        if taken:
            self.entered(appended)
        else:
            self._accept(grammar, appended)
        if jump_forward:
            appended += self._forced(grammar, known=forced)
        if self.guard is not None:
            room = None if left is None else left - (len(appended) - 1)
            ended, output_ends = self.guard.step(grammar, self.scanner, appended, start, room=room)
            if ended or output_ends:
                self._accept(grammar, ended)
                self.loops_ended += 1
                appended += ended
                if output_ends:
                    return Advance(True, appended[1:], end=True)
                if jump_forward:
                    appended += self._forced(grammar)
        if closer is None or before is None or left is None:  # (one implies the others; for the types)
            return Advance(True, appended[1:])
        room = left - (len(appended) - 1)
        same_value = before.stack == self.scanner.stack and self.scanner.innermost in (STRING, NUMBER)
        if closer.step(grammar, self.scanner, room, appended, same_value=same_value):
            # Complete with no room left: end here (an accepting grammar may still allow more, e.g. a number).
            end = room <= 0 and closer.plan == ()
            # (An output whose grammar is over ended on its own, as it would without closing: not closed.)
            self.closed_at_budget |= end and not grammar.is_terminated()
            return Advance(True, appended[1:], end=end)
        after = self.scanner
        grammar.rollback(len(appended))
        self.scanner = before
        fallback = closer.fallback
        if fallback is None and closer.fell_short:
            fallback = closer.completion_within(grammar, before, left + 1)
        if fallback is None:
            # No completion fits from before the token either: go on, to be cut by `max_tokens` as before.
            self._accept(grammar, appended)
            self.scanner = after  # (the closer has already put its next look off)
            return Advance(True, appended[1:])
        self._accept(grammar, list(fallback))
        self.closed_at_budget = True
        return Advance(False, list(fallback), end=True)

    def _accept(self, grammar: Grammar, token_ids: list[int]) -> None:
        if not grammar.accept_tokens(token_ids):
            raise GrammarRejectedTokenError(f"the grammar rejected tokens {token_ids} it had allowed")
        self.entered(token_ids)

    def _forced(self, grammar: Grammar, *, known: list[int] | None = None) -> list[int]:
        forced = known if known is not None else grammar.find_jump_forward()
        if forced:
            self._accept(grammar, forced)
        return forced
