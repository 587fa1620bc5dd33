"""The budget closer: finishing a structured output within its tokens with the shortest completion that
`closing.shortest_completion` walks.

`BudgetCloser` decides, token by token, when a sequence must take that completion: it keeps the completion of
the current state whenever the tokens left come near what it needs, and when a sampled token would leave less
room than the completion from after it needs, the engine drops that token and appends the completion from
before it instead (checked to fit). Far from the limit it looks again only as the slack halves, and inside a
string it reuses the last completion when that still ends the output, so outputs that finish on their own pay
almost nothing; wherever it looks it first tries to reuse the last completion it had (`plan_reuse`), and walks
only where that does not end the output.
"""

from __future__ import annotations

from collections.abc import Sequence

from structgen.structured import closing, plan_reuse
from structgen.structured.backend import Grammar
from structgen.structured.closing import MAX_WALK_BYTES, ByteTokens, Plan
from structgen.structured.json_scan import JsonScanner

# The longest a closer waits between looks when there is nothing to close with.
_MAX_BACKOFF = 64
# The text written since the last completion that a look after skipped tokens places that completion by: its
# last tokens, enough for the keys and punctuation of a member or two (`plan_reuse.from_stale`).
_STALE_TOKENS = 24
# A walk's token count is an estimate of the shortest completion's, above it by less than this share: an output
# whose estimate is out of reach by more than that is out of reach for good (see `BudgetCloser.step`).
_ESTIMATE_MARGIN = 1 / 3
# Near the limit the completion is recomputed every token: within `2 * need + _WINDOW` tokens of it.
_WINDOW = 16
# `_next_check` of an output out of reach for good: below any `left` (forced tokens can take it under 0).
_NEVER = -(1 << 62)


def _beyond(need: int, left: int) -> bool:
    """Whether a completion estimated at `need` tokens is out of `left`'s reach even if the estimate is high."""
    return need * (1 - _ESTIMATE_MARGIN) > left


def _schedule(left: int, need: int) -> int:
    """When to look next (the tokens left at that point): at every token near the limit; farther away, once
    half the slack is gone."""
    slack = left - need
    return left if slack <= need + _WINDOW else max(need + slack // 2, 2 * need + _WINDOW)


def _max_bytes(left: int) -> int:
    # No token is longer than this many bytes of a completion walk in practice: a longer walk cannot fit.
    return min(MAX_WALK_BYTES, 16 * max(left, 0) + 16)


class BudgetCloser:
    """Per sequence: keeps the completion of the current grammar state while the budget is near.

    The engine calls `step(grammar, scanner, left, appended)` after each sampled token (with whatever was
    forced after it) has entered the grammar, with the tokens still allowed after them. It returns False when
    the output can no longer be shown to finish within `left`: the engine then rolls the token back and
    appends the completion from before it instead, `fallback` where the closer had it, else computed then
    (`completion_within`: a token that opened much at once, like a tool call's forced head, can take the
    output past its budget between two looks). Where even that does not fit, the output goes on and
    `max_tokens` cuts it as it always did.
    """

    __slots__ = (
        "_backoff",
        "_fit",
        "_initial",
        "_next_check",
        "_since",
        "_stale",
        "_started",
        "fallback",
        "fell_short",
        "hints",
        "need",
        "plan",
        "tokens",
    )

    def __init__(self, tokens: ByteTokens, *, hints: Sequence[bytes] = ()):
        self.tokens = tokens
        self.hints = tuple(hints)
        self.reset()

    def reset(self) -> None:
        self.plan: Plan | None = None  # the completion of the current state, when it was computed and fits
        self.fallback: Plan | None = None  # the completion of the state before the last step, if it fit
        self.need: int | None = None  # tokens of the last completion computed
        self._next_check = 1 << 62  # compute once the tokens left fall to this (the first step: at once)
        self._backoff = 0
        self._started = False
        self._fit: bool | None = None  # whether the last look found a completion within the budget
        # The grammar's completion from its start (`expect`), which the first look realigns before walking;
        # never a fallback (the output's forced start is already past it).
        self._initial: Plan | None = None
        # The last failed step found the output out of reach where the look before it had found it within
        # reach (or there was none): only then can a completion from just before the token still fit.
        self.fell_short = False
        # The last completion computed, kept while the closer skips tokens (`plan` holds only the one of the
        # current state), and the tokens written since it was current.
        self._stale: Plan | None = None
        self._since: list[int] = []

    def expect(self, plan: Plan | None) -> None:
        """The completion the grammar needs from its start (`closing.initial_completion`): the first step then
        schedules its first look from its length instead of walking at once, and that look tries it first."""
        self.need = None if plan is None else len(plan)
        self._initial = plan

    def copy(self) -> BudgetCloser:
        twin = BudgetCloser(self.tokens, hints=self.hints)
        twin.plan, twin.fallback, twin.need = self.plan, self.fallback, self.need
        twin._next_check, twin._backoff, twin._started = self._next_check, self._backoff, self._started
        twin._fit, twin.fell_short, twin._initial = self._fit, self.fell_short, self._initial
        twin._stale, twin._since = self._stale, list(self._since)
        return twin

    def step(
        self, grammar: Grammar, scanner: JsonScanner, left: int, appended: Sequence[int], *, same_value: bool
    ) -> bool:
        """False when the output can no longer be shown to finish within `left` (see the class); `fallback` is
        then the completion from before `appended` if it was computed, else None. `same_value`: `appended`
        only added characters to the string or number that was open before it."""
        previous, self.plan = self.plan, None
        self.fallback = previous
        if previous is not None:
            self._stale, self._since = previous, []
        if self._stale is not None:
            self._since.extend(appended)
            del self._since[:-_STALE_TOKENS]
        n = len(appended)
        if previous is not None and previous[:n] == tuple(appended):
            # The model is writing the completion itself: the rest of it still fits.
            self.plan = previous[n:]
            self.need = len(self.plan)
            return True
        if not self._started:
            self._started = True
            if self.need is not None and _beyond(self.need, left):
                # The grammar's shortest output is already out of reach (a 2,000-character string under a
                # 32-token budget): nothing to close with, now or later (see below); the budget cuts it.
                self._next_check, self._fit, self.fell_short = _NEVER, False, False
                return False
            if self.need is not None:
                self._next_check = _schedule(left, self.need)
        if left > self._next_check:
            return True
        plan: Plan | None = None
        tokens = self.tokens
        if same_value and previous:
            # More characters in a string (digits in a number) whose completion began by ending it: the same
            # completion (after a digit where the number cannot end yet: `1.`), no walk.
            plan = plan_reuse.still_completes(grammar, tokens, previous, scanner.innermost)
        initial, self._initial = self._initial, None
        stale, self._stale = self._stale, None
        if plan is None and previous:
            plan = plan_reuse.realigned(grammar, tokens, previous, appended, left) or plan_reuse.from_stale(
                grammar, tokens, previous, self._since, scanner.innermost, left, in_value=not same_value
            )
        elif plan is None and initial is not None:
            # The first look: the output may have followed the start's completion so far (its forced head,
            # then the first tokens), else been forced through the same keys after another value.
            plan = plan_reuse.resumed(grammar, tokens, initial, scanner.offset, left) or plan_reuse.realigned(
                grammar, tokens, initial, appended, left
            )
        elif plan is None and stale:
            plan = plan_reuse.from_stale(grammar, tokens, stale, self._since, scanner.innermost, left)
        old = previous or stale or initial
        if plan is None and old:
            # Nothing to place it by (a member it left out, now opened): a walk to the end of the record, then
            # its records after one of its own.
            plan = plan_reuse.spliced(
                grammar, tokens, scanner, old, left, max_bytes=_max_bytes(left), hints=self.hints
            )
        if plan is None:
            plan = closing.shortest_completion(
                grammar, self.tokens, scanner, max_bytes=_max_bytes(left), hints=self.hints
            )
        fit_before, self._fit = self._fit, False
        self.fell_short = fit_before is not False
        if plan is None:
            max_bytes = _max_bytes(left)
            if max_bytes < MAX_WALK_BYTES:
                # No end within the bytes `left` tokens can hold: out of reach, and (below) it stays so. Look
                # again only after a long while (the bytes a token holds are a rule of thumb), and a fallback
                # from before the token could only have fit if the last look found room.
                self._backoff = _MAX_BACKOFF
                self._next_check = left - _MAX_BACKOFF
                self.fell_short = fit_before is True
                return False
            # No end found within the walk's reach: look again after a while, not at every token.
            self.back_off(left)
            return False
        self.need = need = len(plan)
        if need > left:
            # Out of reach, and it stays so: each token takes one from the budget and shortens the shortest
            # completion by at most one (the token then the rest would otherwise be a shorter completion). The
            # walk's count only estimates the shortest (from above): out of reach by more than its margin, never
            # look again; else look after a growing while, not at every token (a schema whose minimum output is
            # past max_tokens walked twice a token), and not before half the gap is spent. (Never looking again
            # after any miss cut 2 of 64 SmolLM2 outputs that closed otherwise: a walk from inside multi-byte
            # text can estimate far above one from a later state.)
            if _beyond(need, left):
                self._next_check = _NEVER
            else:
                self.back_off(left)
                self._next_check = min(self._next_check, left - (need - left) // 2)
            return False
        self._backoff = 0
        self._fit = True
        self.plan = plan
        self._next_check = _schedule(left, need)
        return True

    def back_off(self, left: int) -> None:
        """Nothing to close with from here: skip a growing number of tokens before the next try."""
        self._backoff = min(_MAX_BACKOFF, 2 * self._backoff + 4)
        self._next_check = left - self._backoff

    def completion_within(self, grammar: Grammar, scanner: JsonScanner, left: int) -> Plan | None:
        """The completion from the grammar's state if it takes at most `left` tokens (the fallback computed
        late, when the state before a token was not checked)."""
        plan = closing.shortest_completion(
            grammar, self.tokens, scanner, max_bytes=_max_bytes(left), hints=self.hints
        )
        return plan if plan is not None and len(plan) <= left else None
