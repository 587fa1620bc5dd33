"""The cl100k `tokenizer.json` against tiktoken itself."""

from __future__ import annotations

import json

import pytest
import tiktoken
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from structgen.models.cl100k import (
    CL100K_ENCODING,
    CL100K_VOCAB_SIZE,
    _bpe_parts,
    build_cl100k_tokenizer_json,
)
from structgen.tokenizer import Tokenizer
from structgen.tokenizer.token_bytes import byte_alphabet

CORPUS = [
    "Hello, world! How's it going? I'm fine; they'll see, we've done it, you're right, she'd go.",
    "DON'T SHOUT. It'S MiXeD cAsE'Ll work.",
    "日本語のテキストと中文字符，한국어 텍스트, العربية, русский текст, ελληνικά.",
    "Emoji: 🎉🙂👍🏽 👨‍👩‍👧‍👦 🇵🇹 — and a zero-width joiner\u200d here.",
    "Numbers 1 12 123 1234 12345 3.14159 -42 1e10 0x1F 1,000,000 ١٢٣ ¹²³ ½",
    "Whitespace:  two  spaces,\tTabs\t\t, trailing   \n\n\nnew lines\r\n CRLF \u00a0nbsp \u3000ideographic",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    '{"name": "Maria", "age": 34, "tags": ["a", "b"], "nested": {"ok": true, "n": null}}',
    "SELECT id, name FROM users WHERE age >= 21 AND city = 'Lisbon' ORDER BY name;",
    '<html><body><p class="x">text &amp; more</p></body></html>',
    "   leading spaces and trailing spaces   ",
    "",
    " ",
    "\n",
    "a\u0301 e\u0300 combining marks, café naïve façade",
    "x" * 300,
]


@pytest.fixture(scope="module")
def encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding(CL100K_ENCODING)


@pytest.fixture(scope="module")
def backend():
    from tokenizers import Tokenizer as Backend

    return Backend.from_str(build_cl100k_tokenizer_json())


@pytest.mark.parametrize("text", CORPUS)
def test_encoding_equals_tiktoken(encoding, backend, text: str) -> None:
    expected = encoding.encode_ordinary(text)
    assert backend.encode(text, add_special_tokens=False).ids == expected
    assert backend.decode(expected) == text


_PIECES = [
    *"aZ09 \t\n\r'sdmtlvre.,:!?-_(){}<>/\\\"#*",
    "日",
    "é",
    "🎉",
    "\xa0",
    "ß",
    "д",
    "１",
    "²",
    "   ",
    "'LL",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=40).map("".join))
def test_encoding_equals_tiktoken_on_random_text(encoding, backend, text: str) -> None:
    assert backend.encode(text, add_special_tokens=False).ids == encoding.encode_ordinary(text)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_unicode_round_trips_and_matches(encoding, backend, text: str) -> None:
    # Added tokens are matched in text (as transformers does); tiktoken's encode_ordinary never matches them.
    assume(not any(token.content in text for token in backend.get_added_tokens_decoder().values()))
    ids = backend.encode(text, add_special_tokens=False).ids
    assert ids == encoding.encode_ordinary(text)
    assert backend.decode(ids) == text


def test_token_ids_are_stable_and_documented(tiny_tokenizer: Tokenizer, encoding) -> None:
    tok = tiny_tokenizer
    assert tok.vocab_size == CL100K_VOCAB_SIZE == encoding.n_vocab
    for name, token_id in encoding._special_tokens.items():
        assert tok.token_to_id(name) == token_id
    expected = {
        "<|im_start|>": 100264,
        "<|im_end|>": 100265,
        "<tool_call>": 100261,
        "</tool_call>": 100262,
        "<tool_response>": 100263,
        "</tool_response>": 100266,
        "<|reserved_special_token_0|>": 100256,
    }
    for content, token_id in expected.items():
        assert tok.token_to_id(content) == token_id
    # The ids are dense: every id up to the vocabulary size names a token.
    assert all(tok.id_to_token(i) for i in range(100250, CL100K_VOCAB_SIZE))
    # Tool-call tags are ordinary text on decode; ChatML markers are special and skipped.
    ids = tok.encode("<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>", add_special_tokens=False)
    assert ids[0] == 100264 and 100261 in ids and 100262 in ids and ids[-1] == 100265
    assert tok.decode(ids) == "assistant\n<tool_call>{}</tool_call>"


def test_bpe_merges_recover_every_token(encoding) -> None:
    spec = json.loads(build_cl100k_tokenizer_json())
    ranks = encoding._mergeable_ranks
    assert len(spec["model"]["vocab"]) == len(ranks)
    # Every multi-byte cl100k token is reachable by merges, in rank order.
    assert len(spec["model"]["merges"]) == sum(1 for token in ranks if len(token) > 1)
    byte_map = byte_alphabet()
    unmap = {ch: b for b, ch in byte_map.items()}
    for left, right in spec["model"]["merges"][:2000:37]:
        token = bytes(unmap[c] for c in left + right)
        assert _bpe_parts(ranks, token, ranks[token]) == [
            bytes(unmap[c] for c in left),
            bytes(unmap[c] for c in right),
        ]


def test_build_is_deterministic() -> None:
    first = build_cl100k_tokenizer_json()
    build_cl100k_tokenizer_json.cache_clear()
    assert build_cl100k_tokenizer_json() == first
