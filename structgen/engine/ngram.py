"""N-gram prompt lookup: the speculative proposer that needs no model.

Structured extraction copies much of its answer from the prompt (names, dates, identifiers). The proposer
matches the last `n` tokens of a sequence (prompt and output so far, `n` from `max_n` down to `min_n`) against
everything before them and proposes the `k` tokens that followed the latest earlier occurrence. The search runs
over the token ids packed as 4-byte words, so `bytes.rfind` does the scanning in C.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WORD = array("i").itemsize


def propose_ngram(token_ids: Sequence[int], *, k: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix n-gram
    (`min_n <= n <= max_n`); [] when no suffix of at least `min_n` tokens occurred before."""
    length = len(token_ids)
    if k <= 0 or length < min_n + 1:
        return []
    packed = array("i", token_ids).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = packed[(length - n) * _WORD :]
        end = (length - 1) * _WORD  # an occurrence must end before the suffix's last token
        while True:
            found = packed.rfind(pattern, 0, end)
            if found < 0:
                break
            if found % _WORD == 0:
                start = found // _WORD + n
                return list(token_ids[start : start + k])
            end = found + len(pattern) - 1  # misaligned (inside a word): look further left
    return []
