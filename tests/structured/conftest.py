"""Session fixtures: the `tiny` model's cl100k tokenizer (100,277 tokens in a 100,288-row embedding) and one
instance of each grammar backend built on it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from structgen.models.registry import resolve_model
from structgen.structured import StructuredBackend, TokenizerInfo, create_backend
from structgen.structured.closing import ByteTokens
from structgen.tokenizer import Tokenizer

BACKENDS = ("llguidance", "xgrammar", "outlines")


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("tiny"))


@pytest.fixture(scope="session")
def model_vocab_size() -> int:
    return int(json.loads((resolve_model("tiny") / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="session")
def info(tiny_tokenizer: Tokenizer, model_vocab_size: int) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(tiny_tokenizer, vocab_size=model_vocab_size)


@pytest.fixture(scope="session")
def encode(tiny_tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    return lambda text: tiny_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="session")
def backends(info: TokenizerInfo) -> dict[str, StructuredBackend]:
    """Built lazily: each reads the whole vocabulary once."""
    return _LazyBackends(info)


class _LazyBackends(dict[str, Any]):
    def __init__(self, info: TokenizerInfo):
        super().__init__()
        self.info = info

    def __missing__(self, name: str) -> StructuredBackend:
        backend = self[name] = create_backend(name, self.info)
        return backend


@pytest.fixture(scope="session")
def byte_tokens(info: TokenizerInfo) -> ByteTokens:
    """The cl100k vocabulary's single-byte tokens, as the closing walk steps with them."""
    return ByteTokens.of(info)
