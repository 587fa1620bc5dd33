"""OpenAI's `logprobs` objects (chat and legacy completions) for a choice's sampled tokens."""

from __future__ import annotations

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
    tokens = [_token_text(tokenizer, e.token_id)[0] for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(tokenizer, t)[0]: lp for t, lp in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }
