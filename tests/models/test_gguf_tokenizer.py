"""The tokenizer rebuilt from GGUF metadata (byte-level BPE with each pre-tokenizer, sentencepiece) encodes,
decodes and templates like transformers' own GGUF load of the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFWriter
from gguf_fixtures import sentencepiece_vocab, write_tokenizer_gguf

from structgen.models.gguf_tokenizer import PRE_TOKENIZER_SPLITS

TEXTS = [
    "Maria is 34 years old and lives in Lisbon.",
    "  leading spaces\n\n\ttabs   and   runs of   whitespace   ",
    "unicode: héllo wörld — naïve café 日本語テキスト 🤖🎉 Ελληνικά ﬁ",
    "numbers 1234567890 3.14159 -42 1e10 0x1F 2024-06-01",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll've said DON'T and we'd",
    '{"name": "Maria", "age": 34, "tags": ["a", "b"]}',
    "\r\n\r\n  \n \t",
    "a<|endoftext|>b<think>c</think>",
    "def f(x):\n    return x ** 2  # square\n",
    "",
]


def _tokenizer_pair(gguf_path: Path, tmp_path: Path) -> tuple[Any, Any]:
    """(ours loaded through transformers from the written files, transformers' tokenizer from the GGUF)."""
    from transformers import AutoTokenizer

    from structgen.models.gguf import gguf_metadata, read_gguf
    from structgen.models.gguf_tokenizer import write_tokenizer_files

    out = tmp_path / "tok"
    out.mkdir()
    write_tokenizer_files(gguf_metadata(read_gguf(gguf_path)), out, model_max_length=256)
    ours = AutoTokenizer.from_pretrained(out)
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return ours, reference


@pytest.mark.parametrize("pre", ["smollm", "gpt-2", "qwen2", "llama-bpe", "tekken", "gpt-4o"])
def test_byte_level_tokenizer_encodes_like_transformers(tmp_path: Path, vocab: Any, pre: str) -> None:
    assert pre in PRE_TOKENIZER_SPLITS
    ours, reference = _tokenizer_pair(write_tokenizer_gguf(tmp_path / "t.gguf", vocab, pre=pre), tmp_path)
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids) == text
    assert ours.convert_tokens_to_ids("<|im_end|>") == 2
    assert ours.eos_token == "<|im_end|>" and ours.bos_token == "<|im_start|>"
    # control tokens are special (skipped on request); user-defined ones are whole but ordinary text
    ids = ours("x<|im_end|>y<think>").input_ids
    assert ours.decode(ids, skip_special_tokens=True) == "xy<think>"
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sentencepiece_tokenizer_encodes_like_transformers(tmp_path: Path) -> None:
    tokens, scores, types = sentencepiece_vocab()
    path = tmp_path / "spm.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, reference = _tokenizer_pair(path, tmp_path)
    texts = [
        "hello world",
        "The test and the world!",
        "  hello  world ",
        "héllo 日本 🤖",
        "</s>the<s>",
        "a\nb\tc",
        "",
    ]
    for text in texts:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        assert ids[:1] == [1]  # BOS added, as llama.cpp does for sentencepiece vocabularies
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert "▁hello" in ours.convert_ids_to_tokens(ours("hello").input_ids)
