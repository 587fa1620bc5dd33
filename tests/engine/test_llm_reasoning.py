"""The offline `LLM` with a reasoning parser on `tiny-thinking`: the reasoning runs free (until its budget), a
structured request's grammar governs the answer only, and each output reports the two apart.

`tiny-thinking` has random weights: it never closes `</think>` by itself, so every reasoning phase here ends at
its budget (or where `max_tokens` leaves just room for the answer), which is exactly the path under test."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from structgen import LLM, SamplingParams
from structgen.engine.outputs import CompletionOutput
from structgen.structured import StructuredOutputConfig, StructuredOutputsParams
from structgen.tokenizer.reasoning import ReasoningParserError
from structgen.tools.outputs import ToolCompletionOutput

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
JSON = StructuredOutputsParams(json=SCHEMA)
CONVERSATION = [{"role": "user", "content": "Which city is first? Answer as JSON."}]
DEFAULT_BUDGET = 6  # the LLM's own `thinking_token_budget`, for requests that set none
SWITCH = {
    "type": "function",
    "function": {
        "name": "switch",
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}},
            "required": ["on"],
            "additionalProperties": False,
        },
    },
}


def _llm(parser: str, **options: Any) -> LLM:
    # The compile thread is not niced: on a loaded machine a niced one can starve past the compile timeout.
    return LLM(
        "tiny-thinking",
        device="cpu",
        kv_cache_tokens=4096,
        max_num_seqs=8,
        reasoning_parser=parser,
        structured=StructuredOutputConfig(compile_nice=0),
        **options,
    )


@pytest.fixture(scope="module")
def r1() -> LLM:
    """DeepSeek-R1's parser: the output is reasoning from its first token until `</think>`."""
    return _llm("deepseek_r1", thinking_token_budget=DEFAULT_BUDGET)


def _markers(llm: LLM) -> tuple[int, int]:
    parser = llm.engine.reasoning_parser
    assert parser is not None
    return parser.markers.start_token_id, parser.markers.end_token_id


def check_split(llm: LLM, output: CompletionOutput, *, budget: int) -> None:
    """Reasoning present and marker-free, spent within `budget` (+ the markers), the answer after `</think>`."""
    assert output.reasoning is not None and output.reasoning.strip()
    for text in (output.reasoning, output.text):
        assert "<think>" not in text and "</think>" not in text
    n = output.num_reasoning_tokens
    assert 1 <= n <= budget + 2, (n, budget)  # the reasoning tokens, `</think>` and perhaps `<think>`
    _, end = _markers(llm)
    assert output.token_ids[n - 1] == end and end not in output.token_ids[n:]


def check_answer(output: CompletionOutput) -> None:
    assert output.finish_reason == "stop", output
    jsonschema.validate(json.loads(output.text), SCHEMA)
    assert output.structured is not None and output.structured.valid


def test_the_budget_ends_the_reasoning_and_the_answer_follows_the_schema(r1: LLM) -> None:
    budget = 12
    params = [
        SamplingParams(
            temperature=1.0, seed=seed, max_tokens=96, structured_outputs=JSON, thinking_token_budget=budget
        )
        for seed in range(4)
    ]
    results = r1.chat([CONVERSATION] * 4, params)
    for result in results:
        (output,) = result.outputs
        check_split(r1, output, budget=budget)
        check_answer(output)
    # The per-request budget overrides the LLM's (6): the reasoning ran past it.
    assert any(r.outputs[0].num_reasoning_tokens > DEFAULT_BUDGET + 2 for r in results)


def test_the_llm_budget_applies_to_requests_that_set_none(r1: LLM) -> None:
    (result,) = r1.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=64, structured_outputs=JSON))
    output = result.outputs[0]
    check_split(r1, output, budget=DEFAULT_BUDGET)
    check_answer(output)


def test_low_max_tokens_ends_the_reasoning_early_enough_for_the_answer_to_close() -> None:
    llm = _llm("deepseek_r1")  # no budget at all: only max_tokens bounds the reasoning
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=JSON)
    output = llm.chat(CONVERSATION, params)[0].outputs[0]
    check_split(llm, output, budget=40)
    check_answer(output)
    assert len(output.token_ids) <= 40


def test_enable_thinking_false_leaves_no_reasoning(r1: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=JSON)
    (result,) = r1.chat(CONVERSATION, params, chat_template_kwargs={"enable_thinking": False})
    assert result.prompt is not None and result.prompt.endswith("<think>\n\n</think>\n\n")
    output = result.outputs[0]
    assert output.reasoning is None and output.num_reasoning_tokens == 0
    assert not set(_markers(r1)) & set(output.token_ids)
    check_answer(output)
    # The template's variables as plain keyword arguments render the same prompt; the dict wins over them.
    (same,) = r1.chat(CONVERSATION, params, enable_thinking=False)
    (dict_wins,) = r1.chat(
        CONVERSATION, params, enable_thinking=True, chat_template_kwargs={"enable_thinking": False}
    )
    assert same.prompt == dict_wins.prompt == result.prompt
    assert same.outputs[0].text == output.text


def test_tool_calls_follow_the_reasoning(r1: LLM) -> None:
    (result,) = r1.chat(
        [{"role": "user", "content": "Turn the light on."}],
        SamplingParams(temperature=0, max_tokens=64, thinking_token_budget=5),
        tools=[SWITCH],
        tool_choice={"type": "function", "function": {"name": "switch"}},
        parallel_tool_calls=False,
    )
    output = result.outputs[0]
    assert isinstance(output, ToolCompletionOutput)
    check_split(r1, output, budget=5)
    assert output.finish_reason == "tool_calls" and output.content is None
    (call,) = output.tool_calls
    assert call.name == "switch" and json.loads(call.arguments)["on"] in (True, False)


def test_qwen3_reasons_where_the_prompt_opens_the_block() -> None:
    """Qwen3's hybrid template leaves `<think>` to the model; a prompt that opens it (as the 2507 thinking
    templates do) starts the output in the reasoning phase."""
    llm = _llm("qwen3")
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True) + "<think>\n"
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=JSON, thinking_token_budget=8)
    output = llm.generate(prompt, params)[0].outputs[0]
    check_split(llm, output, budget=8)
    check_answer(output)
    closed = llm.chat(CONVERSATION, params, chat_template_kwargs={"enable_thinking": False})[0].outputs[0]
    assert closed.reasoning is None and closed.num_reasoning_tokens == 0
    check_answer(closed)
    # `reasoning=False` (as the server's raw completions): the same prompt, the schema from the first token.
    raw = llm.generate(prompt, params, reasoning=False)[0].outputs[0]
    assert raw.reasoning is None and raw.num_reasoning_tokens == 0
    assert not set(_markers(llm)) & set(raw.token_ids)
    check_answer(raw)


def test_a_model_without_markers_is_refused() -> None:
    with pytest.raises(ReasoningParserError, match="<think>"):
        LLM("tiny", device="cpu", kv_cache_tokens=1024, reasoning_parser="qwen3")
