"""N-gram prompt lookup: the speculative proposer that needs no model.

Structured extraction copies much of its answer from the prompt (names, dates, identifiers). The proposer
matches the last `n` tokens of a sequence (prompt and output so far, `n` from `max_n` down to `min_n`) against
everything before them and proposes the `k` tokens that followed an earlier occurrence: the latest one of the
longest suffix first, then older ones and shorter suffixes (`ngram_candidates`), so that a caller whose grammar
rejects the first continuation can take the next. The search runs over the token ids packed as 4-byte words, so
`bytes.rfind` does the scanning in C.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

_WORD = array("i").itemsize


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
