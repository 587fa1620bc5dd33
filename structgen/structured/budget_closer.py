"""The budget closer: finishing a structured output within its tokens with the shortest completion that
`closing.shortest_completion` walks.

`BudgetCloser` decides, token by token, when a sequence must take that completion: it keeps the completion of
the current state whenever the tokens left come near what it needs, and when a sampled token would leave less
room than the completion from after it needs, the engine drops that token and appends the completion from
before it instead (checked to fit). Far from the limit it looks again only as the slack halves, and inside a
string it reuses the last completion when that still ends the output, so outputs that finish on their own pay
almost nothing; a look after tokens it skipped first tries the last completion it had, placed after what was
written since.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

from structgen.structured import closing
from structgen.structured.backend import Grammar
from structgen.structured.closing import MAX_WALK_BYTES, ByteTokens, Plan
from structgen.structured.json_scan import NUMBER, STRING, JsonScanner

# The longest a closer waits between looks when there is nothing to close with.
_MAX_BACKOFF = 64
# Where the text forced after a sampled token is looked for in the last completion: from a quote or punctuation
# on (the keys and separators both share), and how many of the completion's first tokens a value written in
# their place may have replaced (`BudgetCloser._realigned`).
_ANCHOR_STARTS = frozenset(b'",:{}[]')
_ANCHOR_RUN_ENDS = (b'"', b",", b":", b"{", b"}", b"[", b"]")
_SKIPS = 3
# The text written since the last completion that a look after skipped tokens places that completion by: its
# last tokens, enough for the keys and punctuation of a member or two (`BudgetCloser._from_stale`).
_STALE_TOKENS = 24
# A walk's token count is an estimate of the shortest completion's, above it by less than this share: an output
# whose estimate is out of reach by more than that is out of reach for good (see `BudgetCloser.step`).
_ESTIMATE_MARGIN = 1 / 3
# Near the limit the completion is recomputed every token: within `2 * need + _WINDOW` tokens of it.
_WINDOW = 16
# `_next_check` of an output out of reach for good: below any `left` (forced tokens can take it under 0).
_NEVER = -(1 << 62)
# The first byte of a completion that ends the open string, or number, at once.
_STRING_ENDS = (b'"',)
_NUMBER_ENDS = (b",", b"}", b"]", b" ", b"\n", b"\t", b"\r")


def _beyond(need: int, left: int) -> bool:
    """Whether a completion estimated at `need` tokens is out of `left`'s reach even if the estimate is high."""
    return need * (1 - _ESTIMATE_MARGIN) > left


def _schedule(left: int, need: int) -> int:
    """When to look next (the tokens left at that point): at every token near the limit; farther away, once
    half the slack is gone."""
    slack = left - need
    return left if slack <= need + _WINDOW else max(need + slack // 2, 2 * need + _WINDOW)


def _text_and_ends(tokens: ByteTokens, plan: Plan) -> tuple[bytes, list[int]]:
    """`plan`'s text and the byte offset where each of its tokens ends."""
    pieces = list(map(tokens.info.vocab.__getitem__, plan))
    return b"".join(pieces), list(accumulate(map(len, pieces)))


def _rest_past(tokens: ByteTokens, plan: Plan, text: bytes, offsets: list[int], at: int) -> Plan | None:
    """The rest of `plan` (whose `text` and token `offsets` are given) past its first `at` bytes: its tokens from
    there where `at` is a token boundary; else the rest of the token `at` falls in as the tokenizer writes it (up
    to the first boundary after it that ends a character), then its tokens after that. Encoding only that piece
    keeps it cheap (encoding the whole rest took ~0.5 ms a call). None when `at` is past the end or no piece
    decodes."""
    if at == 0:
        return plan
    k = bisect_left(offsets, at)  # the token `at` falls in, or ends
    if k == len(offsets):
        return None
    if offsets[k] == at:
        return plan[k + 1 :]
    for j in range(k, min(k + 4, len(offsets))):
        try:
            piece = text[at : offsets[j]].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return (*tokens.info.encode(piece), *plan[j + 1 :])
    return None


def _longest_anchor_end(written: bytes, text: bytes, ends: set[int]) -> int | None:
    """Where in `text` the longest end of `written` from a quote or punctuation on (two bytes at least) ends on
    one of `ends` (its token boundaries), at its first such place; None where none does."""
    for start in range(len(written) - 1):
        if written[start] not in _ANCHOR_STARTS:
            continue
        anchor = written[start:]
        at = text.find(anchor)
        while at >= 0 and at + len(anchor) not in ends:
            at = text.find(anchor, at + 1)
        if at >= 0:
            return at + len(anchor)
    return None


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
        if same_value and previous:
            # More characters in a string (digits in a number) whose completion began by ending it: the same
            # completion (after a digit where the number cannot end yet: `1.`), no walk.
            plan = self._still_completes(grammar, previous, scanner.innermost)
        initial, self._initial = self._initial, None
        stale, self._stale = self._stale, None
        if plan is None and previous:
            plan = self._realigned(grammar, previous, appended, left) or self._from_stale(
                grammar, previous, scanner.innermost, left
            )
        elif plan is None and initial is not None:
            # The first look: the output may have followed the start's completion so far (its forced head,
            # then the first tokens), else been forced through the same keys after another value.
            plan = self._resumed(grammar, initial, scanner.offset, left) or self._realigned(
                grammar, initial, appended, left
            )
        elif plan is None and stale:
            plan = self._from_stale(grammar, stale, scanner.innermost, left)
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

    def _realigned(self, grammar: Grammar, previous: Plan, appended: Sequence[int], left: int) -> Plan | None:
        """A completion from the grammar's state made of the rest of `previous` (the completion from before
        `appended`), if the grammar takes it and then the end within `left` tokens; None if none is found.

        A model that picks another value than the completion's (`"done"` for its `"todo"`, a 4 for its 1) is
        then forced through the same keys and punctuation (`","priority":`): the completion past them still
        ends the output. One check of such a rest (≈ 50 µs for 250 tokens) replaces a walk of the whole of it
        (≈ 3 ms), which an output running along its budget would otherwise pay at every sampled token. The rest
        tried: the completion's text past what was appended, when it starts with it; the completion past the
        first place the forced text (from a quote or punctuation on) ends on one of its token boundaries; the
        completion past its first few tokens (a value written in their place). A rest may be longer than the
        shortest, never invalid (the grammar checks it); if none fits, the walk decides. Except where the output
        wrote the completion's own text: that rest is the walk's own continuation, so it is returned even when
        longer than `left` (an output running at its limit whose tokens took one more than the completion's
        for the same text, `enums`' outputs 0.9 times a step on `tiny`), and the output is found out of reach
        without a walk (~3 ms) that would only say the same."""
        tokens = self.tokens
        text, offsets = _text_and_ends(tokens, previous)
        written = tokens.text(list(appended))
        ends = dict(zip(offsets, range(1, len(offsets) + 1), strict=True))  # byte offset -> tokens before it
        candidates: list[Plan] = []
        exact: Plan | None = None  # the rest where the output wrote the completion's own text
        if text.startswith(written) and len(written) < len(text):
            exact = _rest_past(tokens, previous, text, offsets, len(written))
            if exact is not None:  # (else the other candidates, or the walk)
                candidates.append(exact)
        forced = tokens.text(list(appended[1:]))
        for start in range(len(forced)):
            if forced[start] not in _ANCHOR_STARTS or len(forced) - start < 2:
                continue
            anchor, k = forced[start:], None
            at = text.find(anchor)
            while at >= 0 and k is None:
                k = ends.get(at + len(anchor))
                at = text.find(anchor, at + 1)
            if k is not None:
                candidates.append(previous[k:])
            break  # the longest anchor only: a shorter one places less surely
        candidates.extend(previous[k:] for k in range(1, min(_SKIPS, len(previous)) + 1))
        eos = tokens.eos
        for rest in candidates:
            within = len(rest) <= left or rest is exact
            if within and grammar.validate_tokens((*rest, eos)) == len(rest) + 1:
                return rest
        return None

    def _resumed(self, grammar: Grammar, plan: Plan, offset: int, left: int) -> Plan | None:
        """The rest of `plan` (a completion from the output's start) past its first `offset` bytes (as the
        tokenizer writes it where `offset` falls inside one of its tokens), if the grammar takes it and then
        the end within `left` tokens."""
        text, offsets = _text_and_ends(self.tokens, plan)
        rest = _rest_past(self.tokens, plan, text, offsets, offset)
        return self._fits(grammar, rest, left) if rest is not None else None

    def _fits(self, grammar: Grammar, rest: Plan, left: int) -> Plan | None:
        """`rest` if the grammar takes it and then the end, within `left` tokens."""
        if rest and len(rest) <= left and grammar.validate_tokens((*rest, self.tokens.eos)) == len(rest) + 1:
            return rest
        return None

    def _still_completes(
        self, grammar: Grammar, plan: Plan, innermost: int | None, *, limit: int = 1 << 30
    ) -> Plan | None:
        """`plan` (or, in a number that cannot end yet, a `0` then `plan`) if it starts by ending the string or
        number open (`innermost`) and still ends the output from the grammar's state (one check: the grammar
        takes it and then EOS). A number's digits written in the place of the completion's (a `score` of
        0.8125 where the walk ended it at 0) leave the rest of it the shortest: without this, an output writing
        digits along its budget walked at every token (~2 ms a walk for `enums`' 20 records). `limit`: the most
        tokens it may take (a completion from another state than the last one is not the shortest)."""
        first = self.tokens.info.vocab[plan[0]][:1]
        if innermost != NUMBER:
            return plan if first in _STRING_ENDS and self._fits(grammar, plan, limit) else None
        if first not in _NUMBER_ENDS:
            return None
        if self._fits(grammar, plan, limit):
            return plan
        zero = self.tokens.by_byte.get(ord("0"))
        return self._fits(grammar, (zero, *plan), limit) if zero is not None else None

    def _from_stale(self, grammar: Grammar, stale: Plan, innermost: int | None, left: int) -> Plan | None:
        """A completion from the grammar's state made of (the rest of) `stale`, the last completion computed,
        some tokens ago, within `left` tokens; None if none is found (the walk decides).

        Far from the limit the closer skips tokens, and the next look used to walk (~1 ms on SmolLM2's
        `optional_anyof`, 1.6 walks a step of 32 outputs). The output has usually moved on through the same
        keys and punctuation: in a string or number, the old completion still ends it where it starts by ending
        that value; elsewhere the text written since, up to its last quote or punctuation, is found in the old
        completion's text on a token boundary (the longest such run) and the completion past it is tried. The
        grammar checks what is returned, so it is a completion, maybe longer than the shortest (it may hold a
        member or an item the output has written since): far from the limit that only brings the next look
        nearer, and near it the closer looks at every token from a fresh completion."""
        if innermost in (STRING, NUMBER):
            plan = self._still_completes(grammar, stale, innermost, limit=left)
            if plan is not None:
                return plan
        written = self.tokens.text(self._since)
        text, offsets = _text_and_ends(self.tokens, stale)
        ends = set(offsets)
        # All that was written (a key being written, `},{"na`, is in the old text as it stands), then only up
        # to its last quote or punctuation (a value the old completion wrote otherwise: `"id":` of `"id":7`).
        cut = max(map(written.rfind, _ANCHOR_RUN_ENDS)) + 1
        for run in dict.fromkeys((written, written[:cut])):
            at = _longest_anchor_end(run, text, ends)
            rest = _rest_past(self.tokens, stale, text, offsets, at) if at is not None else None
            plan = self._fits(grammar, rest, left) if rest else None
            if plan is not None:
                return plan
        return None
