"""Completions reused from an earlier state of the output, instead of a walk (`closing.shortest_completion`,
~1-3 ms on SmolLM2's shapes) at each look of the budget closer (`budget_closer.BudgetCloser`).

A completion computed some tokens ago still ends the output in most places the output reaches later: the
model wrote another value than the completion's and was then forced through the same keys and punctuation
(`realigned`), or went on while the closer skipped looking (`from_stale`), or opened a member the completion
left out, where a walk that only closes the record it is in goes on with the completion's later records
(`spliced`). Whatever is returned is checked by the grammar (it takes the tokens, then the end): a completion,
maybe longer than the shortest, never invalid; None where nothing fits, and the closer walks.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Container, Sequence
from itertools import accumulate

from structgen.structured import closing
from structgen.structured.backend import Grammar
from structgen.structured.closing import ByteTokens, Plan
from structgen.structured.json_scan import ARRAY, NUMBER, STRING, JsonScanner

# Where the text forced after a sampled token is looked for in the last completion: from a quote or punctuation
# on (the keys and separators both share), and how many of the completion's first tokens a value written in
# their place may have replaced (`realigned`).
_ANCHOR_STARTS = frozenset(b'",:{}[]')
_ANCHOR_RUN_ENDS = tuple(bytes((byte,)) for byte in _ANCHOR_STARTS)
_SKIPS = 3
# The places in an old completion where an item closed that `spliced` tries to go on from.
_SPLICE_TRIES = 16
# The first byte of a completion that ends the open string, or number, at once.
_STRING_ENDS = (b'"',)
_NUMBER_ENDS = (b",", b"}", b"]", b" ", b"\n", b"\t", b"\r")


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


def _longest_anchor_end(
    written: bytes, text: bytes, ends: Container[int], *, only_longest: bool = False
) -> int | None:
    """Where in `text` the longest end of `written` from a quote or punctuation on (two bytes at least) ends on
    one of `ends` (its token boundaries), at its first such place; None where none does. `only_longest`: try
    that longest end alone (a shorter one places less surely)."""
    for start in range(len(written) - 1):
        if written[start] not in _ANCHOR_STARTS:
            continue
        anchor = written[start:]
        at = text.find(anchor)
        while at >= 0 and at + len(anchor) not in ends:
            at = text.find(anchor, at + 1)
        if at >= 0:
            return at + len(anchor)
        if only_longest:
            break
    return None


def realigned(
    grammar: Grammar, tokens: ByteTokens, previous: Plan, appended: Sequence[int], left: int
) -> Plan | None:
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
    text, offsets = _text_and_ends(tokens, previous)
    written = tokens.text(list(appended))
    ends = dict(zip(offsets, range(1, len(offsets) + 1), strict=True))  # byte offset -> tokens before it
    candidates: list[Plan] = []
    exact: Plan | None = None  # the rest where the output wrote the completion's own text
    if text.startswith(written) and len(written) < len(text):
        exact = _rest_past(tokens, previous, text, offsets, len(written))
        if exact is not None:  # (else the other candidates, or the walk)
            candidates.append(exact)
    at = _longest_anchor_end(tokens.text(list(appended[1:])), text, ends, only_longest=True)
    if at is not None:
        candidates.append(previous[ends[at] :])
    candidates.extend(previous[k:] for k in range(1, min(_SKIPS, len(previous)) + 1))
    eos = tokens.eos
    for rest in candidates:
        within = len(rest) <= left or rest is exact
        if within and grammar.validate_tokens((*rest, eos)) == len(rest) + 1:
            return rest
    return None


def spliced(
    grammar: Grammar,
    tokens: ByteTokens,
    scanner: JsonScanner,
    old: Plan,
    left: int,
    *,
    max_bytes: int,
    hints: Sequence[bytes],
) -> Plan | None:
    """A walk that only closes the outermost array item the output is in, then `old` (a completion from
    an earlier state) from just after one of its items closed the same way, if the grammar takes the two
    and then the end within `left` tokens; None if not (the whole walk decides).

    Where `old` cannot be placed by the text written since (a member it left out, like an optional
    `"tags":[` that the model opened), the walk to the item's end is short (`"]}`) where the whole one
    writes every record still required (~1 ms on SmolLM2's `optional_anyof`, 10 records); the records
    after the item are the same in both. `old` holds the records required when it was computed, maybe
    more than are still needed: its places are tried in order for as long as the grammar takes the rest,
    and the last one taken holds no more than needed (a longer rest would make `need` too high, and the
    looks too frequent; tried from the end instead, each place re-encodes a piece of text, ~1 ms for
    `enums`' 20 records)."""
    stack = scanner.stack
    item = next((depth for depth in range(1, len(stack)) if stack[depth - 1][0] == ARRAY), None)
    if item is None:
        return None
    found = closing.walk(grammar, tokens, scanner, max_bytes=max_bytes, until_depth=item + 1, hints=hints)
    if found is None or not found[1]:
        return None
    walked, head_text = found
    head = closing.canonical(grammar, tokens, walked, head_text)
    if len(head) >= left or not grammar.accept_tokens(head):
        return None
    try:
        text, offsets = _text_and_ends(tokens, old)
        closer, eos = head_text[-1:], tokens.eos
        # From the first place on, while the grammar takes what follows: the last it takes holds no record
        # more than the output still needs (a place past it, one too few, is refused at the rest's `]`).
        best: Plan | None = None
        at = text.find(closer)
        for _ in range(_SPLICE_TRIES):
            if at < 0:
                break
            rest = _rest_past(tokens, old, text, offsets, at + 1)
            if rest and grammar.validate_tokens((*rest, eos)) == len(rest) + 1:
                best = rest
            elif best is not None:
                break
            at = text.find(closer, at + 1)
        if best is not None and len(head) + len(best) <= left:
            return (*head, *best)
        return None
    finally:
        grammar.rollback(len(head))


def resumed(grammar: Grammar, tokens: ByteTokens, plan: Plan, offset: int, left: int) -> Plan | None:
    """The rest of `plan` (a completion from the output's start) past its first `offset` bytes (as the
    tokenizer writes it where `offset` falls inside one of its tokens), if the grammar takes it and then
    the end within `left` tokens."""
    text, offsets = _text_and_ends(tokens, plan)
    rest = _rest_past(tokens, plan, text, offsets, offset)
    return fits(grammar, tokens, rest, left) if rest is not None else None


def fits(grammar: Grammar, tokens: ByteTokens, rest: Plan, left: int) -> Plan | None:
    """`rest` if the grammar takes it and then the end, within `left` tokens."""
    if rest and len(rest) <= left and grammar.validate_tokens((*rest, tokens.eos)) == len(rest) + 1:
        return rest
    return None


def still_completes(
    grammar: Grammar, tokens: ByteTokens, plan: Plan, innermost: int | None, *, limit: int = 1 << 30
) -> Plan | None:
    """`plan` (or, in a number that cannot end yet, a `0` then `plan`) if it starts by ending the string or
    number open (`innermost`) and still ends the output from the grammar's state (one check: the grammar
    takes it and then EOS). A number's digits written in the place of the completion's (a `score` of
    0.8125 where the walk ended it at 0) leave the rest of it the shortest: without this, an output writing
    digits along its budget walked at every token (~2 ms a walk for `enums`' 20 records). `limit`: the most
    tokens it may take (a completion from another state than the last one is not the shortest)."""
    first = tokens.info.vocab[plan[0]][:1]
    if innermost != NUMBER:
        return plan if first in _STRING_ENDS and fits(grammar, tokens, plan, limit) else None
    if first not in _NUMBER_ENDS:
        return None
    if fits(grammar, tokens, plan, limit):
        return plan
    zero = tokens.by_byte.get(ord("0"))
    return fits(grammar, tokens, (zero, *plan), limit) if zero is not None else None


def from_stale(
    grammar: Grammar,
    tokens: ByteTokens,
    stale: Plan,
    since: list[int],
    innermost: int | None,
    left: int,
    *,
    in_value: bool = True,
) -> Plan | None:
    """A completion from the grammar's state made of (the rest of) `stale`, the last completion computed,
    some tokens ago, within `left` tokens; None if none is found (the walk decides).

    Far from the limit the closer skips tokens, and the next look used to walk (~1 ms on SmolLM2's
    `optional_anyof`, 1.6 walks a step of 32 outputs). The output has usually moved on through the same
    keys and punctuation: in a string or number, the old completion still ends it where it starts by ending
    that value; elsewhere the text written since, up to its last quote or punctuation, is found in the old
    completion's text on a token boundary (the longest such run) and the completion past it is tried. The
    grammar checks what is returned, so it is a completion, maybe longer than the shortest (it may hold a
    member or an item the output has written since): far from the limit that only brings the next look
    nearer, and near it the closer looks at every token from a fresh completion. `in_value` False: the caller
    has already tried `still_completes`."""
    if in_value and innermost in (STRING, NUMBER):
        plan = still_completes(grammar, tokens, stale, innermost, limit=left)
        if plan is not None:
            return plan
    written = tokens.text(since)
    text, offsets = _text_and_ends(tokens, stale)
    ends = set(offsets)
    # All that was written (a key being written, `},{"na`, is in the old text as it stands), then only up
    # to its last quote or punctuation (a value the old completion wrote otherwise: `"id":` of `"id":7`).
    cut = max(map(written.rfind, _ANCHOR_RUN_ENDS)) + 1
    for run in dict.fromkeys((written, written[:cut])):
        at = _longest_anchor_end(run, text, ends)
        rest = _rest_past(tokens, stale, text, offsets, at) if at is not None else None
        plan = fits(grammar, tokens, rest, left) if rest else None
        if plan is not None:
            return plan
    return None
