"""The premise of deferred mask rows (`TokenMask.unfilled`): llguidance's one-token `validate_tokens` agrees
with its filled bitmask, in every state of a walk through real schemas."""

from __future__ import annotations

import json
import random

from shared_data import JSONSCHEMABENCH
from structured_helpers import allowed_tokens

from structgen.structured import StructuredOutputsParams


def test_token_checks_agree_with_the_filled_mask(backends, info) -> None:
    backend = backends["llguidance"]
    schemas = [
        {"type": "object", "properties": {"text": {"type": "string", "minLength": 5}}, "required": ["text"]},
        {"type": "array", "items": {"enum": ["x", "y", 3]}, "minItems": 2},
    ]
    with (JSONSCHEMABENCH / "Github_easy.jsonl").open() as f:
        schemas += [json.loads(line)["schema"] for _, line in zip(range(4), f, strict=False)]
    rng = random.Random(0)
    checked = 0
    for schema in schemas:
        grammar = backend.compile(StructuredOutputsParams(json=schema).to_spec())
        assert grammar.checks_tokens_cheaply
        for _ in range(12):
            allowed = allowed_tokens(grammar, info.vocab_size)
            ids = allowed.nonzero().flatten().tolist()
            if not ids:
                break
            tokens = [rng.randrange(info.vocab_size) for _ in range(60)] + rng.sample(ids, min(40, len(ids)))
            for token in tokens:
                assert (grammar.validate_tokens([token]) == 1) == bool(allowed[token]), (schema, token)
                checked += 1
            assert grammar.accept_tokens([rng.choice(ids)])
            if grammar.is_terminated():
                break
    assert checked > 2000
