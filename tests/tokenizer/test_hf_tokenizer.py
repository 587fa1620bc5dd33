"""`Tokenizer`: loading a directory, encode/decode parity with transformers, special ids, token bytes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizer_fixtures import build_sentencepiece_style_tokenizer

from structgen.errors import ModelLoadError
from structgen.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "  two leading spaces, trailing  ",
    "The quick brown fox 🎉 jumps; 日本語 and 中文, ünïcödé.",
    "line one\nline two\n\n\tindented\r\nend",
    '{"name": "Maria", "age": 34}',
    "special markers in text: <|im_start|>user<|im_end|> <s></s> <tool_call>",
    "",
    " ",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_decode_match_transformers_cl100k(tiny_tokenizer, hf_tiny, text, add_special_tokens) -> None:
    ids = tiny_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert ids == hf_tiny.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        assert tiny_tokenizer.decode(ids, skip_special_tokens=skip) == hf_tiny.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_decode_match_transformers_sentencepiece(
    sp_tokenizer, hf_sp, text, add_special_tokens
) -> None:
    ids = sp_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert ids == hf_sp.encode(text, add_special_tokens=add_special_tokens)
    if add_special_tokens:
        assert ids[0] == sp_tokenizer.bos_token_id == 1  # the post-processor adds BOS
    for skip in (True, False):
        assert sp_tokenizer.decode(ids, skip_special_tokens=skip) == hf_sp.decode(
            ids, skip_special_tokens=skip
        )


@settings(max_examples=150, deadline=None)
@given(text=st.text())
def test_round_trip_any_text(tiny_tokenizer, sp_tokenizer, text: str) -> None:
    # Text spelling a special token (`<|endoftext|>`, which hypothesis found) encodes to that token, which
    # decoding skips by default: the round trip is for other text.
    assume("<|" not in text and "<s>" not in text and "</s>" not in text)
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text
    # Sentencepiece normalization maps " " to "▁" and back, and drops only the space it prepended itself.
    assert sp_tokenizer.decode(sp_tokenizer.encode(text)) == text


def test_properties_of_tiny(tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    assert tok.vocab_size == len(tok) == 100277
    assert tok.bos_token_id == 100257
    assert tok.pad_token_id == 100257
    # generation_config lists <|im_end|> and <|endoftext|>; the tokenizer's eos is <|im_end|>.
    assert tok.eos_token_ids == frozenset({100265, 100257})
    assert tok.eos_token_id == 100265
    assert tok.token_spelling == "byte_level"
    assert {100257, 100264, 100265}.issubset(tok.all_special_ids)
    assert 100261 not in tok.all_special_ids  # <tool_call> is a normal added token
    assert tok.id_to_token(9906) == "Hello"
    with pytest.raises(ValueError, match="100277"):
        tok.id_to_token(100277)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([1, -1])
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_token_bytes_byte_level(tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    assert tok.token_bytes(9906) == b"Hello"
    assert tok.token_bytes(220) == b" "
    assert tok.token_bytes(100264) == b"<|im_start|>"
    table = tok.all_token_bytes()
    assert len(table) == tok.vocab_size
    # Every single byte is a token of its own, and no two mergeable tokens share bytes.
    assert {table[i] for i in range(100256) if len(table[i]) == 1} == {bytes([b]) for b in range(256)}
    assert len({table[i] for i in range(100256)}) == 100256
    ids = tok.encode("emoji 🎉 and 日本語 text", add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == "emoji 🎉 and 日本語 text"


def test_token_bytes_sentencepiece(sp_tokenizer: Tokenizer) -> None:
    tok = sp_tokenizer
    assert tok.token_spelling == "sentencepiece"
    assert tok.token_bytes(tok.token_to_id("<0xF0>")) == b"\xf0"
    assert tok.token_bytes(tok.token_to_id("▁")) == b" "
    assert tok.token_bytes(1) == b"<s>"
    text = "The cat 🎉 日本語 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)
    # The normalizer prepends a space that decoding strips again.
    assert b"".join(tok.token_bytes(i) for i in ids) == b" " + text.encode()


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_token_bytes_agree_with_decode(tiny_tokenizer, sp_tokenizer, data) -> None:
    for tok in (tiny_tokenizer, sp_tokenizer):
        drawn = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=12))
        ids = [i for i in drawn if i not in tok.all_special_ids]
        joined = b"".join(tok.token_bytes(i) for i in ids)
        if tok is tiny_tokenizer:
            # Byte-level decoding is a lossy UTF-8 decode of exactly these bytes.
            assert tok.decode(ids) == joined.decode("utf-8", errors="replace")
        elif _is_utf8(joined):
            # Byte fallback replaces every byte of an invalid run, so compare valid text only; the decoder
            # strips the one leading space the normalizer prepends.
            text = joined.decode()
            assert tok.decode(ids) == (text[1:] if text.startswith(" ") else text)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_missing_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_bad_config_values_are_clear_errors(tmp_path: Path) -> None:
    d = build_sentencepiece_style_tokenizer(tmp_path / "a", tokenizer_config={"chat_template": 42})
    with pytest.raises(ModelLoadError, match="chat_template"):
        Tokenizer.from_dir(d)
    d = build_sentencepiece_style_tokenizer(tmp_path / "b", tokenizer_config={"eos_token": ["</s>"]})
    with pytest.raises(ModelLoadError, match="eos_token"):
        Tokenizer.from_dir(d)
    d = build_sentencepiece_style_tokenizer(tmp_path / "c")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ModelLoadError, match="eos_token_id"):
        Tokenizer.from_dir(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 5000}))
    with pytest.raises(ModelLoadError, match="5000"):
        Tokenizer.from_dir(d)


def test_eos_ids_from_generation_config_or_config(tmp_path: Path) -> None:
    d = build_sentencepiece_style_tokenizer(tmp_path / "sp")
    assert Tokenizer.from_dir(d).eos_token_ids == {2}  # only the tokenizer's own </s>
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert Tokenizer.from_dir(d).eos_token_ids == {7, 2}
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert Tokenizer.from_dir(d).eos_token_ids == {7, 8, 2}
    (d / "generation_config.json").unlink()
    assert Tokenizer.from_dir(d).eos_token_ids == {9, 2}
    (d / "config.json").write_text(json.dumps({"eos_token_id": [9, 10]}))
    assert Tokenizer.from_dir(d).eos_token_ids == {9, 10, 2}


def test_add_bos_token_applies_without_post_processor(tmp_path: Path) -> None:
    d = build_sentencepiece_style_tokenizer(tmp_path / "sp")
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(spec))
    assert Tokenizer.from_dir(d).encode("hi")[0] == 1
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["add_bos_token"] = False
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert 1 not in Tokenizer.from_dir(d).encode("hi")


def test_missing_declared_tokens_are_added(tmp_path: Path) -> None:
    d = build_sentencepiece_style_tokenizer(
        tmp_path / "sp",
        tokenizer_config={
            "added_tokens_decoder": {"658": {"content": "<|tool|>", "special": False}},
            "pad_token": "<pad>",
        },
    )
    from transformers import AutoTokenizer

    ours, theirs = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
    text = "call <|tool|> then <pad> done"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.pad_token_id == theirs.pad_token_id == ours.token_to_id("<pad>")
    assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)


def test_random_ids_decode_like_transformers(tiny_tokenizer, hf_tiny, sp_tokenizer, hf_sp) -> None:
    rng = random.Random(7)
    for ours, theirs in ((tiny_tokenizer, hf_tiny), (sp_tokenizer, hf_sp)):
        for _ in range(50):
            ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 20))]
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip
                )
