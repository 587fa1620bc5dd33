"""OpenAI's request limits, checked before any work starts, on `tiny`: ranges and strict types are 400s naming
the field in `param`; a chat request without max_tokens stops at the server's default cap (lowered to the
context the prompt leaves); text completions keep OpenAI's 16."""

from __future__ import annotations

import time
from typing import Any

import pytest
from live_server import wait_idle
from pydantic import ValidationError
from server_helpers import USER, assert_error, call

from structgen.cli import DEFAULT_MAX_TOKENS as CLI_DEFAULT_MAX_TOKENS
from structgen.engine.async_engine import AsyncEngine
from structgen.sampling_params import SamplingParams
from structgen.server import build_app
from structgen.server.errors import APIError
from structgen.server.limits import DEFAULT_MAX_TOKENS, ServerLimits, with_default_max_tokens
from structgen.server.protocol import ChatCompletionRequest, CompletionRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
DEFAULT_CAP = 5  # the test app's --max-tokens-default


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    limits = ServerLimits(max_tokens_default=DEFAULT_CAP)
    return build_app(engine, engine.engine.tokenizer, model_name="tiny", limits=limits)


# (route, fields added to a minimal body, the `param` the 400 names)
REJECTED: list[tuple[str, dict[str, Any], str]] = [
    (CHAT, {"temperature": 2.01}, "temperature"),
    (CHAT, {"temperature": -0.5}, "temperature"),
    (CHAT, {"top_p": 0}, "top_p"),
    (CHAT, {"top_p": 1.01}, "top_p"),
    (CHAT, {"n": 0}, "n"),
    (CHAT, {"n": 129}, "n"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (COMPLETIONS, {"logprobs": 6}, "logprobs"),
    (COMPLETIONS, {"logprobs": -1}, "logprobs"),
    (CHAT, {"presence_penalty": 2.5}, "presence_penalty"),
    (CHAT, {"frequency_penalty": -2.01}, "frequency_penalty"),
    (COMPLETIONS, {"presence_penalty": -3}, "presence_penalty"),
    (CHAT, {"max_tokens": 0}, "max_tokens"),
    (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"min_tokens": -1}, "min_tokens"),
    # Strictly typed: a string, a bool or a float where another type is asked for is never coerced.
    (CHAT, {"stream": "yes"}, "stream"),
    (CHAT, {"stream": 1}, "stream"),
    (CHAT, {"n": "2"}, "n"),
    (CHAT, {"n": 2.0}, "n"),
    (CHAT, {"max_tokens": "10"}, "max_tokens"),
    (CHAT, {"max_tokens": True}, "max_tokens"),
    (CHAT, {"temperature": "0.5"}, "temperature"),
    (CHAT, {"temperature": True}, "temperature"),
    (CHAT, {"logprobs": "true"}, "logprobs"),
    (CHAT, {"seed": "7"}, "seed"),
    (CHAT, {"ignore_eos": "false"}, "ignore_eos"),
    (CHAT, {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (CHAT, {"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    (CHAT, {"stop": 12}, "stop"),  # a union: the param is the field, not pydantic's `stop.str`
    (CHAT, {"messages": [{"role": "user", "content": 42}]}, "messages.0.content"),
    (COMPLETIONS, {"echo": "true"}, "echo"),
    (COMPLETIONS, {"max_tokens": "16"}, "max_tokens"),
    (COMPLETIONS, {"prompt": [1, True]}, "prompt"),
    # Checked by SamplingParams, which names the field first in its message.
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
]


@pytest.mark.parametrize(("path", "fields", "param"), REJECTED, ids=[f"{r[2]}={r[1]}" for r in REJECTED])
def test_out_of_range_or_mistyped_fields_are_400s_naming_the_field(
    app: Any, path: str, fields: dict[str, Any], param: str
) -> None:
    body = ({"messages": USER} if path == CHAT else {"prompt": "Hi"}) | {"max_tokens": 2} | fields
    error = assert_error(call(app, "POST", path, json=body, headers=None), 400)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_temperature_50_without_max_tokens_is_refused_at_once(app: Any, engine: AsyncEngine) -> None:
    finished = engine.engine.stats().num_requests_finished
    start = time.perf_counter()
    response = call(app, "POST", CHAT, json={"messages": USER, "temperature": 50}, headers=None)
    error = assert_error(response, 400, "temperature", "less than or equal to 2")
    assert error["param"] == "temperature"
    assert time.perf_counter() - start < 5
    assert engine.engine.stats().num_requests_finished == finished and not engine.engine.has_unfinished()


def test_the_edges_of_each_range_and_ints_for_floats_are_accepted() -> None:
    edges = {"temperature": 2, "top_p": 1, "n": 128, "presence_penalty": -2, "frequency_penalty": 2}
    chat = ChatCompletionRequest.model_validate(
        {"messages": USER, **edges, "logprobs": True, "top_logprobs": 20}
    )
    assert chat.temperature == 2.0 and isinstance(chat.temperature, float) and chat.n == 128
    assert ChatCompletionRequest.model_validate({"messages": USER, "temperature": 0}).temperature == 0.0
    assert CompletionRequest.model_validate({"prompt": "x", "logprobs": 5}).logprobs == 5
    # Unknown fields are still ignored, whatever their type.
    assert ChatCompletionRequest.model_validate({"messages": USER, "stream_mode": "yes"}).stream is False
    for bad in ({"temperature": 2.0001}, {"n": 129}, {"top_p": 0.0}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"messages": USER, **bad})


def test_offline_sampling_params_keep_vllms_wider_ranges() -> None:
    # Scripts on the offline API may use them, as with vLLM; only the HTTP API follows OpenAI.
    params = SamplingParams(temperature=5.0, n=200, max_tokens=None)
    assert params.temperature == 5.0 and params.n == 200 and params.max_tokens is None


# -- the default cap --------------------------------------------------------------------------------------------


def test_chat_without_max_tokens_stops_at_the_server_default(app: Any, engine: AsyncEngine) -> None:
    body = {"messages": USER, "ignore_eos": True, "temperature": 0}
    plain = call(app, "POST", CHAT, json=body, headers=None).json()
    assert plain["usage"]["completion_tokens"] == DEFAULT_CAP
    assert plain["choices"][0]["finish_reason"] == "length"
    streamed = call(app, "POST", CHAT, json=body | {"stream": True}, headers=None)
    assert streamed.status_code == 200 and streamed.text.count('"finish_reason":"length"') == 1
    # A request's own cap wins over the default, above it or below.
    for field in ("max_tokens", "max_completion_tokens"):
        own = call(app, "POST", CHAT, json=body | {field: DEFAULT_CAP + 2}, headers=None).json()
        assert own["usage"]["completion_tokens"] == DEFAULT_CAP + 2
    wait_idle(engine)


def test_completions_keep_openais_default_of_16_also_for_null(app: Any, engine: AsyncEngine) -> None:
    for body in (
        {"prompt": "Once", "ignore_eos": True},
        {"prompt": "Once", "ignore_eos": True, "max_tokens": None},
    ):
        answer = call(app, "POST", COMPLETIONS, json=body, headers=None).json()
        assert answer["usage"]["completion_tokens"] == 16, answer
    wait_idle(engine)


def test_the_default_cap_is_lowered_to_the_context_the_prompt_leaves() -> None:
    params = SamplingParams(max_tokens=None, temperature=0)
    capped = with_default_max_tokens(params, default=4096, prompt_tokens=1000, max_sequence_tokens=2048)
    assert capped.max_tokens == 1048 and params.max_tokens is None
    short = with_default_max_tokens(params, default=16, prompt_tokens=1000, max_sequence_tokens=2048)
    assert short.max_tokens == 16
    # No room at all: left unset, so the engine answers with its own "prompt too long" 400.
    assert with_default_max_tokens(params, default=16, prompt_tokens=2048, max_sequence_tokens=2048) is params
    with pytest.raises(APIError) as raised:
        with_default_max_tokens(
            SamplingParams(max_tokens=None, min_tokens=50),
            default=16,
            prompt_tokens=10,
            max_sequence_tokens=2048,
        )
    assert raised.value.status == 400 and raised.value.param == "min_tokens"


def test_a_prompt_over_the_context_without_max_tokens_is_still_the_engines_400(app: Any) -> None:
    long = [{"role": "user", "content": "word " * 3000}]
    assert_error(call(app, "POST", CHAT, json={"messages": long}, headers=None), 400, "tokens")


def test_the_default_is_4096_in_the_server_and_the_cli() -> None:
    assert DEFAULT_MAX_TOKENS == CLI_DEFAULT_MAX_TOKENS == ServerLimits().max_tokens_default == 4096
    with pytest.raises(ValueError, match="max_tokens_default"):
        ServerLimits(max_tokens_default=0)
