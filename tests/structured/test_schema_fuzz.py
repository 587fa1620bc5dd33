"""Fuzzing the structured layer with hypothesis-generated JSON Schemas over the supported keyword set.

Each schema either compiles (`auto`) and every output its grammar can produce validates with `jsonschema`
(format checking on) — checked without a model by random walks that pick uniformly among the tokens the
mask allows, leaning toward closing after a few steps — or it is refused with an error that names a keyword
or a JSON path. Outputs of a relaxed grammar are validated (and retried) by the engine, so only exact and
rewritten serving paths must never produce an invalid output.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from structgen.structured import (
    InvalidSpecError,
    StructuredOutputConfig,
    StructuredOutputManager,
    StructuredOutputsParams,
    TokenizerInfo,
    UnsupportedSchemaError,
    allocate_token_bitmask,
)
from structgen.structured.bitmask import unpack_bitmask
from structgen.structured.validate import FORMAT_CHECKER

WALKS = 3
CLOSE_AFTER = 12  # steps before the walk leans toward ending the output
MAX_STEPS = 64
_CLOSERS = frozenset(b'"}]')

# -- the schema strategy -------------------------------------------------------------------------------------

names = st.sampled_from(["a", "b", "id", "name", "x_1", "ü"])
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-50, 50), st.sampled_from(["", "a", "red", "x y", "é"])
)
small = st.integers(0, 4)


def _with(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    return {**base, **{k: v for k, v in extra.items() if v is not None}}


strings = st.builds(
    _with,
    st.just({"type": "string"}),
    st.fixed_dictionaries(
        {},
        optional={
            "minLength": small,
            "maxLength": st.integers(0, 6),
            "pattern": st.sampled_from(["^[a-z]+$", "^[0-9]{2,4}$", "^(ab|cd)*$", "a", "^\\w+@x\\.org$"]),
            "format": st.sampled_from(["date", "email", "uuid", "ipv4", "date-time", "time"]),
        },
    ),
)
numbers = st.builds(
    _with,
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])}),
    st.fixed_dictionaries(
        {},
        optional={
            "minimum": st.integers(-20, 20),
            "maximum": st.integers(-20, 40),
            "exclusiveMinimum": st.integers(-30, 10),
            "exclusiveMaximum": st.integers(0, 50),
            "multipleOf": st.sampled_from([1, 2, 5]),
        },
    ),
)
leaves = st.one_of(
    strings,
    numbers,
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {}, {"$ref": "#/$defs/shared"}]),
    st.builds(lambda v: {"enum": v}, st.lists(scalars, min_size=1, max_size=4, unique_by=json.dumps)),
    st.builds(lambda v: {"const": v}, scalars),
    st.builds(
        lambda t: {"type": t},
        st.lists(st.sampled_from(["string", "integer", "null"]), min_size=1, max_size=2, unique=True),
    ),
)


def _object(props: dict[str, Any], data: Any) -> dict[str, Any]:
    required = data.draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
    extra = data.draw(st.sampled_from([None, False, True, {"type": "integer"}]))
    node: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        node["required"] = required
    if extra is not None:
        node["additionalProperties"] = extra
    return node


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(_object, st.dictionaries(names, children, max_size=3), st.data()),
        st.builds(
            _with,
            st.fixed_dictionaries({"type": st.just("array"), "items": children}),
            st.fixed_dictionaries(
                {}, optional={"minItems": st.integers(0, 2), "maxItems": st.integers(0, 3)}
            ),
        ),
        st.builds(
            lambda prefix, rest: {"type": "array", "prefixItems": prefix, "items": rest},
            st.lists(children, min_size=1, max_size=2),
            st.sampled_from([False, {"type": "boolean"}]),
        ),
        st.builds(
            lambda kw, branches: {kw: branches},
            st.sampled_from(["anyOf", "oneOf", "allOf"]),
            st.lists(children, min_size=1, max_size=3),
        ),
    )


schemas = st.builds(
    lambda body, shared: {"$defs": {"shared": shared}, **body} if isinstance(body, dict) else body,
    st.recursive(leaves, containers, max_leaves=6),
    st.one_of(strings, numbers, st.just({"type": "boolean"})),
)

# -- walking a grammar ------------------------------------------------------------------------------------


def random_outputs(grammar: Any, info: TokenizerInfo, rng: random.Random) -> list[bytes]:
    """Outputs of random walks through `grammar` that ended (EOS allowed and taken) within MAX_STEPS."""
    eos_ids = set(info.eos_token_ids)
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    outputs = []
    for _ in range(WALKS):
        g = grammar.clone()
        out = b""
        for step in range(MAX_STEPS):
            g.fill_bitmask(bitmask, 0)
            allowed = (
                unpack_bitmask(bitmask[0], info.vocab_size)[: info.num_tokens].nonzero().flatten().tolist()
            )
            assert allowed, f"the mask allows nothing after {out!r}"
            choices = [t for t in allowed if t not in eos_ids]
            ends = len(choices) < len(allowed)
            if ends and (step >= CLOSE_AFTER or not choices or rng.random() < 0.2):
                assert g.accept_tokens([next(t for t in allowed if t in eos_ids)])
                outputs.append(out)
                break
            if step >= CLOSE_AFTER:
                closing = [t for t in choices if info.vocab[t] and set(info.vocab[t]) <= _CLOSERS]
                short = [t for t in choices if len(info.vocab[t]) == 1]
                choices = closing or (short if short and rng.random() < 0.8 else choices)
            token = rng.choice(choices)
            assert g.accept_tokens([token]), f"the mask allowed token {token} that the matcher refuses"
            out += info.vocab[token]
    return outputs


@pytest.fixture(scope="module")
def manager(info: TokenizerInfo) -> StructuredOutputManager:
    return StructuredOutputManager(info, StructuredOutputConfig(compile_timeout_s=20.0))


def check_schema(schema: Any, manager: StructuredOutputManager, rng: random.Random) -> int:
    """Compile and walk `schema`; returns how many walks ended (all validated)."""
    try:
        spec = StructuredOutputsParams(json=schema).to_spec()
        compiled = manager.compile(spec)
    except (UnsupportedSchemaError, InvalidSpecError) as error:
        assert getattr(error, "keyword", None) or getattr(error, "path", None) or "keyword" in str(error), (
            error
        )
        return 0
    outputs = random_outputs(compiled.prototype, manager.tokenizer, rng)
    if compiled.serving_path == "relaxed":
        return 0  # the engine validates and retries these; the grammar itself is allowed to be looser
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=FORMAT_CHECKER)
    for raw in outputs:
        text = raw.decode("utf-8")
        instance = json.loads(text)
        errors = [e.message for e in validator.iter_errors(instance)]
        assert not errors, f"{compiled.backend} ({compiled.serving_path}) produced {text!r}: {errors}"
    return len(outputs)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: its time is unbounded; the example is printed
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(schema=schemas, seed=st.integers(0, 2**32 - 1))
def test_every_walk_of_a_compiled_schema_validates(
    schema: dict[str, Any], seed: int, manager: StructuredOutputManager
) -> None:
    check_schema(schema, manager, random.Random(seed))


@pytest.mark.parametrize(
    "schema",
    [
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
            "required": ["a"],
        },
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 3}]},
    ],
)
def test_walks_end_and_validate(schema: dict[str, Any], manager: StructuredOutputManager) -> None:
    """The walker itself works: on easy schemas most walks end, and each ended output validates."""
    ended = sum(check_schema(schema, manager, random.Random(i)) for i in range(4))
    assert ended >= 2 * WALKS


def test_refusals_name_a_keyword(manager: StructuredOutputManager) -> None:
    refused = [
        {"type": "object", "properties": {f"p{i}": {} for i in range(1001)}},
        {"enum": list(range(10_001))},
        {"$ref": "#/$defs/missing"},
        {"not": {"type": "string"}, "type": "string"},
    ]
    for schema in refused:
        with pytest.raises(UnsupportedSchemaError) as info:
            manager.compile(StructuredOutputsParams(json=schema).to_spec())
        assert info.value.keyword in ("properties", "enum", "$ref", "allOf"), info.value
        assert info.value.path == "#"


def test_bitmask_row_helper_matches_the_walker(info: TokenizerInfo) -> None:
    # `unpack_bitmask` is what the walker trusts: an all-allowed row unpacks to every token.
    row = allocate_token_bitmask(1, info.vocab_size)[0]
    assert unpack_bitmask(row, info.vocab_size).all()
    assert torch.count_nonzero(row) == row.numel()
