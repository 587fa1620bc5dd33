"""What the grammar backends need to know about a tokenizer, built once per (tokenizer, model).

Backends see the vocabulary as raw bytes (byte-level BPE decoded, sentencepiece `▁` mapped to a space), the
ids that end generation, the ids no grammar may ever emit (special tokens and holes in the id space), and
the model's *padded* vocabulary size: the embedding matrix is often larger than the tokenizer, and the mask
must cover (and forbid) those extra rows too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class SupportsTokenBytes(Protocol):
    """The slice of `structgen.tokenizer.Tokenizer` this layer relies on."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> Any: ...

    @property
    def all_special_ids(self) -> Any: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True, slots=True, eq=False)
class TokenizerInfo:
    """Vocabulary as bytes plus the ids that matter for masking; `tokenizer_id` is a stable cache key.

    `vocab[i]` is the byte string of token `i` (b"" for ids the tokenizer does not define); ids in
    `special_token_ids` are never allowed by a grammar except the EOS ids, which a grammar allows where it
    can terminate. `encode` tokenizes text canonically without adding special tokens; jump-forward uses it so
    forced text enters the sequence the way the model saw such text in training.
    """

    vocab: tuple[bytes, ...]
    eos_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]
    vocab_size: int
    encode: Callable[[str], list[int]] = field(repr=False)
    tokenizer_id: str = ""

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise ValueError("TokenizerInfo needs at least one EOS token id")
        if self.vocab_size < len(self.vocab):
            raise ValueError(
                f"vocab_size {self.vocab_size} is smaller than the tokenizer's {len(self.vocab)} tokens; "
                "pass the model's (padded) vocabulary size"
            )
        bad = [i for i in self.eos_token_ids if not 0 <= i < len(self.vocab)]
        if bad:
            raise ValueError(f"EOS token ids {bad} lie outside the tokenizer's {len(self.vocab)} tokens")
        if not self.tokenizer_id:
            object.__setattr__(self, "tokenizer_id", _fingerprint(self))

    @property
    def num_tokens(self) -> int:
        """Tokens the tokenizer defines (ids `num_tokens..vocab_size-1` are model padding)."""
        return len(self.vocab)

    @classmethod
    def from_tokenizer(cls, tokenizer: SupportsTokenBytes, *, vocab_size: int | None = None) -> TokenizerInfo:
        """From `structgen.tokenizer.Tokenizer`; `vocab_size` is the model's embedding rows (default: the
        tokenizer's own size)."""
        n = int(tokenizer.vocab_size)
        special = {int(i) for i in tokenizer.all_special_ids}
        table = getattr(tokenizer, "all_token_bytes", None)
        vocab: list[bytes] = []
        if table is not None:
            vocab = [bytes(b) for b in table()]
        else:
            for i in range(n):
                try:
                    vocab.append(bytes(tokenizer.token_bytes(i)))
                except (KeyError, IndexError, ValueError):
                    vocab.append(b"")
        # An id the tokenizer leaves undefined has no bytes: never allowed.
        special.update(i for i, tok in enumerate(vocab) if not tok)
        eos = tuple(sorted(int(i) for i in tokenizer.eos_token_ids))

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        return cls._build(vocab, eos, special, vocab_size, encode)

    @classmethod
    def from_tiktoken(
        cls,
        encoding: Any,
        *,
        eos_token_ids: Sequence[int] | None = None,
        added_special_tokens: Sequence[str] = (),
        vocab_size: int | None = None,
    ) -> TokenizerInfo:
        """From a `tiktoken.Encoding`; `added_special_tokens` get the ids after the encoding's last one
        (how the `tiny` model appends its ChatML tokens)."""
        specials = {i: s.encode() for s, i in encoding._special_tokens.items()}
        n = encoding.n_vocab
        for k, text in enumerate(added_special_tokens):
            specials[n + k] = text.encode()
        vocab: list[bytes] = []
        special_ids = set(specials)
        for i in range(n + len(added_special_tokens)):
            if i in specials:
                vocab.append(specials[i])
                continue
            try:
                vocab.append(encoding.decode_single_token_bytes(i))
            except KeyError:
                vocab.append(b"")
                special_ids.add(i)
        eos = tuple(eos_token_ids) if eos_token_ids is not None else (encoding.eot_token,)

        def encode(text: str) -> list[int]:
            return encoding.encode_ordinary(text)

        return cls._build(vocab, eos, special_ids, vocab_size, encode)

    @classmethod
    def _build(
        cls,
        vocab: list[bytes],
        eos: Sequence[int],
        special: set[int],
        vocab_size: int | None,
        encode: Callable[[str], list[int]],
    ) -> TokenizerInfo:
        return cls(
            vocab=tuple(vocab),
            eos_token_ids=tuple(sorted(set(eos))),
            special_token_ids=frozenset(special | set(eos)),
            vocab_size=len(vocab) if vocab_size is None else int(vocab_size),
            encode=encode,
        )


def _fingerprint(info: TokenizerInfo) -> str:
    h = hashlib.sha256()
    h.update(f"{info.vocab_size}|{info.eos_token_ids}|{sorted(info.special_token_ids)}|".encode())
    for tok in info.vocab:
        h.update(len(tok).to_bytes(4, "little"))
        h.update(tok)
    return h.hexdigest()[:16]
