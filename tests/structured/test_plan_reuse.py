"""The budget closer's reuse of older completions (`structgen.structured.plan_reuse`): past a value written in
their place, after tokens it skipped, spliced after a walk that closes the record, resumed from the grammar's
start; each without a walk, checked by the grammar, and no longer than still needed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from closer_helpers import Stepper, count_walks, records
from structured_helpers import compile_schema

from structgen.structured import StructuredBackend
from structgen.structured.closing import ByteTokens

_TASKS = records(
    {
        "status": {"enum": ["todo", "blocked", "done"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    min_items=6,
)


def test_closer_reuses_the_completion_past_a_value_written_in_its_place(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model writing another enum value or number than the completion's, then forced through the same keys,
    keeps the rest of the completion: checked by the grammar, no new walk, and it still ends the output."""
    run = Stepper(backends["llguidance"], byte_tokens)
    run.grammar = compile_schema(backends["llguidance"], _TASKS)
    left = 90
    assert run.step(encode('[{"status":"'), left)
    plan = run.closer.plan
    assert plan is not None and byte_tokens.text(list(plan)).startswith(b'blocked","priority":1}')
    walks = count_walks(monkeypatch)
    for piece in ('done","priority":', "4", '},{"status":"', 'todo","priority":'):
        ids = encode(piece)
        left -= len(ids)
        assert run.step(ids, left)
        rest = run.closer.plan
        assert rest is not None and len(rest) <= left
        assert run.grammar.validate_tokens((*rest, byte_tokens.eos)) == len(rest) + 1
    assert walks == []


def _skip_then_look(run: Stepper, pieces: list[list[int]], left: int) -> int:
    """Step through `pieces` while the closer skips them (asserted), then return the `left` at which the next
    step is a look."""
    for ids in pieces:
        left -= len(ids)
        assert left > run.closer._next_check  # skipped: no look, no plan kept
        assert run.step(ids, left) and run.closer.plan is None
    return run.closer._next_check


_NAMES = records({"name": {"type": "string"}, "n": {"type": "integer"}}, min_items=6)


@pytest.mark.parametrize(
    ("schema", "start", "skipped", "look", "expected"),
    [
        # Through the same keys into the next record: the old completion past the last `"priority":`.
        (_TASKS, '[{"status":"', ['done","priority":', "4", '},{"status":"'], 'todo","priority":', b"1}"),
        # Inside a string (the next record's name): the old completion still ends it, as it starts by ending
        # the string it was computed in.
        (_NAMES, '[{"name":"', ['ab","n":', "4", '},{"name":"'], "cd", b'","n":'),
    ],
)
def test_a_look_after_skipped_tokens_places_the_last_completion_instead_of_walking(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    monkeypatch: pytest.MonkeyPatch,
    schema: dict[str, Any],
    start: str,
    skipped: list[str],
    look: str,
    expected: bytes,
) -> None:
    """Far from the limit the closer skips tokens and keeps no completion of the current state; its next look
    finds where the output stands in the last completion it had (checked by the grammar) instead of a walk."""
    run = Stepper(backends["llguidance"], byte_tokens)
    run.grammar = compile_schema(backends["llguidance"], schema)
    assert run.step(encode(start), 400)
    assert run.closer.plan is not None and len(run.closer.plan) < 60
    left = _skip_then_look(run, [encode(piece) for piece in skipped], 400)
    walks = count_walks(monkeypatch)
    assert run.step(encode(look), left)
    rest = run.closer.plan
    assert walks == [] and rest is not None and len(rest) <= left
    assert run.grammar.validate_tokens((*rest, byte_tokens.eos)) == len(rest) + 1
    assert byte_tokens.text(list(rest)).startswith(expected)


def test_a_look_after_skipped_tokens_walks_where_the_last_completion_cannot_be_placed(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member the old completion never wrote (an optional one it left out) gives nothing to place it by: the
    look walks, as before, and finds the completion from there."""
    schema = {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "integer"}, "minItems": 3},
            "extra": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["items"],
        "additionalProperties": False,
    }
    run = Stepper(backends["llguidance"], byte_tokens)
    run.grammar = compile_schema(backends["llguidance"], schema)
    assert run.step(encode('{"items":[1'), 400)
    assert run.closer.plan is not None and b"extra" not in byte_tokens.text(list(run.closer.plan))
    left = _skip_then_look(run, [encode(",2,3]")], 400)
    walks = count_walks(monkeypatch)
    assert run.step(encode(',"extra":['), left)
    rest = run.closer.plan
    assert len(walks) == 1 and rest is not None
    assert byte_tokens.text(list(rest)) == b"]}"


_TAGGED = records(
    {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    min_items=4,
    required=["name"],
)


@pytest.mark.parametrize(
    ("since", "records_left"),
    [
        # The completion of the step before: the optional `tags` it left out, now opened.
        ('a","tags":["x', 3),
        # One from a record before: the splice drops the record the output has written since.
        ('a"},{"name":"b","tags":["x', 2),
    ],
)
def test_a_completion_that_cannot_be_placed_is_spliced_after_a_walk_closing_the_record(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    monkeypatch: pytest.MonkeyPatch,
    since: str,
    records_left: int,
) -> None:
    """The output opened a member the last completion never wrote: the look walks only to the end of the
    record (`"]}`) and goes on with the last completion's records after one of its own ended, no more of them
    than still needed: the same completion as a whole walk, without it."""
    run = Stepper(backends["llguidance"], byte_tokens)
    run.grammar = compile_schema(backends["llguidance"], _TAGGED)
    assert run.step(encode('[{"name":"'), 40)  # near the limit: a look at every token
    old = run.closer.plan
    assert old is not None and b"tags" not in byte_tokens.text(list(old))
    walks = count_walks(monkeypatch)
    ids = encode(since)
    assert run.step(ids, 40 - len(ids))
    rest = run.closer.plan
    assert walks == [] and rest is not None
    assert byte_tokens.text(list(rest)) == b'"]}' + b',{"name":""}' * records_left + b"]"
    from structgen.structured.closing import shortest_completion

    whole = shortest_completion(run.grammar, byte_tokens, run.scanner)
    assert whole is not None and byte_tokens.text(list(whole)) == byte_tokens.text(list(rest))


def test_closer_keeps_the_completion_when_the_model_writes_part_of_its_first_token(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model writes the start of the completion's first token (`bl` of `blocked`): the rest of that token is
    encoded and the completion's later tokens are kept as they were, without a walk."""
    run = Stepper(backends["llguidance"], byte_tokens)
    run.grammar = compile_schema(backends["llguidance"], _TASKS)
    left = 90
    assert run.step(encode('[{"status":"'), left)
    plan = run.closer.plan
    assert plan is not None
    text = byte_tokens.text(list(plan))
    assert text.startswith(b"blocked") and byte_tokens.text([plan[0]]) not in (b"b", b"bl")
    walks = count_walks(monkeypatch)
    ids = encode("bl")
    assert byte_tokens.text(ids) == b"bl"
    assert run.step(ids, left - len(ids))
    rest = run.closer.plan
    assert rest is not None and walks == []
    assert byte_tokens.text(list(rest)) == text[2:]
    assert rest[-len(plan) + 1 :] == plan[1:]  # the tokens after the first one are the completion's own
    assert run.grammar.validate_tokens((*rest, byte_tokens.eos)) == len(rest) + 1


def test_an_output_writing_the_completion_in_more_tokens_at_its_limit_is_out_of_reach_without_a_walk(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At its limit, the model writes the start of the completion's first token as a token of its own: the
    rest of the completion is the walk's own continuation but no longer fits, so the closer says so (the engine
    then takes the completion from before the token) without walking again."""
    run = Stepper(backends["llguidance"], byte_tokens)
    run.grammar = compile_schema(backends["llguidance"], _TASKS)
    assert run.step(encode('[{"status":"'), 90)
    plan = run.closer.plan
    assert plan is not None and byte_tokens.text(list(plan)).startswith(b"blocked")
    walks = count_walks(monkeypatch)
    ids = encode("bl")
    assert len(ids) == 1 and byte_tokens.text([plan[0]]) != b"bl"
    assert not run.step(ids, len(plan) - 1)  # the completion took every token left before this one
    assert walks == [] and run.closer.fallback == plan
    assert run.closer.need is not None and run.closer.need >= len(plan)


_SCORES = {
    "type": "array",
    "minItems": 4,
    "items": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["score"],
        "additionalProperties": False,
    },
}


def test_digits_written_in_a_number_keep_its_completion(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Digits added to the number the completion ends at once keep the completion (no walk), and where the
    number cannot end yet (`0.`) a `0` before it; each result is checked to end the output."""
    run = Stepper(backends["llguidance"], byte_tokens)
    run.grammar = compile_schema(backends["llguidance"], _SCORES)
    left = 30  # near the budget: the closer looks at every token
    assert run.step(encode('[{"score":0'), left)
    plan = run.closer.plan
    assert plan is not None and byte_tokens.text(list(plan)).startswith(b"}")
    walks = count_walks(monkeypatch)
    for piece, starts in ((".", b"0}"), ("8", b"}"), ("1", b"}"), ("25", b"}")):
        ids = encode(piece)
        left -= len(ids)
        assert run.closer.step(run.grammar, run.scanner, left, run.feed(ids), same_value=True)
        rest = run.closer.plan
        assert rest is not None and byte_tokens.text(list(rest)).startswith(starts), (piece, rest)
        assert run.grammar.validate_tokens((*rest, byte_tokens.eos)) == len(rest) + 1
        assert len(rest) == len(plan) + (starts == b"0}")
    assert walks == []


def test_the_first_look_resumes_the_grammars_start_completion(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request's first look near its budget takes the cached completion from the grammar's start past what
    the output wrote (its forced head ending inside one of the completion's tokens too), without a walk."""
    from structgen.structured import closing

    def new_grammar() -> Any:
        return compile_schema(backends["llguidance"], _SCORES)

    start = closing.initial_completion(byte_tokens, ("test-scores-start",), new_grammar)
    assert start is not None
    for head in ('[{"score":', '[{"score'):
        run = Stepper(backends["llguidance"], byte_tokens)
        run.grammar = new_grammar()
        run.closer.expect(start)
        walks = count_walks(monkeypatch)
        ids = encode(head)
        assert run.step(ids, len(start))  # the budget near from the start: the first step looks
        rest = run.closer.plan
        assert rest is not None and walks == [], head
        assert byte_tokens.text(list(rest)) == byte_tokens.text(list(start))[len(head.encode()) :]
        assert run.grammar.validate_tokens((*rest, byte_tokens.eos)) == len(rest) + 1
