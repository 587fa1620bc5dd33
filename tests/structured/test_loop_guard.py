"""The loop guard: a value the model fills with the same tokens over and over is ended (a string closed, an
array closed, a runaway number stopped) with output the grammar accepts; outputs without loops are untouched."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from structgen.structured import StructuredBackend, StructuredOutputsParams
from structgen.structured.closing import ByteTokens, can_end
from structgen.structured.finishing import Finisher
from structgen.tools import ToolCallPlan, parse_tool_calls

MEETING = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "attendees": {"type": "array", "items": {"type": "string"}},
        "budget": {"type": "number"},
    },
    "required": ["title", "attendees", "budget"],
    "additionalProperties": False,
}


class Run:
    """Feeds tokens one at a time through a finisher with the guard on, as the engine does."""

    def __init__(
        self,
        backend: StructuredBackend,
        byte_tokens: ByteTokens,
        schema: dict[str, Any] | StructuredOutputsParams,
    ):
        params = (
            schema if isinstance(schema, StructuredOutputsParams) else StructuredOutputsParams(json=schema)
        )
        self.grammar = backend.compile(params.to_spec())
        self.tokens = byte_tokens
        self.finisher = Finisher(byte_tokens, close=False, guard=True, max_number_digits=24)
        self.ids: list[int] = []
        self.inserted: list[list[int]] = []  # what the guard appended, per token fed

    def feed(self, ids: list[int]) -> None:
        for token in ids:
            step = self.finisher.advance(self.grammar, token, left=None, jump_forward=False)
            assert step.kept
            self.ids += [token, *step.tokens]
            self.inserted.append(step.tokens)
            self.ended = step.end

    def feed_until_guarded(self, ids: list[int], *, limit: int = 400) -> None:
        """Feed `ids` over and over until the guard appends something."""
        for _ in range(limit // len(ids)):
            for token in ids:
                self.feed([token])
                if self.inserted[-1]:
                    return
        raise AssertionError(f"the guard never ended the loop: {self.text()[-80:]!r}")

    def text(self) -> str:
        return self.tokens.text(self.ids).decode()


def test_a_string_that_loops_is_closed(
    backends: dict[str, StructuredBackend], encode: Callable[[str], list[int]], byte_tokens: ByteTokens
) -> None:
    run = Run(backends["llguidance"], byte_tokens, MEETING)
    run.feed(encode('{"title":"Sakura'))
    run.feed_until_guarded(encode("_2026"))
    assert byte_tokens.text(run.inserted[-1]) == b'"'
    assert run.finisher.loops_ended == 1
    assert run.text().count("_2026") < 16  # ended within a few repetitions, not at the budget
    run.feed(encode(',"attendees":[],"budget":1}'))
    assert can_end(run.grammar, byte_tokens.eos)
    jsonschema.validate(json.loads(run.text()), MEETING)


def test_an_array_whose_items_repeat_is_closed(
    backends: dict[str, StructuredBackend], encode: Callable[[str], list[int]], byte_tokens: ByteTokens
) -> None:
    run = Run(backends["llguidance"], byte_tokens, MEETING)
    run.feed(encode('{"title":"Team sync","attendees":["Amara","Lukas",'))
    run.feed_until_guarded(encode('"Sakura",'))
    # The item being written is finished, then the array closed.
    assert byte_tokens.text(run.inserted[-1]).endswith(b"]")
    assert run.text().endswith('"]') or run.text().endswith('"Sakura"]')
    run.feed(encode(',"budget":12.5}'))
    output = json.loads(run.text())
    jsonschema.validate(output, MEETING)
    assert output["attendees"][:2] == ["Amara", "Lukas"]


def test_a_long_repeated_item_ends_its_array(
    backends: dict[str, StructuredBackend], encode: Callable[[str], list[int]], byte_tokens: ByteTokens
) -> None:
    """Items of ~20 tokens each, repeated exactly (what SmolLM2 does with order lines)."""
    order = {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"product": {"type": "string"}, "quantity": {"type": "integer"}},
                    "required": ["product", "quantity"],
                },
            }
        },
        "required": ["items"],
    }
    run = Run(backends["llguidance"], byte_tokens, order)
    item = '{"product":"Elliott ergonomic standing desk 2015","quantity":1},'
    assert 16 < len(encode(item)) <= 32
    run.feed(encode('{"items":['))
    run.feed_until_guarded(encode(item))
    assert run.finisher.loops_ended == 1
    assert run.text().count("Elliott") <= 6
    assert can_end(run.grammar, byte_tokens.eos) or byte_tokens.text(run.inserted[-1]).endswith(b"]")
    run.feed(encode("}") if not can_end(run.grammar, byte_tokens.eos) else [])
    jsonschema.validate(json.loads(run.text()), order)


def test_the_same_tool_call_over_and_over_ends_the_output(
    backends: dict[str, StructuredBackend], encode: Callable[[str], list[int]], byte_tokens: ByteTokens
) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    plan = ToolCallPlan.build(tools, "required", format="hermes")
    structured = plan.structured_outputs()
    assert structured is not None
    run = Run(backends["llguidance"], byte_tokens, structured)
    call = plan.format.render_call("get_weather", '{"city": "Vienna"}')
    block = plan.format.render_block([("get_weather", '{"city": "Vienna"}')] * 2)
    repeat = encode(block[len(call) :])  # what one more call adds: separator and call
    run.feed(encode(call))
    run.feed_until_guarded(repeat)
    assert run.ended and run.finisher.loops_ended == 1
    assert can_end(run.grammar, byte_tokens.eos)
    parsed = parse_tool_calls(run.text(), plan.format)
    assert parsed.valid and len(parsed.calls) <= 8


def test_a_runaway_number_is_ended(
    backends: dict[str, StructuredBackend], encode: Callable[[str], list[int]], byte_tokens: ByteTokens
) -> None:
    run = Run(backends["llguidance"], byte_tokens, MEETING)
    run.feed(encode('{"title":"x","attendees":[],"budget":3.'))
    run.feed_until_guarded(encode("14159"))
    budget_text = run.text().split('"budget":')[1]
    assert budget_text.endswith("}")
    assert len(budget_text) <= 24 + 8
    jsonschema.validate(json.loads(run.text()), MEETING)


@pytest.mark.parametrize(
    "output",
    [
        {"title": "Quarterly planning", "attendees": ["Amara", "Lukas", "Kai", "Sakura"], "budget": 1200.5},
        # Repetition short of a loop: a few equal items, a short run of one character.
        {"title": "aaaaaaaa", "attendees": ["Kai", "Kai", "Kai"], "budget": 100000},
        {"title": "ha ha ha ha", "attendees": [], "budget": -0.25},
    ],
)
def test_outputs_without_loops_are_untouched(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    output: dict[str, Any],
) -> None:
    run = Run(backends["llguidance"], byte_tokens, MEETING)
    text = json.dumps(output, separators=(",", ":"))
    run.feed(encode(text))
    assert not any(run.inserted)
    assert run.finisher.loops_ended == 0
    assert run.text() == text


def _reference_push(history: list[int]) -> int:
    """The repetition check as first written: every period up to MAX_PERIOD, for the last token of `history`."""
    from structgen.structured.loop_guard import MAX_PERIOD, MIN_REPEATS, MIN_SPAN

    n, token = len(history), history[-1]
    for p in range(1, min(MAX_PERIOD, n // MIN_REPEATS) + 1):
        if history[n - 1 - p] != token:
            continue
        span = max(MIN_REPEATS * p, -(-MIN_SPAN // p) * p)
        if span <= n and history[n - span + p :] == history[n - span : n - p]:
            return span
    return 0


@pytest.mark.parametrize("alphabet", [1, 2, 3, 7, 40])
def test_repetition_check_matches_the_reference(byte_tokens: ByteTokens, alphabet: int) -> None:
    """The guard's check, which looks only at the periods the new token can close, finds the same loops as
    checking every period, on random streams (small alphabets repeat a lot) with planted repetitions; copies
    carry on alike."""
    import random

    from structgen.structured.loop_guard import LoopGuard

    rng = random.Random(alphabet)
    guard = LoopGuard(byte_tokens)
    history: list[int] = []
    twin = None
    for i in range(1500):
        if rng.random() < 0.02 and len(history) > 40:  # plant a run of some earlier stretch
            period = rng.randint(1, 40)
            stream = history[-period:] * rng.randint(1, 6)
        else:
            stream = [rng.randrange(alphabet)]
        for token in stream:
            history.append(token)
            assert guard._push(token, 0) == _reference_push(history)
            if twin is not None:
                assert twin._push(token, 0) == _reference_push(history)
        if i == 700:
            twin = guard.copy()
