"""Request admission checks: turn a prompt into token ids, and refuse what could never run.

A request is refused up front (ValueError naming the numbers) rather than left to starve in the queue: an empty
prompt, a token id outside the model's vocabulary, or prompt + max_tokens beyond the model context or the whole
KV cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from structgen.engine.block_manager import cdiv

if TYPE_CHECKING:
    from structgen.tokenizer import Tokenizer

PromptInput = str | list[int] | dict[str, Any]
"""A prompt: text, token ids, or `{"prompt_token_ids": [...]}` / `{"prompt": "..."}` (vLLM's dict form)."""


def tokenize_prompt(
    tokenizer: Tokenizer, prompt: PromptInput, *, vocab_size: int
) -> tuple[str | None, list[int]]:
    """(prompt text if known, token ids) of a prompt in any accepted form."""
    if isinstance(prompt, str):
        text, token_ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt.get("prompt"), str):
            text = prompt["prompt"]
            token_ids = tokenizer.encode(text)
        else:
            raise ValueError(f"a prompt dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}")
    elif isinstance(prompt, (list, tuple)):
        text, token_ids = None, list(prompt)
    else:
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    for token_id in token_ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < vocab_size:
            raise ValueError(f"prompt token id {token_id!r} is not in the vocabulary [0, {vocab_size})")
    return text, token_ids


def resolve_max_model_len(wanted: int | None, *, model_limit: int) -> int:
    """The engine's context: `max_model_len` as configured (None: the model's own), never beyond the model's."""
    if wanted is None:
        return model_limit
    if wanted > model_limit:
        raise ValueError(f"max_model_len {wanted} exceeds the model's context of {model_limit} tokens")
    return wanted


def resolve_max_tokens(
    prompt_len: int, max_tokens: int | None, *, max_model_len: int, num_blocks: int, block_size: int
) -> int:
    """The request's effective max_tokens (None: up to the longest sequence the engine can hold).

    Raises ValueError when prompt + max_tokens exceeds the model context or the whole KV cache.
    """
    cache_tokens = num_blocks * block_size
    limit = min(max_model_len, cache_tokens)
    if prompt_len >= limit:
        where = "the model context" if max_model_len <= cache_tokens else "the whole KV cache"
        raise ValueError(
            f"the prompt has {prompt_len} tokens but {where} holds {limit} tokens, prompt and output together"
        )
    if max_tokens is None:
        return limit - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model context of "
            f"{max_model_len} tokens"
        )
    if cdiv(prompt_len + max_tokens, block_size) > num_blocks:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the whole KV cache "
            f"({cache_tokens} tokens); raise kv_cache_tokens or lower max_tokens"
        )
    return max_tokens
