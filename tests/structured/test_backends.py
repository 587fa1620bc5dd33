"""Each backend on each spec kind it supports: walking a valid output's tokens, every mask allows the next
token; wrong continuations are masked and rejected without changing state; EOS is allowed exactly where the
output may end; rollback restores the state; jump-forward returns the forced tokens, canonically tokenized;
masks cover the padded vocabulary."""

from __future__ import annotations

import importlib.resources
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from shared_data import VLLM_SAMPLES as SAMPLES
from structured_helpers import accepts_text, allowed_tokens, walk

from structgen.structured import StructuredOutputsParams, UnsupportedSchemaError

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
CHOICES = ["Python", "Java", "JavaScript", "C++"]


def _json_complete(schema: dict[str, Any] | None) -> Callable[[str], bool]:
    import jsonschema

    def complete(text: str) -> bool:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        if text != json.dumps(value, separators=(",", ":"), ensure_ascii=False):
            return False  # e.g. "12" is complete JSON but "1" is not the end of "12"... compact form only
        return schema is None or jsonschema.Draft202012Validator(schema).is_valid(value)

    return complete


@dataclass(frozen=True)
class Case:
    name: str
    params: StructuredOutputsParams
    text: str  # a valid output
    complete: Callable[[str], bool]  # may the output end after this prefix?
    bad_prefix: str  # a prefix of `text` ...
    bad_next: str  # ... after which this continuation is invalid


def _cases() -> list[Case]:
    json_lark = importlib.resources.files("structgen.grammars").joinpath("json.lark").read_text()
    sql = (SAMPLES / "sample_sql.ebnf").read_text()
    regex = r"(ab|cd)[0-9]{2,3}"
    return [
        Case("json_schema", StructuredOutputsParams(json=PERSON), '{"name":"Maria","age":34}',
             _json_complete(PERSON), '{"name":"Maria"', "}"),
        Case("json_object", StructuredOutputsParams(json_object=True), '{"a":[1,{"b":null}],"c":"x"}',
             lambda t: _json_complete({"type": "object"})(t), "", "["),
        Case("regex", StructuredOutputsParams(regex=regex), "ab123", lambda t: re.fullmatch(regex, t) is not None,
             "ab", "x"),
        Case("grammar_lark", StructuredOutputsParams(grammar=json_lark), '[1,{"a":"b"}]',
             lambda t: _json_complete(None)(t), "[1", "}"),
        Case("grammar_ebnf", StructuredOutputsParams(grammar=sql), "SELECTcol_1fromtable_1wherecol_2=1",
             lambda t: t == "SELECTcol_1fromtable_1wherecol_2=1", "SELECT", "col_3"),
        Case("choice", StructuredOutputsParams(choice=CHOICES), "JavaScript", lambda t: t in CHOICES, "Java", "Python"),
    ]  # fmt: skip


CASES = {c.name: c for c in _cases()}
SUPPORTED = {
    "llguidance": list(CASES),
    "xgrammar": list(CASES),
    "outlines": ["json_schema", "regex", "choice"],
}
PAIRS = [(b, c) for b, names in SUPPORTED.items() for c in names]


@pytest.mark.parametrize(("backend", "case"), PAIRS)
def test_walk_masks_and_eos(backends, info, encode, tiny_tokenizer, backend: str, case: str) -> None:
    c = CASES[case]
    grammar = backends[backend].compile(c.params.to_spec())
    ids = encode(c.text)
    masks = walk(grammar, ids, info.vocab_size)
    eos = list(info.eos_token_ids)
    for step, allowed in enumerate(masks):
        prefix = tiny_tokenizer.decode(ids[:step])
        assert bool(allowed[eos].all()) == c.complete(prefix), f"EOS after {prefix!r}"
        assert bool(allowed[eos].any()) == c.complete(prefix)
    assert not grammar.is_terminated() or grammar.find_jump_forward() == []
    assert grammar.accept_tokens([eos[0]])
    assert grammar.is_terminated()


@pytest.mark.parametrize(("backend", "case"), PAIRS)
def test_invalid_continuation_is_masked_and_rejected(backends, info, encode, backend: str, case: str) -> None:
    c = CASES[case]
    assert c.text.startswith(c.bad_prefix)
    grammar = backends[backend].compile(c.params.to_spec())
    assert grammar.accept_tokens(encode(c.bad_prefix))
    before = allowed_tokens(grammar, info.vocab_size)
    bad = encode(c.bad_next)
    n = grammar.validate_tokens(bad)
    assert n < len(bad)
    probe = grammar.clone()
    assert probe.accept_tokens(bad[:n])
    assert not allowed_tokens(probe, info.vocab_size)[bad[n]], "the first wrong token is not masked"
    assert not grammar.accept_tokens(bad)
    assert torch.equal(allowed_tokens(grammar, info.vocab_size), before), "a rejected token changed the state"


@pytest.mark.parametrize(("backend", "case"), PAIRS)
def test_accept_is_all_or_nothing(backends, info, encode, tiny_tokenizer, backend: str, case: str) -> None:
    c = CASES[case]
    grammar = backends[backend].compile(c.params.to_spec())
    initial = allowed_tokens(grammar, info.vocab_size)
    im_start = tiny_tokenizer.token_to_id("<|im_start|>")
    assert not grammar.accept_tokens([*encode(c.text)[:1], im_start])
    assert torch.equal(allowed_tokens(grammar, info.vocab_size), initial)
    assert grammar.validate_tokens([*encode(c.text)[:1], im_start]) == 1
    assert torch.equal(allowed_tokens(grammar, info.vocab_size), initial)


@pytest.mark.parametrize(("backend", "case"), PAIRS)
def test_rollback_restores_state(backends, info, encode, backend: str, case: str) -> None:
    c = CASES[case]
    grammar = backends[backend].compile(c.params.to_spec())
    ids = encode(c.text)
    masks = walk(grammar, ids, info.vocab_size)
    ended = grammar.is_terminated()  # llguidance: nothing but EOS can follow; the others: EOS not seen yet
    assert grammar.accept_tokens([info.eos_token_ids[0]])
    assert grammar.is_terminated()
    grammar.rollback(1)  # EOS
    assert grammar.is_terminated() == ended
    assert torch.equal(allowed_tokens(grammar, info.vocab_size), masks[-1])
    for k in (1, len(ids) - 1, len(ids)):
        g = grammar.clone()
        g.rollback(k)
        assert torch.equal(allowed_tokens(g, info.vocab_size), masks[len(ids) - k]), f"rollback({k})"
        assert g.accept_tokens(ids[len(ids) - k :])
    grammar.reset()
    assert torch.equal(allowed_tokens(grammar, info.vocab_size), masks[0])


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_jump_forward_after_open_brace(backends, info, encode, tiny_tokenizer, backend: str) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}  # fmt: skip
    grammar = backends[backend].compile(StructuredOutputsParams(json=schema).to_spec())
    assert '{"name":"'.startswith(tiny_tokenizer.decode(grammar.find_jump_forward()))
    assert grammar.accept_tokens(encode("{"))
    forced = grammar.find_jump_forward()
    text = tiny_tokenizer.decode(forced)
    assert forced and '"name":"'.startswith(text), text
    assert forced == encode(text), "not canonically tokenized"
    assert grammar.accept_tokens(forced)
    rest = encode('"name":"Maria"}'[len(text) :])
    assert grammar.accept_tokens(rest) and grammar.accept_tokens([info.eos_token_ids[0]])
    assert grammar.is_terminated()


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines"])
def test_jump_forward_tokens_are_forced(backends, info, encode, backend: str) -> None:
    """Whatever a backend offers as jump-forward, each token is the only one its grammar allows."""
    grammar = backends[backend].compile(StructuredOutputsParams(regex=r"id-(x|y)[0-9]").to_spec())
    assert grammar.accept_tokens(encode("id-x"))
    for _ in range(2):
        forced = grammar.find_jump_forward()
        for t in forced:
            allowed = allowed_tokens(grammar, info.vocab_size)
            assert allowed[t]
            assert grammar.accept_tokens([t])


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines"])
def test_masks_cover_the_padded_vocabulary(backends, info, model_vocab_size, backend: str) -> None:
    assert model_vocab_size > info.num_tokens  # the tiny model pads cl100k's 100,277 ids
    grammar = backends[backend].compile(StructuredOutputsParams(regex=r".*").to_spec())
    allowed = allowed_tokens(grammar, info.vocab_size)
    assert allowed.numel() == model_vocab_size
    assert not allowed[info.num_tokens :].any(), "padding rows of the embedding must always be masked"
    never = sorted(info.special_token_ids - set(info.eos_token_ids))
    assert not allowed[never].any(), "special tokens are never part of a grammar's output"
    assert allowed[list(info.eos_token_ids)].all()  # `.*` matches the empty string
    assert allowed.sum() > 90_000  # and nearly every ordinary token


def test_unsupported_kind_is_refused(backends) -> None:
    with pytest.raises(UnsupportedSchemaError, match="grammar specs are not supported"):
        backends["outlines"].compile(StructuredOutputsParams(grammar="start: /a+/").to_spec())


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines"])
def test_clone_is_independent(backends, info, encode, backend: str) -> None:
    grammar = backends[backend].compile(StructuredOutputsParams(choice=CHOICES).to_spec())
    copy = grammar.clone()
    assert copy.accept_tokens(encode("Java"))
    fresh = allowed_tokens(grammar, info.vocab_size)
    assert not torch.equal(fresh, allowed_tokens(copy, info.vocab_size))
    assert grammar.accept_tokens(encode("Python"))
    assert not copy.accept_tokens(encode("Python"))


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines"])
def test_flexible_whitespace_is_bounded(backends, info, encode, backend: str) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    eos = info.eos_token_ids[0]
    compact = backends[backend].compile(StructuredOutputsParams(json=schema).to_spec())
    flexible = backends[backend].compile(
        StructuredOutputsParams(json=schema, whitespace="flexible", max_whitespace=2).to_spec()
    )
    assert accepts_text(compact, encode('{"a":1}'), eos)
    assert not accepts_text(compact, encode('{ "a": 1}'), eos)  # compact: no whitespace at all
    assert accepts_text(flexible, encode('{ "a": 1}'), eos)
    assert not accepts_text(flexible, encode('{"a":   1}'), eos)  # more than 2 in one gap: never loops
