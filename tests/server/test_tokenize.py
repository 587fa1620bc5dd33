"""vLLM's `/tokenize` and `/detokenize` on `tiny`: the prompt and messages forms, counts equal to the chat route's
`usage.prompt_tokens` (with and without tools), token strings, the detokenize round trip, bad ids, the key and
the model check."""

from __future__ import annotations

from typing import Any

import pytest
from server_helpers import AUTH, KEY, USER, assert_error, call

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATIONS = {
    "plain": [{"role": "system", "content": "Be brief."}, *USER],
    "tool-turns": [
        {"role": "user", "content": "Weather in Lisbon?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ],
}


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    return build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY)


def tokenize(app: Any, body: dict[str, Any]) -> dict[str, Any]:
    response = call(app, "POST", "/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chat_prompt_tokens(app: Any, body: dict[str, Any]) -> int:
    response = call(app, "POST", "/v1/chat/completions", json=body | {"max_tokens": 1})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_prompt_form(app: Any, engine: AsyncEngine) -> None:
    tokenizer = engine.engine.tokenizer
    data = tokenize(app, {"model": "tiny", "prompt": "Hello structured world"})
    assert set(data) == {"count", "max_model_len", "tokens", "token_strs"}
    assert data["tokens"] == tokenizer.encode("Hello structured world") and data["count"] == len(
        data["tokens"]
    )
    assert data["max_model_len"] == engine.engine.max_sequence_tokens
    assert data["token_strs"] is None
    strs = tokenize(app, {"prompt": "Hello structured world", "return_token_strs": True})["token_strs"]
    assert strs == [tokenizer.id_to_token(i) for i in data["tokens"]] and strs[1] == "Ġstructured"


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["no-tools", "tools"])
def test_messages_count_is_the_chat_routes_prompt_tokens(
    app: Any, name: str, tools: list[dict[str, Any]] | None
) -> None:
    body: dict[str, Any] = {"messages": CONVERSATIONS[name]}
    if tools is not None:
        body["tools"] = tools
    data = tokenize(app, body)
    assert data["count"] == len(data["tokens"]) == chat_prompt_tokens(app, body)


def test_tools_are_in_the_prompt_unless_tool_choice_is_none(app: Any) -> None:
    plain = tokenize(app, {"messages": USER})["count"]
    with_tools = tokenize(app, {"messages": USER, "tools": [WEATHER]})
    assert with_tools["count"] > plain
    assert (
        "get_weather"
        in call(app, "POST", "/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
    )
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "none"}
    assert tokenize(app, body)["count"] == plain == chat_prompt_tokens(app, body)


def test_generation_prompt_and_continue_final_message(app: Any) -> None:
    messages = [*USER, {"role": "assistant", "content": "The number is "}]

    def text(body: dict[str, Any]) -> str:
        tokens = tokenize(app, body)["tokens"]
        return call(app, "POST", "/detokenize", json={"tokens": tokens}).json()["prompt"]

    closed = text({"messages": messages, "add_generation_prompt": False})
    assert closed.endswith("The number is <|im_end|>\n")
    assert text({"messages": messages}) == closed + "<|im_start|>assistant\n"
    opened = text({"messages": messages, "add_generation_prompt": False, "continue_final_message": True})
    assert opened == closed.removesuffix("<|im_end|>\n")
    both = call(app, "POST", "/tokenize", json={"messages": messages, "continue_final_message": True})
    assert assert_error(both, 400, "cannot both be true")["param"] == "continue_final_message"
    empty = [*USER, {"role": "assistant", "content": ""}]
    body = {"messages": empty, "add_generation_prompt": False, "continue_final_message": True}
    assert_error(call(app, "POST", "/tokenize", json=body), 400, "final message")


class RecordingTokenizer:
    """The tokenizer, noting the `add_special_tokens` of each `encode`."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.add_special_tokens: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.add_special_tokens.append(add_special_tokens)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_special_tokens_default_per_form(engine: AsyncEngine) -> None:
    """On for a prompt, off for messages (the template writes them), as vLLM has it; either can be asked for."""
    tokenizer = RecordingTokenizer(engine.engine.tokenizer)
    app = build_app(engine, tokenizer, model_name="tiny")
    for body in (
        {"prompt": "x"},
        {"prompt": "x", "add_special_tokens": False},
        {"messages": USER},
        {"messages": USER, "add_special_tokens": True},
    ):
        assert call(app, "POST", "/tokenize", json=body, headers=None).status_code == 200
    assert tokenizer.add_special_tokens == [True, False, False, True]


def test_detokenize_round_trip(app: Any, engine: AsyncEngine) -> None:
    text = 'Un café? {"ok": true} — 42 ✓'
    tokens = tokenize(app, {"prompt": text, "add_special_tokens": False})["tokens"]
    assert call(app, "POST", "/detokenize", json={"model": "tiny", "tokens": tokens}).json() == {
        "prompt": text
    }
    conversation = tokenize(app, {"messages": USER})["tokens"]
    rendered = engine.engine.tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    assert call(app, "POST", "/detokenize", json={"tokens": conversation}).json() == {"prompt": rendered}
    assert call(app, "POST", "/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("bad", [-1, "vocab", 10**30])
def test_out_of_range_ids_are_a_400_naming_tokens(app: Any, engine: AsyncEngine, bad: Any) -> None:
    bad_id = engine.engine.tokenizer.vocab_size if bad == "vocab" else bad
    response = call(app, "POST", "/detokenize", json={"tokens": [1, 2, bad_id]})
    error = assert_error(response, 400, f"tokens[2]: token id {bad_id} is outside the vocabulary")
    assert (error["param"], error["code"]) == ("tokens", "invalid_value")


@pytest.mark.parametrize("tokens", [[1, "2"], [1, 2.0], [True], "12", None])
def test_ids_that_are_no_integers_are_a_400(app: Any, tokens: Any) -> None:
    error = assert_error(call(app, "POST", "/detokenize", json={"tokens": tokens}), 400)
    assert error["param"].startswith("tokens")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({}, "prompt", "give either prompt"),
        ({"prompt": "x", "messages": USER}, "prompt", "not both"),
        ({"prompt": "x", "tools": [WEATHER]}, "tools", "applies to messages"),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "Input should be"),
        ({"messages": USER, "tools": [{"type": "function"}]}, None, ""),
    ],
)
def test_bad_tokenize_bodies_are_a_400(app: Any, body: dict[str, Any], param: str | None, words: str) -> None:
    error = assert_error(call(app, "POST", "/tokenize", json=body), 400, words)
    if param is not None:
        assert error["param"] == param


def test_the_key_guards_both_and_they_sit_at_the_root(app: Any) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert_error(call(app, "POST", path, json=body, headers=None), 401, "API key")
        assert_error(call(app, "POST", path, json=body, headers={"Authorization": "Bearer no"}), 401)
        assert call(app, "POST", path, json=body, headers=AUTH).status_code == 200
        assert call(app, "POST", f"/v1{path}", json=body).status_code == 404


def test_a_wrong_model_is_the_chat_routes_404(app: Any) -> None:
    chat = call(app, "POST", "/v1/chat/completions", json={"model": "gpt-4o", "messages": USER}).json()
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        response = call(app, "POST", path, json=body | {"model": "gpt-4o"})
        assert response.status_code == 404 and response.json() == chat
        assert chat["error"]["code"] == "model_not_found"
