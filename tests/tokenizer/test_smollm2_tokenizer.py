"""The embedded default model's tokenizer (SmolLM2-135M-Instruct, converted from its GGUF): ours equals
transformers' load of the same directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from structgen.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    'Extract the person as JSON with keys name, age, city: "Maria is 34 years old and lives in Lisbon."',
    "  leading and trailing  \n\n\ttabs, 12345 numbers, 3.14, CamelCase_snake-case",
    "日本語 🎉 émoji ünïcode — “quotes”",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from structgen.models.registry import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def ours(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def theirs(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_encode_decode_match(ours: Tokenizer, theirs: Any) -> None:
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.bos_token_id == theirs.bos_token_id and theirs.eos_token_id in ours.eos_token_ids
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_chat_template_matches(ours: Tokenizer, theirs: Any) -> None:
    conversations = [
        [{"role": "user", "content": TEXTS[0]}],
        [
            {"role": "system", "content": "You answer in JSON."},
            {"role": "user", "content": "Who?"},
            {"role": "assistant", "content": '{"name": "Maria"}'},
            {"role": "user", "content": "Age? 🎂"},
        ],
    ]
    for messages in conversations:
        for prompt in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=prompt)
            assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.encode_chat(messages, add_generation_prompt=prompt) == theirs.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=prompt, return_dict=False
            )


def test_token_bytes_and_streaming(ours: Tokenizer) -> None:
    text = TEXTS[2] + " " + TEXTS[0]
    ids = ours.encode(text, add_special_tokens=False)
    assert b"".join(ours.token_bytes(i) for i in ids).decode() == text
    detok = IncrementalDetokenizer(ours, ours.encode_chat([{"role": "user", "content": "hi"}]))
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == text
