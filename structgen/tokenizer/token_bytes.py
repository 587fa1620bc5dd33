"""The raw bytes each token stands for, which grammar engines need to match tokens against a grammar.

`tokenizer.json` stores tokens in a model-specific spelling: byte-level BPE (GPT-2, Llama 3, Qwen, cl100k)
maps each byte to a printable character; sentencepiece-style BPE (Llama 2, Mistral) writes spaces as `▁`
and bytes outside the vocabulary as `<0xNN>` byte-fallback tokens. The spelling is read off the decoder
(or the model's `byte_fallback` flag), the same decoder `decode` uses, so the bytes of a token sequence
joined together are what decoding them gives (a sentencepiece `Strip` of the first leading space aside).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal

Spelling = Literal["byte_level", "sentencepiece", "plain"]

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def _byte_level_decoder() -> dict[str, int]:
    return {char: byte for byte, char in byte_alphabet().items()}


def _decoder_parts(decoder: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [part for child in decoder.get("decoders", []) for part in _decoder_parts(child)]
    return [decoder]


def detect_spelling(tokenizer_spec: Mapping[str, Any]) -> tuple[Spelling, str]:
    """(spelling, sentencepiece space marker) from a parsed `tokenizer.json`."""
    parts = _decoder_parts(tokenizer_spec.get("decoder"))
    kinds = {part.get("type") for part in parts}
    if "ByteLevel" in kinds:
        return "byte_level", ""
    for part in parts:
        if part.get("type") == "Metaspace":
            return "sentencepiece", part.get("replacement", "▁")
        pattern = part.get("pattern") or {}
        if part.get("type") == "Replace" and part.get("content") == " " and "String" in pattern:
            return "sentencepiece", pattern["String"]
    if "ByteFallback" in kinds or (tokenizer_spec.get("model") or {}).get("byte_fallback"):
        return "sentencepiece", "▁"
    return "plain", ""


def build_token_bytes(
    tokenizer_spec: Mapping[str, Any],
    id_to_token: list[str | None],
    added_ids: frozenset[int],
) -> list[bytes]:
    """Bytes for every id in `id_to_token` (holes give b""). Added tokens are their literal text."""
    spelling, space = detect_spelling(tokenizer_spec)
    byte_fallback = bool((tokenizer_spec.get("model") or {}).get("byte_fallback"))
    table: list[bytes] = []
    if spelling == "byte_level":
        char_to_byte = _byte_level_decoder()
    for token_id, token in enumerate(id_to_token):
        if token is None:
            table.append(b"")
        elif token_id in added_ids:
            table.append(token.encode("utf-8"))
        elif spelling == "byte_level":
            # Characters outside the byte map pass through as UTF-8, as tokenizers' ByteLevel decoder does.
            table.append(
                b"".join(
                    bytes((char_to_byte[ch],)) if ch in char_to_byte else ch.encode("utf-8") for ch in token
                )
            )
        elif spelling == "sentencepiece":
            match = _BYTE_FALLBACK.fullmatch(token) if byte_fallback else None
            table.append(
                bytes((int(match.group(1), 16),)) if match else token.replace(space, " ").encode("utf-8")
            )
        else:
            table.append(token.encode("utf-8"))
    return table
