"""The budget closer: it takes its fallback exactly when a token would leave too little room, looks rarely (or
never) once an output is out of reach, and follows the model writing its completion (its reuse of older
completions: `test_plan_reuse.py`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from closer_helpers import Stepper, count_walks
from structured_helpers import compile_schema

from structgen.structured import StructuredBackend
from structgen.structured.closing import ByteTokens


def test_closer_takes_the_fallback_only_when_a_token_would_not_leave_room(
    backends: dict[str, StructuredBackend], encode: Callable[[str], list[int]], byte_tokens: ByteTokens
) -> None:
    run = Stepper(backends["llguidance"], byte_tokens)
    run.feed(encode('{"s":"'))
    # Plenty of room: the step passes and the completion ('"}') is known.
    assert run.step(encode("hello"), 10)
    plan = run.closer.plan
    assert plan is not None and byte_tokens.text(list(plan)) == b'"}'
    # A token after which the completion no longer fits: the step fails and the fallback is the one above.
    assert not run.step(encode(" world"), len(plan) - 1)
    assert run.closer.fallback == plan


def test_closer_looks_rarely_once_the_output_is_out_of_reach(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An output whose shortest end is past the budget (40 items at least, 60 tokens left) cannot come back
    within it, so the closer neither walks at every token nor asks for a fallback it cannot have."""
    items = {
        "type": "array",
        "minItems": 40,
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
        },
    }
    run = Stepper(backends["llguidance"], byte_tokens)
    run.grammar = compile_schema(backends["llguidance"], items)
    walks = count_walks(monkeypatch)
    left, failures = 60, []
    for i in range(40):
        ids = encode(("[" if i == 0 else ",") + f'{{"id":{i},"ok":true}}')
        left -= len(ids)
        if left < 1:
            break
        if not run.step(ids, left):
            failures.append((i, run.closer.fell_short))
    # The first look finds it out of reach (the only failure that could have had a fallback from before it);
    # later looks are few and ask for none.
    assert failures[0] == (0, True) and all(not fell for _, fell in failures[1:])
    assert len(walks) <= 3
    # Given up for good, it stays so when forced tokens take the output to and past its budget (the tokens
    # left reach 0 and below: a look there walked the whole completion again, ~2 ms for 20 records).
    walked = len(walks)
    for left in (0, -1, -3):
        run.step(encode(',{"id":1,"ok":true}'), left)
    assert len(walks) == walked


def test_an_output_out_of_reach_from_the_start_is_never_walked(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A string of at least 2,000 characters under a 32-token budget: its shortest output (known from the
    grammar's start) cannot fit, so no token of it costs a walk, and no fallback is asked for."""
    from structgen.structured import closing

    run = Stepper(backends["llguidance"], byte_tokens)
    long_string = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 2000}},
        "required": ["s"],
    }
    run.grammar = compile_schema(backends["llguidance"], long_string)
    need = closing.initial_need(
        byte_tokens, ("test-long-string",), lambda: compile_schema(backends["llguidance"], long_string)
    )
    assert need is not None and need > 100
    run.closer.expect(
        closing.initial_completion(
            byte_tokens, ("test-long-string",), lambda: compile_schema(backends["llguidance"], long_string)
        )
    )
    walks = count_walks(monkeypatch)
    left = 32
    for piece in ('{"s":"', "abc", "def", "ghi", "jkl"):
        ids = encode(piece)
        left -= len(ids)
        run.step(ids, left)
        assert not run.closer.fell_short
    assert walks == []


def test_closer_follows_the_model_writing_the_completion(
    backends: dict[str, StructuredBackend], encode: Callable[[str], list[int]], byte_tokens: ByteTokens
) -> None:
    run = Stepper(backends["llguidance"], byte_tokens)
    assert run.step(encode('{"s":"x'), 3)
    plan = run.closer.plan
    assert plan is not None
    assert run.step([plan[0]], 2)
    assert run.closer.plan == plan[1:]
