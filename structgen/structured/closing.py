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

`budget_closer.BudgetCloser` is what uses it, token by token.
"""

from __future__ import annotations

import threading
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
# The bytes before a choice inside a string that `walk` keys its earlier choices by (more than any key and
# separators between two records' same member).
_CHOICE_CONTEXT = 32

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
    # The filler chosen inside a string, by what precedes it: a walk meets the same place again and again (an
    # enum's first letter in each of 20 required records; the cycle of fillers in a long `minLength` string),
    # and choosing tries up to ~64 fillers where the one chosen there before needs a single check.
    chosen: dict[bytes, list[int]] = {}
    try:
        while True:
            if scan.depth < until_depth if until_depth is not None else can_end(grammar, tokens.eos):
                return accepted, bytes(out)
            if len(out) >= max_bytes:
                return None
            # Forced tokens may run past an `until_depth` point: a bounded walk takes forced bytes up to it.
            step = (
                _forced(grammar, tokens)
                if until_depth is None
                else _forced_until(grammar, tokens, scan, until_depth)
            )
            if not step:
                step = _choose(
                    grammar,
                    tokens,
                    context=scan.innermost,
                    walked=_value_bytes(out, scan, base),
                    skip=skip,
                    hints=hints,
                    chosen=chosen,
                    place=bytes(out[-_CHOICE_CONTEXT:]),
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


def _forced_until(grammar: Grammar, tokens: ByteTokens, scan: JsonScanner, until_depth: int) -> list[int]:
    """The bytes the grammar forces next, as single-byte tokens, up to the one after which fewer than
    `until_depth` values are open; [] where the backend reports none (the walk then chooses byte by byte,
    which inside a key tries up to ~60 fillers a byte: ~1 ms for `","score":`)."""
    forced = grammar.forced_bytes()
    if not forced:
        return []
    by_byte = tokens.by_byte
    probe = scan.copy()
    step: list[int] = []
    for byte in forced:
        token = by_byte.get(byte)
        if token is None:
            break
        step.append(token)
        probe.feed(bytes((byte,)))
        if probe.depth < until_depth:
            break
    return step


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
    chosen: dict[bytes, list[int]] | None = None,
    place: bytes = b"",
) -> list[int]:
    """The token(s) to take next ([] if none). Outside strings and numbers: the first byte allowed in order.
    Inside a string or a number (`context`), where fillers may go on forever: what ends it (the quote; a closer
    or comma), else a filler after which it may end, else (strings: `_string_filler`) a hint after which it may
    end, else the least used filler (`walked`: the value's bytes walked so far)."""
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
        # (`chosen`: the filler taken before where the same bytes preceded, `place`; tried first.)
        before = chosen.get(place) if chosen is not None else None
        if before and grammar.validate_tokens(before) == len(before):
            return before
        step = _string_filler(grammar, tokens, order, walked=walked, skip=skip, hints=hints)
        if chosen is not None and step:
            chosen[place] = step
        return step
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
    return _least_used(allowed, walked)


def _least_used(allowed: list[tuple[int, int]], walked: bytes) -> list[int]:
    """No filler ends the value next: the least used so far (the first in order among those), so none loops
    forever."""
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
    return _least_used(allowed, walked)


Plan = tuple[int, ...]  # the tokens of a completion


_INITIAL: OrderedDict[tuple[Any, ...], Plan | None] = OrderedDict()
_INITIAL_SIZE = 1024
# Compile threads fill the cache (`StructuredOutputManager` walks a new grammar there) while the step thread reads.
_INITIAL_LOCK = threading.Lock()


def initial_completion(
    tokens: ByteTokens,
    key: tuple[Any, ...],
    new_grammar: Callable[[], Grammar],
    *,
    hints: Sequence[bytes] = (),
) -> Plan | None:
    """The shortest complete output of a grammar (cached by `key`): what every request under it needs at its
    start, so requests do not each walk it (and their first look realigns it rather than walking again)."""
    key = (tokens.info.tokenizer_id, *key)
    with _INITIAL_LOCK:
        if key in _INITIAL:
            _INITIAL.move_to_end(key)
            return _INITIAL[key]
    plan = shortest_completion(new_grammar(), tokens, JsonScanner(), hints=hints)
    with _INITIAL_LOCK:
        _INITIAL[key] = plan
        while len(_INITIAL) > _INITIAL_SIZE:
            _INITIAL.popitem(last=False)
    return plan


def initial_need(
    tokens: ByteTokens,
    key: tuple[Any, ...],
    new_grammar: Callable[[], Grammar],
    *,
    hints: Sequence[bytes] = (),
) -> int | None:
    """Tokens of `initial_completion` (None: no end found)."""
    plan = initial_completion(tokens, key, new_grammar, hints=hints)
    return None if plan is None else len(plan)


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
