from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from shared_data import VLLM_SAMPLES
from tool_helpers import WEATHER_TOOLS

from structgen.tools import FORMATS, ToolCallPlan, ToolError, arguments_schema, parse_tools

Accepts = Callable[[ToolCallPlan, str], bool]
VIENNA = ("get_weather", '{"city": "Vienna"}')
TOKYO = ("get_time", '{"zone": "Asia/Tokyo"}')


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_required_accepts_one_or_more_valid_calls(accepts: Accepts, fmt: str) -> None:
    plan = ToolCallPlan.build(WEATHER_TOOLS, "required", format=fmt)
    block = plan.format.render_block
    assert accepts(plan, block([VIENNA]))
    assert accepts(plan, block([VIENNA, TOKYO, VIENNA]))
    assert not accepts(plan, block([("get_weather", '{"town": "Vienna"}')]))  # no such argument
    assert not accepts(plan, block([("get_time", '{"zone": "tokyo"}')]))  # pattern
    assert not accepts(plan, block([("get_stock", '{"city": "Vienna"}')]))  # no such function
    assert not accepts(plan, "Vienna is sunny.")  # text is not a call


def test_no_parallel_calls_means_exactly_one(accepts: Accepts) -> None:
    plan = ToolCallPlan.build(WEATHER_TOOLS, "required", parallel_tool_calls=False)
    assert accepts(plan, plan.format.render_block([TOKYO]))
    assert not accepts(plan, plan.format.render_block([TOKYO, VIENNA]))


def test_named_function_only(accepts: Accepts) -> None:
    plan = ToolCallPlan.build(WEATHER_TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert accepts(plan, plan.format.render_block([TOKYO, TOKYO]))
    assert not accepts(plan, plan.format.render_block([VIENNA]))


def test_allowed_tools_restrict_the_calls(accepts: Accepts) -> None:
    only_time = {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}
    plan = ToolCallPlan.build(WEATHER_TOOLS, {"type": "allowed_tools", "allowed_tools": only_time})
    assert accepts(plan, plan.format.render_block([TOKYO]))
    assert not accepts(plan, plan.format.render_block([VIENNA]))
    assert not accepts(plan, "The time in Tokyo is noon.")  # required: a call
    auto = ToolCallPlan.build(
        WEATHER_TOOLS, {"type": "allowed_tools", "allowed_tools": {**only_time, "mode": "auto"}}
    )
    assert accepts(auto, "The time in Tokyo is noon.")
    assert accepts(auto, auto.format.render_block([TOKYO]))
    assert not accepts(auto, auto.format.render_block([VIENNA]))
    # Every tool is still rendered into the prompt: the prompt (and its cached prefix) does not change.
    messages = [{"role": "user", "content": "hi"}]
    assert auto.conversation(messages) == ToolCallPlan.build(WEATHER_TOOLS, "auto").conversation(messages)


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_auto_allows_text_or_a_constrained_call(accepts: Accepts, fmt: str) -> None:
    plan = ToolCallPlan.build(WEATHER_TOOLS, "auto", format=fmt)
    block = plan.format.render_block([VIENNA])
    assert accepts(plan, "It is sunny in Vienna today.")
    assert accepts(plan, block)
    assert accepts(plan, "Let me look that up.\n" + block)
    # Once the trigger is written, the rest must be a valid call.
    assert not accepts(plan, f"Sure {plan.format.trigger} the weather is nice")
    assert not accepts(plan, "Checking " + plan.format.render_block([("get_weather", '{"city": 3}')]))


def test_none_has_no_grammar() -> None:
    plan = ToolCallPlan.build(WEATHER_TOOLS, "none")
    assert plan.structured_outputs() is None
    assert plan.parse("<tool_call> whatever").calls == []


def test_vllm_labelled_required_outputs(accepts: Accepts) -> None:
    """vLLM's 18 labelled outputs for tool_choice="required" (a JSON array of {name, parameters})."""
    tools = json.loads((VLLM_SAMPLES / "tools.tool_choice_required.json").read_text())
    cases = json.loads((VLLM_SAMPLES / "tool_choice_required.outputs.json").read_text())
    assert len(cases) == 18
    plan = ToolCallPlan.build(tools, "required", format="json_array")
    got = [accepts(plan, json.dumps(case["output"])) for case in cases]
    assert got == [case["should_match"] for case in cases]
    # The same calls in the default format are accepted exactly when they are labelled valid.
    hermes = ToolCallPlan.build(tools, "required")
    mapped = 0
    for case in cases:
        calls = case["output"]
        if (
            isinstance(calls, list)
            and calls
            and all(isinstance(c, dict) and list(c) == ["name", "parameters"] for c in calls)
        ):
            mapped += 1
            pairs = [(c["name"], json.dumps(c["parameters"])) for c in calls]
            assert accepts(hermes, hermes.format.render_block(pairs)) == case["should_match"], calls
    assert mapped == 10


def test_unenforceable_keyword_is_relaxed_and_validated() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "tag",
            "parameters": {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
        },
    }
    (definition,) = parse_tools([tool])
    served = arguments_schema(definition)
    assert served.relaxed and "uniqueItems" not in json.dumps(served.schema)
    plan = ToolCallPlan.build([tool], "required")
    parsed = plan.parse(plan.format.render_block([("tag", '{"tags": ["a", "a"]}')]))
    assert parsed.calls[0].error is not None and "non-unique" in parsed.calls[0].error


def test_strict_tool_is_enforced_exactly_or_refused() -> None:
    parameters = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    strict = {"type": "function", "function": {"name": "tag", "strict": True, "parameters": parameters}}
    with pytest.raises(ToolError, match=r"'tag' is strict.*uniqueItems.*set strict to false"):
        ToolCallPlan.build([strict], "required")
    # A strict schema the grammar enforces as written is served exactly (nothing relaxed, nothing to validate).
    exact = {
        "type": "function",
        "function": {
            "name": "tag",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"tag": {"type": "string", "enum": ["a", "b"]}},
                "required": ["tag"],
                "additionalProperties": False,
            },
        },
    }
    (definition,) = parse_tools([exact])
    assert definition.strict and not arguments_schema(definition).relaxed
    ToolCallPlan.build([exact], "required")


def test_unsatisfiable_parameters_name_the_tool() -> None:
    tool = {"type": "function", "function": {"name": "never", "parameters": {"type": "object", "not": {}}}}
    with pytest.raises(ToolError, match="'never'"):
        ToolCallPlan.build([tool], "required")


def test_a_response_format_shapes_the_text_answer_not_the_calls(accepts: Accepts) -> None:
    from structgen import SamplingParams
    from structgen.structured import StructuredOutputsParams

    answer = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
        "required": ["city", "temp"],
        "additionalProperties": False,
    }
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=answer))
    # required / named: the output is calls only, so the text format is moot.
    required = ToolCallPlan.build(WEATHER_TOOLS, "required")
    assert required.sampling_params(params).structured_outputs == required.structured_outputs()
    # auto: the answer is that JSON, or calls; free text is no longer allowed.
    auto = ToolCallPlan.build(WEATHER_TOOLS, "auto")
    grammar = auto.sampling_params(params).structured_outputs.grammar
    joined = ToolCallPlan(auto.tools, auto.choice, auto.format, auto.template_supports_tools)
    check = lambda text: accepts(_with_grammar(joined, grammar), text)  # noqa: E731
    assert check('{"city":"Vienna","temp":21}')
    assert check(auto.format.render_block([VIENNA]))
    assert not check("It is sunny in Vienna.")
    assert not check('{"city":"Vienna"}')  # the answer's schema holds
    # none: the format applies to the text alone.
    assert ToolCallPlan.build(WEATHER_TOOLS, "none").sampling_params(params) is params


def test_auto_with_a_non_json_format_or_bare_json_calls_is_refused() -> None:
    from structgen import SamplingParams
    from structgen.structured import StructuredOutputsParams

    regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    with pytest.raises(ToolError, match="combine only with a JSON response format"):
        ToolCallPlan.build(WEATHER_TOOLS, "auto").sampling_params(regex)
    assert ToolCallPlan.build(WEATHER_TOOLS, "required").sampling_params(regex).structured_outputs.grammar
    json_object = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(ToolError, match="could not be told apart from a call"):
        ToolCallPlan.build(WEATHER_TOOLS, "auto", format="llama3_json").sampling_params(json_object)


def _with_grammar(plan: ToolCallPlan, grammar: str) -> ToolCallPlan:
    """`plan` whose `structured_outputs()` is `grammar` (what the `accepts` fixture compiles)."""

    class Fixed(ToolCallPlan):
        def structured_outputs(self, **_: object):  # type: ignore[override]
            from structgen.structured import StructuredOutputsParams

            return StructuredOutputsParams(grammar=grammar)

    return Fixed(plan.tools, plan.choice, plan.format, plan.template_supports_tools)
