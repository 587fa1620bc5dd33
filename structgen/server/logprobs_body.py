"""OpenAI's `logprobs` objects (chat and legacy completions) for a choice's sampled tokens, the legacy object for
an echoed prompt, and vLLM's `prompt_logprobs`.

Three rules hold in every body, as vLLM's OpenAI server keeps them:
- A logprob of -inf (a token the model cannot produce there: a padded embedding row in a token prompt) is sent
  as -9999.0, because JSON has no infinities (`-Infinity` breaks clients' parsers, and starlette's JSON answer
  refuses it outright).
- The legacy object's `top_logprobs` hold the `logprobs` most likely tokens *and* the chosen token (the sampled
  one, or the prompt's own token at an echoed position), so up to `logprobs + 1` entries: OpenAI's legacy API
  documents it, vLLM's completions do it, and lm-evaluation-harness' `is_greedy` compares the chosen token's
  logprob with the best of them. Chat's `top_logprobs` stay exactly the `top_logprobs` best (OpenAI's chat).
- `text_offset` counts characters of the choice's real text, not sums of token texts: a BOS or a skipped
  special token has no text there, a character split over tokens is one character, and a stop string may
  cut the text inside a token (`SampledOffsets`, `prompt_offsets`).
"""

from __future__ import annotations

import codecs
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

from structgen.engine.outputs import TokenLogprob

# What vLLM (after OpenAI) sends for a logprob of -inf.
MIN_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """`logprob` as JSON can carry it: -inf (and a NaN, which no distribution should give) as -9999.0."""
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # NaN compares false: clamped too


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token's text as the logprobs bodies name it: its bytes, a broken character as U+FFFD. An id past the
    tokenizer (a model's padded embedding rows, which a token prompt may hold) has no text."""
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    try:
        return tokenizer.token_bytes(token_id)
    except ValueError:  # outside the tokenizer's vocabulary
        return b""


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object for these sampled tokens."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(tokenizer, token_id)
        text = raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(raw)}

    content = [
        one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top_logprobs]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Any, entries: Sequence[TokenLogprob], offsets: Sequence[int]
) -> dict[str, Any]:
    """The legacy completions `logprobs` object of sampled tokens; `offsets`: where each starts in the choice's
    text (`SampledOffsets`)."""
    return _legacy(tokenizer, [e.token_id for e in entries], entries, offsets, top=None)


def prompt_completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    entries: Sequence[TokenLogprob | None],
    offsets: Sequence[int],
    *,
    top: int,
) -> dict[str, Any]:
    """The legacy `logprobs` object of an echoed prompt, whose text starts the choice's (`offsets` from
    `prompt_offsets`). Its first token has no logprob (nothing precedes it): null in `token_logprobs` and
    `top_logprobs`, as OpenAI and vLLM send it. `top`: the alternatives the request asked for (the engine may
    have scored more, for vLLM's `prompt_logprobs`), listed after the prompt's own token."""
    return _legacy(tokenizer, token_ids, entries, offsets, top=top)


def joined_completion_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two legacy `logprobs` objects as one (an echoed prompt's, then its sampled tokens')."""
    return {key: first[key] + then[key] for key in first}


def _legacy(
    tokenizer: Any,
    token_ids: list[int],
    entries: Sequence[TokenLogprob | None],
    offsets: Sequence[int],
    *,
    top: int | None,
) -> dict[str, Any]:
    if not len(token_ids) == len(entries) == len(offsets):
        raise ValueError(f"{len(token_ids)} tokens, {len(entries)} logprobs and {len(offsets)} offsets")
    return {
        "tokens": [token_text(tokenizer, t) for t in token_ids],
        "token_logprobs": [json_logprob(e.logprob) if e is not None else None for e in entries],
        "top_logprobs": [_legacy_top(tokenizer, e, top) if e is not None else None for e in entries],
        "text_offset": list(offsets),
    }


def _legacy_top(tokenizer: Any, entry: TokenLogprob, top: int | None) -> dict[str, float]:
    """The chosen token, then the `top` most likely ones, by text, as vLLM orders them. Keyed by text, two
    tokens of the same text (byte tokens of broken characters) share one entry and the first keeps it, so the
    chosen token's entry is always its own logprob (`top_logprobs[i][tokens[i]] == token_logprobs[i]`, which
    lm-evaluation-harness' `is_greedy` compares with the best value)."""
    alternatives = {token_text(tokenizer, entry.token_id): json_logprob(entry.logprob)}
    for token_id, logprob in entry.top_logprobs[:top]:
        alternatives.setdefault(token_text(tokenizer, token_id), json_logprob(logprob))
    return alternatives


def vllm_prompt_logprobs(
    tokenizer: Any, entries: Sequence[TokenLogprob | None], *, top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), a dict keyed by token id holding the
    prompt token itself, with its rank in the model's distribution there, then the `top` most likely tokens
    (ranks 1..top; the prompt token keeps its one entry when it is among them)."""

    def one(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {
            "logprob": json_logprob(logprob),
            "rank": rank,
            "decoded_token": token_text(tokenizer, token_id),
        }

    positions: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None:
            positions.append(None)
            continue
        position = {str(e.token_id): one(e.token_id, e.logprob, e.rank)}
        for rank, (token_id, logprob) in enumerate(e.top_logprobs[:top], start=1):
            position.setdefault(str(token_id), one(token_id, logprob, rank))
        positions.append(position)
    return positions


# -- text offsets ---------------------------------------------------------------------------------------------
#
# A token's place in the text is where the text decoded from the tokens before it ends: their bytes decoded as
# one UTF-8 stream, so a token that continues a character split over tokens starts at that character, and an
# added token's text is its own. That rebuilt text is, for byte-level vocabularies, exactly what the tokenizer
# decodes (the engine's `IncrementalDetokenizer` decodes the same bytes); where the choice's real text differs
# (a BOS the tokenizer added to a text prompt, sentencepiece's stripped first space, a stop string cutting the
# output), the places are mapped onto the real text, so offsets never pass its end and never go back.


class SampledOffsets:
    """Where each of a choice's sampled tokens starts in its text, the tokens pushed as they come (a stream) or
    at once. `start`: where the sampled text starts in the choice's (after an echoed prompt). Places are
    counted in the rebuilt text and kept only as far as it agrees with the real one (the engine's text ends
    earlier where a stop string cut it, or where an EOS / stop token is left out): a place past that is the
    point where they part, the end of a cut text. So a stream sends a token's entry once its place is inside
    the text both agree on, and the offsets it sends are those the whole answer has."""

    __slots__ = (
        "_agreed",
        "_decoder",
        "_finished",
        "_length",
        "_new",
        "_skipped",
        "_start",
        "_starts",
        "_tail",
        "_tokenizer",
    )

    def __init__(self, tokenizer: Any, *, start: int = 0, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        # The engine leaves special tokens out of the text (`SamplingParams.skip_special_tokens`).
        self._skipped: frozenset[int] = (
            getattr(tokenizer, "all_special_ids", frozenset()) if skip_special_tokens else frozenset()
        )
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._starts: list[int] = []  # each pushed token's place in the rebuilt text
        self._length = 0  # of the rebuilt text
        # The rebuilt text past `_agreed` (how far it agrees with the real one, as last compared), then the
        # pieces decoded since: what agrees never changes (both texts only grow), so only the rest is kept and
        # compared, and a long stream costs no more per chunk than its new text.
        self._agreed = 0
        self._tail = ""
        self._new: list[str] = []
        self._start = start
        self._finished = False

    def __len__(self) -> int:
        return len(self._starts)

    def push(self, token_ids: Iterable[int]) -> None:
        for token_id in token_ids:
            self._starts.append(self._length)
            if token_id not in self._skipped:
                self._add(self._decoder.decode(token_bytes(self._tokenizer, token_id)))

    def settled(self, text: str, *, since: int = 0, finished: bool = True) -> list[int]:
        """The offsets of the pushed tokens from `since` on whose place in `text` (the choice's sampled text so
        far; each call's extends the last's) is settled: all of them once `finished` (the text is final), else
        those that start inside the text the rebuilt one agrees with."""
        if finished and not self._finished:
            self._add(self._decoder.decode(b"", final=True))  # a broken last character, as U+FFFD
            self._finished = True
        self._tail += "".join(self._new)
        self._new.clear()
        agreed = self._agreed + _common_prefix(self._tail, text[self._agreed :])
        self._tail = self._tail[agreed - self._agreed :]
        self._agreed = agreed
        count = len(self._starts) if finished else bisect_right(self._starts, agreed)
        return [self._start + min(place, agreed) for place in self._starts[since:count]]

    def _add(self, piece: str) -> None:
        if piece:
            self._new.append(piece)
            self._length += len(piece)


def prompt_offsets(tokenizer: Any, token_ids: Sequence[int], text: str) -> list[int]:
    """Where each prompt token starts in the echoed prompt `text` (the request's text, or the token prompt
    decoded with its special tokens, as vLLM echoes it). A token the text does not hold (a BOS the tokenizer
    added to a text prompt) sits where the text around it puts it."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces: list[str] = []
    starts: list[int] = []
    length = 0
    for token_id in token_ids:
        starts.append(length)
        piece = decoder.decode(token_bytes(tokenizer, token_id))
        pieces.append(piece)
        length += len(piece)
    pieces.append(decoder.decode(b"", final=True))
    return _mapped(starts, "".join(pieces), text)


def _mapped(places: list[int], rebuilt: str, text: str) -> list[int]:
    """`places` in `rebuilt` as places in `text`: the part both start with and the part both end with map
    exactly, a place in between (where they differ: a BOS only `rebuilt` has) goes to the same distance into
    `text`'s differing part, at most its end. Monotone, and never past `len(text)`."""
    head = _common_prefix(rebuilt, text)
    most = min(len(rebuilt), len(text)) - head
    tail = min(_common_prefix(rebuilt[::-1], text[::-1]), most)
    rebuilt_tail, text_tail = len(rebuilt) - tail, len(text) - tail

    def place(at: int) -> int:
        if at <= head:
            return at
        if at >= rebuilt_tail:
            return at - rebuilt_tail + text_tail
        return head + min(at - head, text_tail - head)

    return [place(at) for at in places]


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b`: one comparison where they agree (the usual case),
    else a bisection for where they part (string comparisons run in C, a loop over characters would not)."""
    end = min(len(a), len(b))
    if a[:end] == b[:end]:
        return end
    agree, differ = 0, end  # a[:agree] == b[:agree], a[:differ] != b[:differ]
    while differ - agree > 1:
        middle = (agree + differ) // 2
        if a[agree:middle] == b[agree:middle]:
            agree = middle
        else:
            differ = middle
    return agree
