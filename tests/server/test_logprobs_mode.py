"""`structgen serve --logprobs-mode processed_logprobs` through HTTP: each token's logprobs are those of the
distribution it was drawn from, so under `top_k` the listed alternatives are the only possible tokens and their
probabilities add up to one; under a grammar, only tokens the grammar allows are listed."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from server_helpers import KEY, USER, call, tiny_engine

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app


@pytest.fixture(scope="module")
def processed_engine() -> Iterator[AsyncEngine]:
    engine = tiny_engine(logprobs_mode="processed_logprobs")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def app(processed_engine: AsyncEngine) -> Any:
    return build_app(processed_engine, processed_engine.engine.tokenizer, model_name="tiny", api_key=KEY)


def test_top_k_alternatives_are_the_whole_distribution(app: Any) -> None:
    body = {
        "messages": USER,
        "max_tokens": 6,
        "ignore_eos": True,
        "temperature": 0.8,
        "top_k": 3,
        "seed": 11,
        "logprobs": True,
        "top_logprobs": 5,
    }
    response = call(app, "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    for entry in content:
        alternatives = {alt["token"]: alt["logprob"] for alt in entry["top_logprobs"]}
        # top_k = 3: the other two asked for cannot be drawn, unless they tie with the third (a threshold
        # keeps ties, as vLLM's does; bf16 logits tie often)
        ranked = sorted(alternatives.values(), reverse=True)
        assert ranked and all(v == ranked[2] for v in ranked[3:])
        assert sum(math.exp(v) for v in alternatives.values()) == pytest.approx(1.0, abs=1e-4)
        assert alternatives[entry["token"]] == pytest.approx(entry["logprob"], abs=1e-6)


def test_a_grammar_lists_only_what_it_allows(app: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    body = {
        "messages": USER,
        "max_tokens": 20,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 20,
        "response_format": {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}},
    }
    response = call(app, "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert isinstance(json.loads(choice["message"]["content"])["ok"], bool)
    drawn = [entry for entry in choice["logprobs"]["content"] if entry["top_logprobs"]]
    assert drawn  # the boolean, at least, is drawn
    for entry in choice["logprobs"]["content"]:
        if not entry["top_logprobs"]:  # forced by the grammar (jump-forward): certain, nothing else possible
            assert entry["logprob"] == 0.0
            continue
        total = sum(math.exp(alt["logprob"]) for alt in entry["top_logprobs"])
        # where the grammar allows fewer than 20 tokens, all are listed and carry all the probability
        assert len(entry["top_logprobs"]) < 20 and total == pytest.approx(1.0, abs=1e-4)
