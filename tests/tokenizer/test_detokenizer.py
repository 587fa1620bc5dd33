"""IncrementalDetokenizer: no broken characters in a stream, deltas add up to the full decode, small windows."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structgen.tokenizer import IncrementalDetokenizer, Tokenizer

MULTIBYTE_TEXTS = [
    "Party time 🎉🎉 with 👨‍👩‍👧‍👦 and flags 🇵🇹🇯🇵!",
    "日本語のテキスト、中文字符和한국어가 섞여 있다。",
    "ünïcödé façade — “quotes” … ½ ∑ ∞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    'JSON: {"emoji": "🙂", "city": "São Paulo", "温度": 21}',
]


def _stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] = (1,)
) -> list[str]:
    deltas, i, k = [], 0, 0
    while i < len(ids):
        size = chunk_sizes[k % len(chunk_sizes)]
        deltas.append(detok.push(ids[i : i + size]))
        i, k = i + size, k + 1
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("which", ["cl100k", "sentencepiece"])
def test_multibyte_characters_split_across_tokens(
    tiny_tokenizer, sp_tokenizer, which: str, text: str
) -> None:
    tok: Tokenizer = tiny_tokenizer if which == "cl100k" else sp_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    # The test only means something if some character really is split across tokens.
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)
    deltas = _stream(IncrementalDetokenizer(tok), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_emoji_bytes_are_held_until_complete(sp_tokenizer: Tokenizer) -> None:
    ids = sp_tokenizer.encode("a🎉", add_special_tokens=False)
    byte_ids = [sp_tokenizer.token_to_id(f"<0x{b:02X}>") for b in "🎉".encode()]
    assert ids[-4:] == byte_ids
    detok = IncrementalDetokenizer(sp_tokenizer)
    assert [detok.push(i) for i in ids] == ["a", "", "", "", "🎉"]
    assert detok.flush() == ""


def test_output_ending_mid_character_flushes_replacement(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("ok 🎉", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte token never comes
    detok = IncrementalDetokenizer(tiny_tokenizer)
    streamed = "".join(detok.push(i) for i in cut)
    assert "\ufffd" not in streamed
    assert detok.num_pending_tokens > 0
    assert streamed + detok.flush() == tiny_tokenizer.decode(cut)


@pytest.mark.parametrize("chunks", [(1,), (2, 3), (5,), (1, 7, 2)])
def test_multi_token_pushes(tiny_tokenizer: Tokenizer, chunks) -> None:
    text = " ".join(MULTIBYTE_TEXTS)
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tiny_tokenizer), ids, chunks)
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)


def test_prompt_context_keeps_leading_space(sp_tokenizer: Tokenizer) -> None:
    prompt = sp_tokenizer.encode("[INST] hi [/INST]")
    output = sp_tokenizer.encode("Hello world 🙂", add_special_tokens=False)  # starts with the prepended "▁"
    full = sp_tokenizer.decode(prompt + output)
    expected = full[len(sp_tokenizer.decode(prompt)) :]
    assert expected.startswith(" Hello")  # sentencepiece keeps the space after the prompt ...
    assert not sp_tokenizer.decode(output).startswith(" ")  # ... but strips it when decoded alone
    deltas = _stream(IncrementalDetokenizer(sp_tokenizer, prompt), output)
    assert "".join(deltas) == expected


def test_prompt_ids_outside_the_vocabulary_are_no_context(tiny_tokenizer: Tokenizer) -> None:
    # The tiny model's embedding has padding rows past the tokenizer; a prompt may name them.
    prompt = [9906, 100280, 100287]
    output = tiny_tokenizer.encode(" world 🎉", add_special_tokens=False)
    assert "".join(_stream(IncrementalDetokenizer(tiny_tokenizer, prompt), output)) == " world 🎉"
    with pytest.raises(ValueError, match="100280"):
        IncrementalDetokenizer(tiny_tokenizer).push(100280)


def test_special_tokens_skipped_or_kept(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("<|im_start|>assistant\nHi 🙂<tool_call>{}</tool_call><|im_end|>")
    skipped = _stream(IncrementalDetokenizer(tiny_tokenizer), ids)
    assert "".join(skipped) == "assistant\nHi 🙂<tool_call>{}</tool_call>"
    kept = _stream(IncrementalDetokenizer(tiny_tokenizer, skip_special_tokens=False), ids)
    assert "".join(kept) == "<|im_start|>assistant\nHi 🙂<tool_call>{}</tool_call><|im_end|>"


class _CountingTokenizer:
    """Records the length of every decode the detokenizer asks for."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.window_sizes: list[int] = []

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_small_window(tiny_tokenizer: Tokenizer) -> None:
    text = " ".join(MULTIBYTE_TEXTS) * 40
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 2000
    counting = _CountingTokenizer(tiny_tokenizer)
    prompt = tiny_tokenizer.encode("a long prompt " * 100)
    detok = IncrementalDetokenizer(counting, prompt)  # type: ignore[arg-type]
    deltas = _stream(detok, ids)
    assert "".join(deltas) == text
    # A window holds the previous step and a held-back character: a few tokens, whatever the output length.
    assert max(counting.window_sizes) <= 8
    assert len(counting.window_sizes) <= 2 * (len(ids) + 1)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 300), st.integers(0, 100276)), max_size=40), data=st.data())
def test_random_byte_level_ids_add_up_to_decode(tiny_tokenizer: Tokenizer, ids: list[int], data) -> None:
    # Ids 0..255 are single bytes in cl100k, so this mixes valid, split and invalid UTF-8 freely.
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    for skip in (True, False):
        deltas = _stream(IncrementalDetokenizer(tiny_tokenizer, skip_special_tokens=skip), ids, chunks)
        assert "".join(deltas) == tiny_tokenizer.decode(ids, skip_special_tokens=skip)
        # Only the final flush may end in the middle of a character.
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])


def test_random_text_streams_cleanly(tiny_tokenizer: Tokenizer, sp_tokenizer: Tokenizer) -> None:
    rng = random.Random(3)
    alphabet = "ab 🎉日本é\n{}\"'ü語🙂"
    for tok in (tiny_tokenizer, sp_tokenizer):
        for _ in range(30):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
            ids = tok.encode(text, add_special_tokens=False)
            deltas = _stream(IncrementalDetokenizer(tok), ids, (rng.randint(1, 3),))
            assert all("\ufffd" not in d for d in deltas)
            assert "".join(deltas) == tok.decode(ids)
