"""N-gram prompt lookup: the speculative proposer that needs no model.

Structured extraction copies much of its answer from the prompt (names, dates, identifiers). The proposer
matches the last `n` tokens of a sequence (prompt and output so far, `n` from `max_n` down to `min_n`) against
everything before them and proposes the `k` tokens that followed an earlier occurrence: the latest one of the
longest suffix first, then older ones and shorter suffixes (`ngram_candidates`), so that a caller whose grammar
rejects the first continuation can take the next. The search runs over the token ids packed as 4-byte words, so
`bytes.rfind` does the scanning in C.

`NgramProposer` is the `ngram` method's proposer: the text lookup first (`text_lookup.py`: a value copied from
the prompt's text, closed by the string closing its grammar takes), then these token n-grams.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from structgen.engine.text_lookup import TextLookup
from structgen.structured.json_scan import STRING

if TYPE_CHECKING:
    from structgen.engine.sequence import Sequence as EngineSequence

_WORD = array("i").itemsize
# Continuations tried per sequence and step until one passes its grammar (each costs one `validate_tokens`).
_MAX_CANDIDATES = 8
# Output tokens whose text the text lookup matches against the prompt's.
_TAIL_TOKENS = 12

Allowed = Callable[["EngineSequence", list[int]], list[int]]
"""`(sequence, tokens) -> the longest prefix of tokens it may produce now` (the speculator's grammar check)."""


class NgramProposer:
    def __init__(self, *, max_n: int, min_n: int, tokenizer: Any = None) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.tokenizer = tokenizer
        self.text_lookup = (
            TextLookup.build(lambda text: tokenizer.encode(text, add_special_tokens=False))
            if tokenizer is not None
            else None
        )
        self._prompt_texts: dict[int, str] = {}  # seq_id -> its prompt's text, while it runs

    def retain(self, live_seq_ids: set[int]) -> None:
        """Forget the prompt texts of sequences no longer running."""
        self._prompt_texts = {i: t for i, t in self._prompt_texts.items() if i in live_seq_ids}

    @property
    def num_held(self) -> int:
        return len(self._prompt_texts)

    def propose(
        self, wanted: list[tuple[EngineSequence, int]], allowed: Allowed, grammar_pick: object = None
    ) -> dict[int, list[int]]:
        """{seq_id: up to k proposals} for each `(sequence, k)` that has some (`grammar_pick` is the draft
        model's: a lookup has no ranking to fall back on)."""
        proposals = {}
        for seq, k in wanted:
            tokens = self._from_text(seq, k, allowed)
            if not tokens:
                candidates = ngram_candidates(seq.token_ids, k=k, max_n=self.max_n, min_n=self.min_n)
                for _, candidate in zip(range(_MAX_CANDIDATES), candidates, strict=False):
                    tokens = allowed(seq, candidate)
                    if tokens:
                        break
            if tokens:
                proposals[seq.seq_id] = tokens
        return proposals

    def _from_text(self, seq: EngineSequence, k: int, allowed: Allowed) -> list[int]:
        """The text lookup's proposal (`text_lookup.py`), closed by the string closing its grammar takes."""
        lookup = self.text_lookup
        if lookup is None:
            return []
        prompt_text = self._prompt_texts.get(seq.seq_id)
        if prompt_text is None:
            prompt_text = self._prompt_texts[seq.seq_id] = self.tokenizer.decode(seq.prompt_token_ids)
        tail = self.tokenizer.decode(seq.output_token_ids[-_TAIL_TOKENS:])
        in_string = seq.structured is not None and seq.structured.position == STRING
        tokens, closes = lookup.propose(prompt_text, tail, k=k, in_string=in_string)
        if not closes:
            return allowed(seq, tokens)
        best: list[int] = []
        for closing in lookup.closings:
            candidate = allowed(seq, (tokens + list(closing))[:k])
            if len(candidate) > len(best):
                best = candidate
        return best


def ngram_candidates(token_ids: Sequence[int], *, k: int, max_n: int, min_n: int = 1) -> Iterator[list[int]]:
    """Continuations of up to `k` tokens after earlier occurrences of the sequence's suffix n-grams, best first
    (longest suffix, then latest occurrence); each distinct continuation once."""
    length = len(token_ids)
    if k <= 0 or length < min_n + 1:
        return
    packed = array("i", token_ids).tobytes()
    seen: set[tuple[int, ...]] = set()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = packed[(length - n) * _WORD :]
        end = (length - 1) * _WORD  # an occurrence must end before the suffix's last token
        while True:
            found = packed.rfind(pattern, 0, end)
            if found < 0:
                break
            end = found + len(pattern) - 1  # the next search looks further left
            if found % _WORD:
                continue  # misaligned: inside a word
            start = found // _WORD + n
            continuation = tuple(token_ids[start : start + k])
            if continuation and continuation not in seen:
                seen.add(continuation)
                yield list(continuation)


def propose_ngram(token_ids: Sequence[int], *, k: int, max_n: int, min_n: int = 1) -> list[int]:
    """The best candidate of `ngram_candidates`, or [] when no suffix of at least `min_n` tokens occurred."""
    return next(ngram_candidates(token_ids, k=k, max_n=max_n, min_n=min_n), [])
