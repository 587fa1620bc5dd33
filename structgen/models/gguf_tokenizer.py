"""A GGUF file's tokenizer metadata -> `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`.

GGUF stores the vocabulary, merges, token types and special ids under llama.cpp's keys, plus a name for the
pre-tokenizer (`tokenizer.ggml.pre`) whose split regex is hard-coded in llama.cpp. We rebuild the HF `tokenizers`
pipeline each vocabulary was trained with:

- `gpt2` (byte-level BPE): the file's vocab and merges, the split regex named by `tokenizer.ggml.pre`, byte-level
  decoding. Control tokens become special added tokens, user-defined ones plain added tokens.
- `llama` (sentencepiece BPE, Llama 2 / Mistral): merges recovered from the piece scores, Metaspace
  pre-tokenization, byte fallback.

Encodings match transformers' own GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) with two
deliberate exceptions, both following llama.cpp and the model's original `tokenizer.json`: llama3-style
vocabularies keep `ignore_merges`, and control tokens spelled outside the byte alphabet (DeepSeek's
`<｜begin▁of▁sentence｜>`) stay special instead of being split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structgen.errors import ModelLoadError
from structgen.tokenizer.token_bytes import byte_alphabet

# llama.cpp token types (`tokenizer.ggml.token_type`).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class _Split:
    regex: str | None = None  # None: GPT-2's split, built into the ByteLevel pre-tokenizer
    digits_first: bool = False  # split every digit apart before the regex (StarCoder / SmolLM vocabularies)
    ignore_merges: bool = False  # a word that is itself a token is not re-merged (llama.cpp: llama3 only)


_GPT2 = _Split()
# `tokenizer.ggml.pre` -> the split llama.cpp applies for it (llama-vocab.cpp), spelled as in the HF originals.
PRE_TOKENIZER_SPLITS: dict[str, _Split] = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "jais": _GPT2,
    "phi-2": _GPT2,
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        _Split(digits_first=True),
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3"),
        _Split(_LLAMA3_SPLIT, ignore_merges=True),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), _Split(_QWEN2_SPLIT)),
    "tekken": _Split(_TEKKEN_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _Split(_GPT4O_SPLIT)),
}


@dataclass(frozen=True, slots=True)
class SpecialTokenIds:
    bos: int | None
    eos: int | None
    pad: int | None
    unk: int | None
    eos_ids: list[int]  # every id that ends a generation: eos, end-of-turn, end-of-message


def special_token_ids(metadata: dict[str, Any]) -> SpecialTokenIds:
    def get(name: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if value is not None else None

    eos_ids = [i for i in (get("eos"), get("eot"), get("eom")) if i is not None]
    return SpecialTokenIds(
        bos=get("bos"),
        eos=get("eos"),
        pad=get("padding"),
        unk=get("unknown"),
        eos_ids=list(dict.fromkeys(eos_ids)),
    )


def build_tokenizer(metadata: dict[str, Any]) -> Any:
    """The `tokenizers.Tokenizer` a GGUF's metadata describes."""
    model = metadata.get("tokenizer.ggml.model")
    tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens; the file carries no tokenizer")
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if model == "gpt2":
        tokenizer = _byte_level_bpe(metadata, tokens, types)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(metadata, tokens, types)
    else:
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is not supported (gpt2 byte-level BPE and llama are)"
        )
    _add_special_tokens(tokenizer, tokens, types)
    tokenizer.post_processor = _post_processor(metadata, tokens, byte_level=model == "gpt2")
    return tokenizer


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = metadata.get("tokenizer.ggml.pre", "default")
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, types, strict=True)):
        if token_type not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            # A few converters store raw text for some tokens; the BPE model only sees byte-alphabet spellings.
            token = "".join(spelling[byte] for byte in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = [_merge_pair(merge) for merge in metadata.get("tokenizer.ggml.merges") or []]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=split.ignore_merges
        )
    )
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split.digits_first else []
    if split.regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [
            pre_tokenizers.Split(Regex(split.regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right or " " in right:
        raise ModelLoadError(f"GGUF merge {merge!r} is not two space-separated pieces")
    return left, right


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    if merges_field := metadata.get("tokenizer.ggml.merges"):
        merges = [_merge_pair(merge) for merge in merges_field]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None:
            raise ModelLoadError(
                "sentencepiece GGUF has neither tokenizer.ggml.merges nor tokenizer.ggml.scores"
            )
        merges = _merges_from_scores(tokens, scores, vocab)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(
    tokens: list[str], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Sentencepiece BPE keeps no merge list: every split of a piece into two pieces is a merge, ranked by the
    merged piece's score (then longer left, longer right, then piece ids: the order HF's converters use)."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        pairs = [
            (token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((-float(score), -len(left), -len(right), left, right) for left, right in pairs)
    ranked.sort(key=lambda entry: entry[:3])  # stable: ties keep the per-token id order above
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(tokenizer: Any, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    special = [
        AddedToken(token, special=True, normalized=False)
        for token, token_type in zip(tokens, types, strict=True)
        if token_type == _CONTROL
    ]
    # llama.cpp matches user-defined tokens (`<think>`, ...) whole in any text, so they must not be split.
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, token_type in zip(tokens, types, strict=True)
        if token_type == _USER_DEFINED
    ]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)


def _post_processor(metadata: dict[str, Any], tokens: list[str], *, byte_level: bool) -> Any:
    from tokenizers import processors

    ids = special_token_ids(metadata)
    # llama.cpp adds BOS to sentencepiece vocabularies that do not say otherwise.
    default_bos = metadata.get("tokenizer.ggml.model") == "llama"
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos)) and ids.bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and ids.eos is not None
    if not (add_bos or add_eos):
        return processors.ByteLevel(trim_offsets=False) if byte_level else None
    prefix = [tokens[ids.bos]] if add_bos else []
    suffix = [tokens[ids.eos]] if add_eos else []
    special = [
        (tokens[i], i)
        for i in dict.fromkeys([*([ids.bos] if add_bos else []), *([ids.eos] if add_eos else [])])
    ]
    return processors.TemplateProcessing(
        single=[*prefix, "$A", *suffix],
        pair=[*prefix, "$A", *suffix, *prefix, "$B:1", *suffix],
        special_tokens=special,
    )


def write_tokenizer_files(metadata: dict[str, Any], out_dir: Path, *, model_max_length: int) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and (when the file has one) `chat_template.jinja`."""
    tokenizer = build_tokenizer(metadata)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    ids = special_token_ids(metadata)

    def token(index: int | None) -> str | None:
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    default_bos = metadata.get("tokenizer.ggml.model") == "llama"
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(ids.bos),
        "eos_token": token(ids.eos),
        "unk_token": token(ids.unk),
        "pad_token": token(ids.pad),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if template := metadata.get("tokenizer.chat_template"):
        config["chat_template"] = template
        (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    text = json.dumps({k: v for k, v in config.items() if v is not None}, indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
