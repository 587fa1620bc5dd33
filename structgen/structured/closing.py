"""Finishing a structured output within its token budget: the shortest completion from a grammar state.

`shortest_completion` walks the grammar itself from where the output stands: it takes the bytes the grammar
forces (jump-forward tokens) and, where the grammar leaves a choice, the first allowed byte in an order that
ends JSON values soonest: close the open string (`"`), object (`}`) or array (`]`), else the shortest value
(`0`, `""`, `true`, `null`) or the separator towards the required members still missing (`,`). It never
assumes a schema: the grammar decides at every byte, so what it returns is a valid completion of any backend's
grammar (JSON Schema, `json_object`, the tool-call grammars with their embedded schemas), or None when the walk
finds no end within its byte limit (a pattern that the order cannot satisfy, say). Inside strings and numbers,
where a filler could go on forever, it prefers a filler after which the value may end, else the one it used
least in that value (so `"a@a"` for an e-mail, `"1023-10-21"` for a date). The walk's bytes are then tokenized
canonically, which is what the budget is counted in.

`BudgetCloser` decides, token by token, when a sequence must take that completion: it keeps the completion of
the current state whenever the tokens left come near what it needs, and when a sampled token would leave less
room than the completion from after it needs, the engine drops that token and appends the completion from
before it instead (checked to fit). Far from the limit it looks again only as the slack halves, and inside a
string it reuses the last completion when that still ends the output, so outputs that finish on their own pay
almost nothing.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from structgen.structured.backend import Grammar
from structgen.structured.json_scan import NUMBER, STRING, JsonScanner
from structgen.structured.tokenizer_info import TokenizerInfo

# Bytes to try, in order, wherever the grammar allows more than one. Outside strings: what closes containers,
# then the shortest values (`0`, `""`, `true`, `null`), the separator towards members still required, the rest.
_OUTSIDE = b'}]0",123456789tnf-:[{.'
# Inside strings (where `}` and `]` are content): the closing quote, then characters that satisfy the usual
# patterns and formats soonest (dates, times, e-mail addresses, URIs, identifiers).
_INSIDE = b'"a1@.-:/TZ_ 0'
_ALNUM = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_PRINTABLE = bytes(range(32, 127))
# Last, UTF-8 continuation bytes: the model may have stopped inside a character (a token ending mid-character).
_CONTINUATION = bytes(range(0x80, 0xC0))
OUTSIDE_ORDER = (
    _OUTSIDE + bytes(b for b in _ALNUM + _PRINTABLE + b"\n\t" if b not in _OUTSIDE) + _CONTINUATION
)
INSIDE_ORDER = (
    _INSIDE + bytes(b for b in _ALNUM + _PRINTABLE if b not in _INSIDE and b != ord("\\")) + _CONTINUATION
)
# Fillers are tried first among this many of the order (letters, digits and the usual punctuation), then the rest.
_COMMON = 64
# Inside a string or number, this many fillers are tried for whether the value may end right after them.
_LOOKAHEAD = 12
# A walk gives up past this many bytes (≈ 1.7 µs a byte with llguidance, more where many fillers are tried).
# Long enough to find the end of an output whose minimum is long (40 required items: ~1,300 bytes): a walk
# that gives up tells nothing, so the closer would look again and again, each time paying the whole walk.
MAX_WALK_BYTES = 2048
# Where the text forced after a sampled token is looked for in the last completion: from a quote or punctuation
# on (the keys and separators both share), and how many of the completion's first tokens a value written in
# their place may have replaced (`BudgetCloser._realigned`).
_MAX_BACKOFF = 64
_ANCHOR_STARTS = frozenset(b'",:{}[]')
_SKIPS = 3
# A walk's token count is an estimate of the shortest completion's, above it by less than this share: an output
# whose estimate is out of reach by more than that is out of reach for good (see `BudgetCloser.step`).
_ESTIMATE_MARGIN = 1 / 3
# Near the limit the completion is recomputed every token: within `2 * need + _WINDOW` tokens of it.
_WINDOW = 16


_BYTE_TOKENS: dict[str, ByteTokens] = {}


class ByteTokens:
    """The single-byte tokens of one tokenizer (what the walk steps with) and each token's bytes."""

    def __init__(self, info: TokenizerInfo):
        self.info = info
        self.eos = info.eos_token_ids[0]
        special = info.special_token_ids
        by_byte: dict[int, int] = {}
        for token_id, raw in enumerate(info.vocab):
            if len(raw) == 1 and token_id not in special and raw[0] not in by_byte:
                by_byte[raw[0]] = token_id
        self.by_byte = by_byte
        self.outside = [(b, by_byte[b]) for b in dict.fromkeys(OUTSIDE_ORDER) if b in by_byte]
        self.inside = [(b, by_byte[b]) for b in dict.fromkeys(INSIDE_ORDER) if b in by_byte]
        # What ends a string; what may follow (and so end) a number.
        self.quote = by_byte.get(ord('"'))
        self.string_ends = frozenset(by_byte[b] for b in b'"' if b in by_byte)
        self.number_ends = frozenset(by_byte[b] for b in b"}],\n " if b in by_byte)

    @classmethod
    def of(cls, info: TokenizerInfo) -> ByteTokens:
        found = _BYTE_TOKENS.get(info.tokenizer_id)
        if found is None or found.info is not info:
            found = _BYTE_TOKENS[info.tokenizer_id] = cls(info)
        return found

    def text(self, token_ids: list[int]) -> bytes:
        vocab = self.info.vocab
        return b"".join(vocab[t] for t in token_ids)


def can_end(grammar: Grammar, eos: int) -> bool:
    """The output may end here: the grammar is complete or would take EOS now."""
    return grammar.is_terminated() or grammar.validate_tokens((eos,)) == 1


def walk(
    grammar: Grammar,
    tokens: ByteTokens,
    scanner: JsonScanner,
    *,
    max_bytes: int = MAX_WALK_BYTES,
    until_depth: int | None = None,
    skip: bytes = b"",
    hints: Sequence[bytes] = (),
) -> tuple[list[int], bytes] | None:
    """Walk from the grammar's state (`scanner`: where the output stands) to the first point where it may end,
    or, given `until_depth`, where fewer values than that are open, by forced tokens and preferred bytes other
    than `skip`; `hints`: texts that may let a string end where no single filler does (the literal parts of
    the spec's patterns). Returns (tokens, bytes) or None. The grammar and the scanner are left as they were."""
    scan = scanner.copy()
    base = scan.offset
    accepted: list[int] = []
    out = bytearray()
    try:
        while True:
            if scan.depth < until_depth if until_depth is not None else can_end(grammar, tokens.eos):
                return accepted, bytes(out)
            if len(out) >= max_bytes:
                return None
            # Forced tokens may run past an `until_depth` point: a bounded walk goes byte by byte.
            step = _forced(grammar, tokens) if until_depth is None else []
            if not step:
                step = _choose(
                    grammar,
                    tokens,
                    context=scan.innermost,
                    walked=_value_bytes(out, scan, base),
                    skip=skip,
                    hints=hints,
                )
                if not step:
                    return None  # nothing printable is allowed here
            if not grammar.accept_tokens(step):
                return None
            accepted += step
            text = tokens.text(step)
            out += text
            scan.feed(text)
    finally:
        if accepted:
            grammar.rollback(len(accepted))


def _forced(grammar: Grammar, tokens: ByteTokens) -> list[int]:
    """The tokens the grammar forces next: its forced bytes as single-byte tokens where the backend reports
    bytes (no tokenizer call; the walk is re-tokenized at the end anyway), else its jump-forward tokens."""
    forced = grammar.forced_bytes()
    if forced is None:
        return grammar.find_jump_forward()
    by_byte = tokens.by_byte
    if all(b in by_byte for b in forced):
        return [by_byte[b] for b in forced]
    return grammar.find_jump_forward()


def _value_bytes(out: bytearray, scan: JsonScanner, base: int) -> bytes:
    """The walked bytes of the value being written (the innermost one open)."""
    start = scan.stack[-1][1] - base if scan.stack else 0
    return bytes(out[max(start, 0) :])


def _choose(
    grammar: Grammar,
    tokens: ByteTokens,
    *,
    context: int | None,
    walked: bytes,
    skip: bytes,
    hints: Sequence[bytes] = (),
) -> list[int]:
    """The token(s) to take next ([] if none). Outside strings and numbers: the first byte allowed in order.
    Inside a string or a number (`context`), where fillers may go on forever: what ends it (the quote; a closer
    or comma), else a filler after which it may end, else a hint after which a string may end, else the least
    used filler (`walked`: the value's bytes walked so far)."""
    if context == STRING:
        order, ends = tokens.inside, tokens.string_ends
    elif context == NUMBER:
        order, ends = tokens.outside, tokens.number_ends
    else:
        for byte, token in tokens.outside:
            if byte not in skip and grammar.validate_tokens((token,)) == 1:
                return [token]
        return []
    for byte, token in order:
        if token in ends and byte not in skip and grammar.validate_tokens((token,)) == 1:
            return [token]
    if context == STRING and tokens.quote is not None:
        return _string_filler(grammar, tokens, order, walked=walked, skip=skip, hints=hints)
    # The fillers allowed: the common ones first; the rest of the order only where none of those is.
    allowed: list[tuple[int, int]] = []
    for part in (order[:_COMMON], order[_COMMON:]):
        allowed = [
            (byte, token)
            for byte, token in part
            if byte not in skip and token not in ends and grammar.validate_tokens((token,)) == 1
        ]
        if allowed:
            break
    else:
        return []
    for _, token in allowed[:_LOOKAHEAD]:
        if grammar.accept_tokens((token,)):
            may_end = any(grammar.validate_tokens((end,)) == 1 for end in ends)
            grammar.rollback(1)
            if may_end:
                return [token]
    if context == STRING and tokens.quote is not None:
        for hint in hints:
            ids = [tokens.by_byte[b] for b in hint if b in tokens.by_byte]
            if len(ids) == len(hint) and grammar.validate_tokens((*ids, tokens.quote)) == len(ids) + 1:
                return ids
    # No filler ends it next: the least used so far (the first in order among those), so none loops forever.
    return [min(allowed, key=lambda choice: walked.count(choice[0]))[1]]


def _string_filler(
    grammar: Grammar,
    tokens: ByteTokens,
    order: list[tuple[int, int]],
    *,
    walked: bytes,
    skip: bytes,
    hints: Sequence[bytes],
) -> list[int]:
    """`_choose` inside a string, in one check per filler: the grammar's count of (filler, quote) tells both
    whether the filler is allowed (>= 1) and whether the string may end right after it (2). Among the first
    `_LOOKAHEAD` allowed fillers, the first after which it may end wins; else a hint after which it may end,
    else the least used of the allowed (the same choices as the general way, which spent ~100 checks a byte:
    35 µs a byte of a 2,000-character `minLength` string)."""
    quote = tokens.quote
    allowed: list[tuple[int, int]] = []
    for part in (order[:_COMMON], order[_COMMON:]):
        for byte, token in part:
            if byte in skip or token in tokens.string_ends:
                continue
            taken = grammar.validate_tokens((token, quote))
            if taken == 2 and len(allowed) < _LOOKAHEAD:
                return [token]
            if taken >= 1:
                allowed.append((byte, token))
        if allowed:
            break
    else:
        return []
    for hint in hints:
        ids = [tokens.by_byte[b] for b in hint if b in tokens.by_byte]
        if len(ids) == len(hint) and grammar.validate_tokens((*ids, quote)) == len(ids) + 1:
            return ids
    # No filler ends it next: the least used so far (the first in order among those), so none loops forever.
    return [min(allowed, key=lambda choice: walked.count(choice[0]))[1]]


Plan = tuple[int, ...]  # the tokens of a completion


def _beyond(need: int, left: int) -> bool:
    """Whether a completion estimated at `need` tokens is out of `left`'s reach even if the estimate is high."""
    return need * (1 - _ESTIMATE_MARGIN) > left


def _schedule(left: int, need: int) -> int:
    """When to look next (the tokens left at that point): at every token near the limit; farther away, once
    half the slack is gone."""
    slack = left - need
    return left if slack <= need + _WINDOW else max(need + slack // 2, 2 * need + _WINDOW)


_INITIAL_NEED: OrderedDict[tuple[Any, ...], int | None] = OrderedDict()
_INITIAL_NEED_SIZE = 1024


def initial_need(
    tokens: ByteTokens,
    key: tuple[Any, ...],
    new_grammar: Callable[[], Grammar],
    *,
    hints: Sequence[bytes] = (),
) -> int | None:
    """Tokens of the shortest complete output of a grammar (cached by `key`): what every request under it
    needs at its start, so requests do not each walk it."""
    key = (tokens.info.tokenizer_id, *key)
    if key in _INITIAL_NEED:
        _INITIAL_NEED.move_to_end(key)
        return _INITIAL_NEED[key]
    plan = shortest_completion(new_grammar(), tokens, JsonScanner(), hints=hints)
    _INITIAL_NEED[key] = need = None if plan is None else len(plan)
    while len(_INITIAL_NEED) > _INITIAL_NEED_SIZE:
        _INITIAL_NEED.popitem(last=False)
    return need


def _max_bytes(left: int) -> int:
    # No token is longer than this many bytes of a completion walk in practice: a longer walk cannot fit.
    return min(MAX_WALK_BYTES, 16 * max(left, 0) + 16)


def canonical(grammar: Grammar, tokens: ByteTokens, walked: list[int], text: bytes) -> Plan:
    """The walked bytes as the tokenizer writes them (usually far fewer tokens), if the grammar takes that
    tokenization; else the walk's own tokens."""
    try:
        ids = tokens.info.encode(text.decode("utf-8"))
    except UnicodeDecodeError:
        return tuple(walked)
    if len(ids) < len(walked) and grammar.validate_tokens(ids) == len(ids):
        return tuple(ids)
    return tuple(walked)


def shortest_completion(
    grammar: Grammar,
    tokens: ByteTokens,
    scanner: JsonScanner,
    *,
    max_bytes: int = MAX_WALK_BYTES,
    hints: Sequence[bytes] = (),
) -> Plan | None:
    """The tokens of the completion that ends the output soonest from the grammar's state (`scanner`: where the
    output stands), or None if the walk finds none."""
    found = walk(grammar, tokens, scanner, max_bytes=max_bytes, hints=hints)
    if found is None:
        return None
    walked, text = found
    return canonical(grammar, tokens, walked, text)


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
        "_next_check",
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
        # The last failed step found the output out of reach where the look before it had found it within
        # reach (or there was none): only then can a completion from just before the token still fit.
        self.fell_short = False

    def expect(self, need: int | None) -> None:
        """The completion the grammar needs from its start (`initial_need`): the first step then schedules its
        first look from it instead of walking at once."""
        self.need = need

    def copy(self) -> BudgetCloser:
        twin = BudgetCloser(self.tokens, hints=self.hints)
        twin.plan, twin.fallback, twin.need = self.plan, self.fallback, self.need
        twin._next_check, twin._backoff, twin._started = self._next_check, self._backoff, self._started
        twin._fit, twin.fell_short = self._fit, self.fell_short
        return twin

    def step(
        self, grammar: Grammar, scanner: JsonScanner, left: int, appended: Sequence[int], *, same_string: bool
    ) -> bool:
        """False when the output can no longer be shown to finish within `left` (see the class); `fallback` is
        then the completion from before `appended` if it was computed, else None. `same_string`: `appended`
        only added characters to the string that was open before it."""
        previous, self.plan = self.plan, None
        self.fallback = previous
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
                self._next_check, self._fit, self.fell_short = -1, False, False
                return False
            if self.need is not None:
                self._next_check = _schedule(left, self.need)
        if left > self._next_check:
            return True
        if same_string and previous and self._still_completes(grammar, previous):
            # More characters in a string whose completion began by closing it: the same completion, no walk.
            plan: Plan | None = previous
        else:
            plan = self._realigned(grammar, previous, appended, left) if previous else None
            if plan is None:
                plan = shortest_completion(
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
                self._next_check = -1
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
        plan = shortest_completion(
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
        shortest, never invalid (the grammar checks it); if none fits, the walk decides."""
        tokens, vocab = self.tokens, self.tokens.info.vocab
        text, written = tokens.text(list(previous)), tokens.text(list(appended))
        ends, offset = {}, 0
        for k, token in enumerate(previous):
            offset += len(vocab[token])
            ends[offset] = k + 1
        candidates: list[Plan] = []
        if text.startswith(written) and len(written) < len(text):
            k = ends.get(len(written))
            if k is not None:
                candidates.append(previous[k:])
            else:  # written ends inside one of its tokens: the rest as the tokenizer writes it
                with contextlib.suppress(UnicodeDecodeError):  # (then the other candidates, or the walk)
                    candidates.append(tuple(tokens.info.encode(text[len(written) :].decode("utf-8"))))
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
            if len(rest) <= left and grammar.validate_tokens((*rest, eos)) == len(rest) + 1:
                return rest
        return None

    def _still_completes(self, grammar: Grammar, plan: Plan) -> bool:
        """`plan` starts by closing a string and still ends the output from the grammar's state (one check:
        the grammar takes the plan and then EOS)."""
        if not self.tokens.info.vocab[plan[0]].startswith(b'"'):
            return False
        return grammar.validate_tokens((*plan, self.tokens.eos)) == len(plan) + 1
