"""`LLM.chat` with tools on the `tiny` model: the grammar forces the call, outputs carry the parsed calls."""

from __future__ import annotations

import json

from structgen import LLM, SamplingParams
from structgen.structured import StructuredOutputConfig
from structgen.tools.outputs import ToolCompletionOutput

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


def test_chat_with_tools_returns_parsed_calls() -> None:
    # The compile thread is not niced: on a loaded machine a niced one can starve past the compile timeout.
    llm = LLM("tiny", kv_cache_tokens=1024, max_num_seqs=4, structured=StructuredOutputConfig(compile_nice=0))
    messages = [{"role": "user", "content": "Turn the light on."}]
    (result,) = llm.chat(
        messages,
        SamplingParams(temperature=0, max_tokens=48),
        tools=[SWITCH],
        tool_choice={"type": "function", "function": {"name": "switch"}},
        parallel_tool_calls=False,
    )
    output = result.outputs[0]
    assert isinstance(output, ToolCompletionOutput)
    assert output.finish_reason == "tool_calls" and output.content is None
    assert output.text.startswith('<tool_call>\n{"name": "switch", "arguments": {"on": ')
    (call,) = output.tool_calls
    assert call.name == "switch" and json.loads(call.arguments)["on"] in (True, False)
    assert call.to_openai()["function"]["arguments"] == call.arguments
    # Without tools nothing changes: plain outputs.
    (plain,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2))
    assert not isinstance(plain.outputs[0], ToolCompletionOutput)
