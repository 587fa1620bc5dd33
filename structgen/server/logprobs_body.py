"""OpenAI's `logprobs` objects (chat and legacy completions) for a choice's sampled tokens, the legacy object for
an echoed prompt, and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from structgen.engine.outputs import TokenLogprob


def _token_text(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object for these sampled tokens."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    content = [
        one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top_logprobs]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Any, entries: list[TokenLogprob], *, offset: int = 0) -> dict[str, Any]:
    """The legacy completions `logprobs` object; `offset` is where the first token starts in the choice's text."""
    return _legacy(tokenizer, [e.token_id for e in entries], entries, offset=offset, top=None)


def prompt_completion_logprobs(
    tokenizer: Any, token_ids: list[int], entries: Sequence[TokenLogprob | None], *, top: int
) -> dict[str, Any]:
    """The legacy `logprobs` object of an echoed prompt, whose text starts the choice's (offsets from 0). Its
    first token has no logprob (nothing precedes it): null in `token_logprobs` and `top_logprobs`, as OpenAI and
    vLLM send it. `top`: the alternatives the request asked for (the engine may have scored more, for vLLM's
    `prompt_logprobs`)."""
    return _legacy(tokenizer, token_ids, entries, offset=0, top=top)


def joined_completion_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two legacy `logprobs` objects as one (an echoed prompt's, then its sampled tokens')."""
    return {key: first[key] + then[key] for key in first}


def _legacy(
    tokenizer: Any,
    token_ids: list[int],
    entries: Sequence[TokenLogprob | None],
    *,
    offset: int,
    top: int | None,
) -> dict[str, Any]:
    tokens = [_token_text(tokenizer, t)[0] for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob if e is not None else None for e in entries],
        "top_logprobs": [
            {_token_text(tokenizer, t)[0]: lp for t, lp in e.top_logprobs[:top]} if e is not None else None
            for e in entries
        ],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(
    tokenizer: Any, entries: Sequence[TokenLogprob | None], *, top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), a dict keyed by token id holding the
    prompt token itself, with its rank in the model's distribution there, then the `top` most likely tokens
    (ranks 1..top; the prompt token keeps its one entry when it is among them)."""

    def one(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": _token_text(tokenizer, token_id)[0]}

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
