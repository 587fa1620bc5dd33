"""A Hugging Face tokenizer directory read with the `tokenizers` library directly.

transformers takes seconds to import, and the engine only needs encode / decode / the chat template, so this
reads the files itself: `tokenizer.json` (the whole pipeline), `tokenizer_config.json` (named special tokens,
extra added tokens, `add_bos_token`, `chat_template`), `chat_template.jinja` and `chat_templates/*.jinja` (as
current transformers saves them; they win over the config's template), `generation_config.json` (EOS ids)
and `config.json` (EOS fallback). Encoding and chat rendering match `AutoTokenizer.from_pretrained(dir)`.

BOS/EOS insertion follows `tokenizer.json`'s post-processor, as transformers' generic fast tokenizer does;
only when the file has none do `add_bos_token` / `add_eos_token` from the config take effect.
`clean_up_tokenization_spaces` is ignored: transformers itself skips it for BPE models, and it would make
streamed text differ from the final text.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from structgen.errors import ModelLoadError
from structgen.tokenizer.chat_template import ChatTemplate, select_template
from structgen.tokenizer.token_bytes import Spelling, build_token_bytes, detect_spelling

# The named special tokens transformers passes to chat templates (`bos_token`, ... as strings).
SPECIAL_TOKEN_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ModelLoadError(f"{where} must be a string or an AddedToken dict with 'content', got {value!r}")


def _int_list(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelLoadError(f"{where} must be an int or a list of ints, got {value!r}")
    return values


def _read_chat_templates(model_dir: Path, config: Mapping[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and "template" in entry):
                raise ModelLoadError(
                    f"tokenizer_config.json chat_template list entry {entry!r} lacks name/template"
                )
            templates[entry["name"]] = entry["template"]
    elif raw is not None:
        raise ModelLoadError(
            "tokenizer_config.json chat_template must be a string or a list of named templates"
        )
    # Files written by current transformers take priority over templates in the config, as there.
    files: dict[str, str] = {}
    if (model_dir / "chat_template.jinja").is_file():
        files["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if (model_dir / "chat_templates").is_dir():
        for path in sorted((model_dir / "chat_templates").glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    return files or templates


class Tokenizer:
    """Encode, decode, chat templates and token bytes over one `tokenizers.Tokenizer`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        name_or_path: str = "",
    ) -> None:
        self._backend = backend
        self.name_or_path = name_or_path
        self.special_tokens: dict[str, str] = {
            k: v for k, v in (special_tokens or {}).items() if v is not None
        }
        self._chat_templates = dict(chat_templates or {})
        self._compiled: dict[str, ChatTemplate] = {}

        vocab = backend.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        added = backend.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        special_ids = {token_id for token_id, token in added.items() if token.special}
        for content in self.special_tokens.values():
            if (token_id := backend.token_to_id(content)) is not None:
                special_ids.add(token_id)
        self._all_special_ids = frozenset(special_ids)

        if backend.post_processor is None and (add_bos_token or add_eos_token):
            self._install_post_processor(bool(add_bos_token), bool(add_eos_token))
        self.bos_token_id = self._special_id("bos_token")
        self.pad_token_id = self._special_id("pad_token")
        eos = {*eos_token_ids}
        if (eos_id := self._special_id("eos_token")) is not None:
            eos.add(eos_id)
        for token_id in eos:
            if not 0 <= token_id < self._vocab_size:
                raise ModelLoadError(
                    f"EOS token id {token_id} is outside the vocabulary (size {self._vocab_size})"
                )
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._token_bytes: list[bytes] | None = None

    # -- loading -------------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelLoadError(f"tokenizer directory {model_dir} does not exist")
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{model_dir} has no tokenizer.json; structgen reads fast-tokenizer files only "
                "(write one with transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises plain Exception on a malformed pipeline
            raise ModelLoadError(f"{tokenizer_file} is not a valid tokenizers file: {exc}") from exc

        config_path = model_dir / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        special = {
            attr: _token_content(config.get(attr), f"tokenizer_config.json {attr}")
            for attr in SPECIAL_TOKEN_ATTRIBUTES
        }
        _add_missing_tokens(backend, config, special)

        generation = model_dir / "generation_config.json"
        model_config = model_dir / "config.json"
        eos_ids: list[int] = []
        if generation.is_file():
            eos_ids = _int_list(
                _read_json(generation).get("eos_token_id"), "generation_config.json eos_token_id"
            )
        if not eos_ids and model_config.is_file():
            eos_ids = _int_list(_read_json(model_config).get("eos_token_id"), "config.json eos_token_id")

        return cls(
            backend,
            special_tokens={k: v for k, v in special.items() if v is not None},
            chat_templates=_read_chat_templates(model_dir, config),
            eos_token_ids=eos_ids,
            add_bos_token=config.get("add_bos_token"),
            add_eos_token=config.get("add_eos_token"),
            name_or_path=str(model_dir),
        )

    def _install_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        def wanted(attr: str, flag: bool) -> list[str]:
            token = self.special_tokens.get(attr) if flag else None
            return [] if token is None or self._backend.token_to_id(token) is None else [token]

        bos, eos = wanted("bos_token", add_bos), wanted("eos_token", add_eos)
        single = [*bos, "$A", *eos]
        pair = [*single, *bos, "$B:1", *eos]
        special = {token: self._backend.token_to_id(token) for token in (*bos, *eos)}
        self._backend.post_processor = tokenizers.processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=list(special.items())
        )

    def _special_id(self, attr: str) -> int | None:
        token = self.special_tokens.get(attr)
        return None if token is None else self._backend.token_to_id(token)

    # -- encode / decode -----------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        ids = [operator.index(token_id) for token_id in ids]
        for token_id in ids:
            if not 0 <= token_id < self._vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {self._vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat ----------------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The template used without tools (None if the tokenizer has none)."""
        try:
            return select_template(self._chat_templates, name=None, tools=None)
        except ValueError:
            return None

    def apply_chat_template(
        self,
        messages: Iterable[Any],
        *,
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text. `chat_template` is a template name or a template text."""
        if chat_template is not None and chat_template not in self._chat_templates:
            source = chat_template
        else:
            source = select_template(self._chat_templates, name=chat_template, tools=tools)
        if (template := self._compiled.get(source)) is None:
            template = self._compiled[source] = ChatTemplate(source)
        return template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self.special_tokens,
            **template_kwargs,
        )

    def encode_chat(
        self,
        messages: Iterable[Any],
        *,
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation. The template writes any BOS itself, so none is added here
        (as transformers' `apply_chat_template(tokenize=True)`)."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    # -- vocabulary ----------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids (largest id + 1, added tokens included); the model's embedding may be larger."""
        return self._vocab_size

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own EOS token (`eos_token_ids` also holds the generation config's)."""
        return self._special_id("eos_token")

    @property
    def token_spelling(self) -> Spelling:
        """How the vocabulary spells bytes: 'byte_level', 'sentencepiece' (▁ and <0xNN>) or 'plain'."""
        return detect_spelling(_pipeline_spec(self._backend))[0]

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Added tokens flagged special (what `skip_special_tokens` drops) and the named ones (bos, eos, pad...)."""
        return self._all_special_ids

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    def id_to_token(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id) if 0 <= token_id < self._vocab_size else None
        if token is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary (size {self._vocab_size})")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token `token_id` stands for (an added token: its text in UTF-8)."""
        table = self.all_token_bytes()
        if not 0 <= token_id < len(table):
            raise ValueError(f"token id {token_id} is not in the vocabulary (size {self._vocab_size})")
        return table[token_id]

    def all_token_bytes(self) -> list[bytes]:
        """`token_bytes` of every id, indexed by id; built once (ids the vocabulary skips give b"")."""
        if self._token_bytes is None:
            id_to_token = [self._backend.id_to_token(i) for i in range(self._vocab_size)]
            self._token_bytes = build_token_bytes(_pipeline_spec(self._backend), id_to_token, self._added_ids)
        return self._token_bytes

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self._vocab_size})"


def _add_missing_tokens(
    backend: tokenizers.Tokenizer, config: Mapping[str, Any], special: Mapping[str, str | None]
) -> None:
    """Add tokens the config declares but `tokenizer.json` lacks, as transformers does on load."""
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    declared = config.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict):
        raise ModelLoadError("tokenizer_config.json added_tokens_decoder must be an object of id -> token")
    for token_id, entry in sorted(declared.items(), key=lambda item: int(item[0])):
        content = _token_content(entry, f"tokenizer_config.json added_tokens_decoder[{token_id}]")
        if content is not None and content not in present:
            flags = entry if isinstance(entry, dict) else {}
            special_flag = bool(flags.get("special", True))
            backend.add_tokens(
                [
                    tokenizers.AddedToken(
                        content,
                        special=special_flag,
                        normalized=bool(flags.get("normalized", not special_flag)),
                        lstrip=bool(flags.get("lstrip", False)),
                        rstrip=bool(flags.get("rstrip", False)),
                        single_word=bool(flags.get("single_word", False)),
                    )
                ]
            )
            present.add(content)
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra, dict):
        extra = list(extra.values())
    named = [v for v in special.values() if v is not None]
    for value in [*named, *extra]:
        content = _token_content(value, "tokenizer_config.json special token")
        if content is not None and content not in present:
            backend.add_special_tokens([tokenizers.AddedToken(content, special=True, normalized=False)])
            present.add(content)


def _pipeline_spec(backend: tokenizers.Tokenizer) -> dict[str, Any]:
    """The parts of `tokenizer.json` that decide how tokens are spelled, without serializing the vocabulary."""
    decoder = backend.decoder
    return {
        "decoder": json.loads(decoder.__getstate__()) if decoder is not None else None,
        "model": {"byte_fallback": bool(getattr(backend.model, "byte_fallback", False))},
    }
