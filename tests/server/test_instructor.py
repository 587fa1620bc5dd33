"""instructor, as its users call it, against a live SmolLM2 server: `JSON_SCHEMA` (response_format), `TOOLS`
(a forced function call) and `RESPONSES_TOOLS` (a function tool on `/v1/responses`) each return a validated
pydantic object on the first try (instructor's re-asking is off, so a bad answer fails the test), and partial
objects stream."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import instructor
import openai
import pytest
from live_server import serve, wait_idle
from pydantic import BaseModel, Field

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
ASK = "Extract the person: Maria Lopez is a 34 year old teacher from Madrid."


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    job: Literal["teacher", "doctor", "engineer", "other"]


# Greedy, and instructor's re-asking off: the first answer must be the right object.
REQUEST = {
    "model": MODEL,
    "response_model": Person,
    "messages": [{"role": "user", "content": ASK}],
    "temperature": 0,
    "max_tokens": 80,
    "max_retries": 0,
}


@pytest.fixture(scope="module")
def sdk(smollm2_engine: AsyncEngine) -> Iterator[openai.OpenAI]:
    with serve(build_app(smollm2_engine, smollm2_engine.engine.tokenizer, model_name=MODEL)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    wait_idle(smollm2_engine)


@pytest.mark.parametrize(
    "mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS, instructor.Mode.RESPONSES_TOOLS]
)
def test_chat_modes_return_the_model(sdk: openai.OpenAI, mode: instructor.Mode) -> None:
    client = instructor.from_openai(sdk, mode=mode)
    person, completion = client.chat.completions.create_with_completion(**REQUEST)
    assert isinstance(person, Person)
    assert person.job in ("teacher", "doctor", "engineer", "other")
    if mode is instructor.Mode.RESPONSES_TOOLS:  # a Responses API answer with one function_call item
        assert completion.object == "response" and completion.status == "completed"
        (call,) = [item for item in completion.output if item.type == "function_call"]
        assert call.name == "Person"
        assert Person.model_validate_json(call.arguments).model_dump() == person.model_dump()
        return
    choice = completion.choices[0]
    if mode is instructor.Mode.TOOLS:  # the answer came as a call of the model's function
        assert choice.finish_reason == "tool_calls"
        assert [call.function.name for call in choice.message.tool_calls] == ["Person"]
    else:
        assert Person.model_validate_json(choice.message.content).model_dump() == person.model_dump()


def test_partial_objects_stream_to_the_whole(sdk: openai.OpenAI) -> None:
    client = instructor.from_openai(sdk, mode=instructor.Mode.JSON_SCHEMA)
    partials = list(client.chat.completions.create_partial(**REQUEST))
    assert len(partials) > 1
    final = Person.model_validate(partials[-1].model_dump())
    assert final.age == partials[-1].age and partials[0].age is None
