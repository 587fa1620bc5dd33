"""Builders of tokenizer directories for the tests: the tiny model's cl100k tokenizer (byte-level BPE) and a small
sentencepiece-style tokenizer with byte fallback (Llama 2 layout), both made offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Training text for the sentencepiece-style tokenizer: ASCII only, so every CJK character and emoji has to go
# through `<0xNN>` byte-fallback tokens, one token per UTF-8 byte.
_SP_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
    "Structured outputs make every answer of a language model follow a schema, such as a JSON object.",
    "Tokens are pieces of words; a tokenizer turns text into tokens and a detokenizer turns them back.",
    "She said: 'Hello there!' and he answered, \"How are you doing today?\" (quite well, thanks).",
    "Numbers like 12, 345 and 6789 appear in the text, as do symbols such as {, }, [, ], :, and ,.",
    "def main():\n    return {'name': 'Maria', 'age': 34, 'city': 'Lisbon'}\n",
    "In the morning the weather was sunny, in the evening it rained and the streets were wet.",
]

# A Llama-2-style template: it writes the BOS token itself and raises on a bad role order.
SP_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + eos_token }}{% endif %}"
    "{% endfor %}"
)


def build_sentencepiece_style_tokenizer(
    out_dir: Path, *, tokenizer_config: dict[str, Any] | None = None
) -> Path:
    """A byte-fallback BPE over `▁`-marked spaces with the Llama 2 pipeline, trained on `_SP_CORPUS`."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, processors, trainers

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_backend = Backend(models.BPE(unk_token="<unk>"))
    trainer_backend.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=["<unk>"])
    trainer_backend.train_from_iterator(_SP_CORPUS, trainer=trainer)
    trained = json.loads(trainer_backend.to_str())["model"]

    # Llama 2 layout: <unk> <s> </s>, then the 256 byte tokens, then the learned pieces.
    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]

    backend = Backend(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.normalizer = normalizer
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)]
    )
    from tokenizers import AddedToken

    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")]
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    backend.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": SP_CHAT_TEMPLATE,
    }
    config.update(tokenizer_config or {})
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out_dir
