"""The bad-input corpus: malformed and hostile requests, each with the status it must get, and the `param` its
error must name (used by test_bad_inputs.py)."""

from __future__ import annotations

from typing import Any

from bad_input_constants import CHAT, COMPLETIONS, JSON, MSG
from bad_structured_inputs import STRUCTURED_CASES

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

# (id, method, path, request kwargs, expected status). Bodies given as `json` are serialized by httpx; `content`
# is sent as raw bytes.
CASES: list[tuple[str, str, str, dict[str, Any], int]] = [
    # -- not JSON / wrong shape ----------------------------------------------------------------------------
    ("empty body", "POST", CHAT, {"content": b"", "headers": JSON}, 400),
    ("truncated json", "POST", CHAT, {"content": b'{"messages": [', "headers": JSON}, 400),
    ("not json", "POST", CHAT, {"content": b"hello there", "headers": JSON}, 400),
    ("json array body", "POST", CHAT, {"json": [1, 2, 3]}, 400),
    ("json string body", "POST", CHAT, {"json": "messages"}, 400),
    ("json null body", "POST", CHAT, {"content": b"null", "headers": JSON}, 400),
    (
        "invalid utf-8",
        "POST",
        CHAT,
        {"content": b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "headers": JSON},
        400,
    ),
    (
        "NaN literal",
        "POST",
        CHAT,
        {"content": b'{"messages": [{"role":"user","content":"x"}], "temperature": NaN}', "headers": JSON},
        400,
    ),
    (
        "deeply nested body",
        "POST",
        CHAT,
        {"content": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "headers": JSON},
        400,
    ),
    (
        "50 MB body",
        "POST",
        CHAT,
        {"content": b'{"messages": "' + b"a" * (50 * 2**20) + b'"}', "headers": JSON},
        413,
    ),
    # -- messages -------------------------------------------------------------------------------------------
    ("missing messages", "POST", CHAT, {"json": {"model": "tiny"}}, 400),
    ("messages null", "POST", CHAT, {"json": {"messages": None}}, 400),
    ("messages empty", "POST", CHAT, {"json": {"messages": []}}, 400),
    ("messages not a list", "POST", CHAT, {"json": {"messages": "hello"}}, 400),
    ("message not an object", "POST", CHAT, {"json": {"messages": ["hello"]}}, 400),
    ("message without role", "POST", CHAT, {"json": {"messages": [{"content": "hi"}]}}, 400),
    ("unknown role", "POST", CHAT, {"json": {"messages": [{"role": "wizard", "content": "hi"}]}}, 400),
    ("role wrong type", "POST", CHAT, {"json": {"messages": [{"role": 7, "content": "hi"}]}}, 400),
    ("content wrong type", "POST", CHAT, {"json": {"messages": [{"role": "user", "content": 42}]}}, 400),
    (
        "content part unknown",
        "POST",
        CHAT,
        {"json": {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}},
        400,
    ),
    # -- sampling fields ----------------------------------------------------------------------------------
    ("n zero", "POST", CHAT, {"json": {"messages": MSG, "n": 0}}, 400),
    ("n huge", "POST", CHAT, {"json": {"messages": MSG, "n": 1_000_000}}, 400),
    ("n string", "POST", CHAT, {"json": {"messages": MSG, "n": "two"}}, 400),
    ("max_tokens negative", "POST", CHAT, {"json": {"messages": MSG, "max_tokens": -5}}, 400),
    ("max_tokens zero", "POST", CHAT, {"json": {"messages": MSG, "max_tokens": 0}}, 400),
    ("max_tokens huge", "POST", CHAT, {"json": {"messages": MSG, "max_tokens": 10**12}}, 400),
    ("max_tokens float", "POST", CHAT, {"json": {"messages": MSG, "max_tokens": 3.5}}, 400),
    (
        "max_completion_tokens negative",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "max_completion_tokens": -1}},
        400,
    ),
    ("temperature negative", "POST", CHAT, {"json": {"messages": MSG, "temperature": -1}}, 400),
    (
        "temperature infinite",
        "POST",
        CHAT,
        {
            "content": b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}',
            "headers": JSON,
        },
        400,
    ),
    ("temperature string", "POST", CHAT, {"json": {"messages": MSG, "temperature": "hot"}}, 400),
    ("top_p above one", "POST", CHAT, {"json": {"messages": MSG, "top_p": 1.5}}, 400),
    ("top_p zero", "POST", CHAT, {"json": {"messages": MSG, "top_p": 0}}, 400),
    ("top_logprobs without logprobs", "POST", CHAT, {"json": {"messages": MSG, "top_logprobs": 3}}, 400),
    (
        "top_logprobs huge",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "logprobs": True, "top_logprobs": 10_000}},
        400,
    ),
    ("seed string", "POST", CHAT, {"json": {"messages": MSG, "seed": "abc"}}, 400),
    # OpenAI's ranges, checked before any work starts (the offline API keeps vLLM's wider ones).
    ("temperature above two", "POST", CHAT, {"json": {"messages": MSG, "temperature": 2.5}}, 400),
    ("temperature 50 without max_tokens", "POST", CHAT, {"json": {"messages": MSG, "temperature": 50}}, 400),
    ("n above 128", "POST", CHAT, {"json": {"messages": MSG, "n": 129}}, 400),
    (
        "top_logprobs 21",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "logprobs": True, "top_logprobs": 21}},
        400,
    ),
    (
        "top_logprobs negative",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "logprobs": True, "top_logprobs": -1}},
        400,
    ),
    ("presence_penalty above two", "POST", CHAT, {"json": {"messages": MSG, "presence_penalty": 2.5}}, 400),
    (
        "frequency_penalty below minus two",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "frequency_penalty": -3}},
        400,
    ),
    # Strictly typed: never coerced to what the field wants.
    ("stream string yes", "POST", CHAT, {"json": {"messages": MSG, "stream": "yes"}}, 400),
    ("stream integer", "POST", CHAT, {"json": {"messages": MSG, "stream": 1}}, 400),
    ("n numeric string", "POST", CHAT, {"json": {"messages": MSG, "n": "2"}}, 400),
    ("max_tokens numeric string", "POST", CHAT, {"json": {"messages": MSG, "max_tokens": "10"}}, 400),
    ("temperature numeric string", "POST", CHAT, {"json": {"messages": MSG, "temperature": "0.5"}}, 400),
    ("logprobs string", "POST", CHAT, {"json": {"messages": MSG, "logprobs": "true"}}, 400),
    ("ignore_eos string", "POST", CHAT, {"json": {"messages": MSG, "ignore_eos": "false"}}, 400),
    (
        "include_usage string",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "stream": True, "stream_options": {"include_usage": "yes"}}},
        400,
    ),
    ("stop wrong type", "POST", CHAT, {"json": {"messages": MSG, "stop": 12}}, 400),
    ("stream wrong type", "POST", CHAT, {"json": {"messages": MSG, "stream": {"on": True}}}, 400),
    (
        "prompt over the context",
        "POST",
        CHAT,
        {"json": {"messages": [{"role": "user", "content": "word " * 200_000}], "max_tokens": 4}},
        400,
    ),
    # -- response_format / structured outputs: bad_structured_inputs.py
    *STRUCTURED_CASES,
    # -- tools -------------------------------------------------------------------------------------------
    (
        "tool_choice names a missing tool",
        "POST",
        CHAT,
        {
            "json": {
                "messages": MSG,
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            }
        },
        400,
    ),
    (
        "tool_choice required without tools",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "tool_choice": "required"}},
        400,
    ),
    (
        "tool_choice unknown string",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "tools": [TOOL], "tool_choice": "sometimes"}},
        400,
    ),
    ("tools not a list", "POST", CHAT, {"json": {"messages": MSG, "tools": {"a": 1}}}, 400),
    (
        "tool without name",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "tools": [{"type": "function", "function": {}}]}},
        400,
    ),
    (
        "tool parameters with file ref",
        "POST",
        CHAT,
        {
            "json": {
                "messages": MSG,
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"$ref": "file:///etc/passwd"}},
                    }
                ],
                "tool_choice": "required",
            }
        },
        400,
    ),
    # -- completions ---------------------------------------------------------------------------------------
    ("completions missing prompt", "POST", COMPLETIONS, {"json": {"max_tokens": 4}}, 400),
    ("completions prompt wrong type", "POST", COMPLETIONS, {"json": {"prompt": {"text": "hi"}}}, 400),
    ("completions empty prompt list", "POST", COMPLETIONS, {"json": {"prompt": []}}, 400),
    (
        "completions token ids out of vocab",
        "POST",
        COMPLETIONS,
        {"json": {"prompt": [10**9], "max_tokens": 2}},
        400,
    ),
    (
        "completions negative token id",
        "POST",
        COMPLETIONS,
        {"json": {"prompt": [-1, 5], "max_tokens": 2}},
        400,
    ),
    ("completions echo with bad max", "POST", COMPLETIONS, {"json": {"prompt": "hi", "max_tokens": -3}}, 400),
    ("completions logprobs 6", "POST", COMPLETIONS, {"json": {"prompt": "hi", "logprobs": 6}}, 400),
    ("completions logprobs negative", "POST", COMPLETIONS, {"json": {"prompt": "hi", "logprobs": -1}}, 400),
    ("completions echo string", "POST", COMPLETIONS, {"json": {"prompt": "hi", "echo": "true"}}, 400),
    (
        "completions max_tokens string",
        "POST",
        COMPLETIONS,
        {"json": {"prompt": "hi", "max_tokens": "16"}},
        400,
    ),
    # -- routing and auth -------------------------------------------------------------------------------------
    ("unknown route", "POST", "/v1/embeddings", {"json": {"input": "x"}}, 404),
    ("wrong method", "GET", CHAT, {}, 405),
    ("no api key", "POST", CHAT, {"json": {"messages": MSG}, "auth": None}, 401),
    ("wrong api key", "POST", CHAT, {"json": {"messages": MSG}, "auth": "Bearer nope"}, 401),
]

# The `param` a case's error must name (OpenAI names the offending field; clients show it).
PARAMS = {
    "n zero": "n",
    "n huge": "n",
    "n string": "n",
    "max_tokens negative": "max_tokens",
    "max_tokens float": "max_tokens",
    "temperature negative": "temperature",
    "temperature infinite": "temperature",
    "temperature string": "temperature",
    "top_p above one": "top_p",
    "top_p zero": "top_p",
    "top_logprobs huge": "top_logprobs",
    "seed string": "seed",
    "stop wrong type": "stop",
    "stream wrong type": "stream",
    "temperature above two": "temperature",
    "temperature 50 without max_tokens": "temperature",
    "n above 128": "n",
    "top_logprobs 21": "top_logprobs",
    "top_logprobs negative": "top_logprobs",
    "presence_penalty above two": "presence_penalty",
    "frequency_penalty below minus two": "frequency_penalty",
    "stream string yes": "stream",
    "stream integer": "stream",
    "n numeric string": "n",
    "max_tokens numeric string": "max_tokens",
    "temperature numeric string": "temperature",
    "logprobs string": "logprobs",
    "ignore_eos string": "ignore_eos",
    "include_usage string": "stream_options.include_usage",
    "structured_outputs close_at_budget string": "structured_outputs.close_at_budget",
    "structured_outputs loop_guard number": "structured_outputs.loop_guard",
    "structured_outputs options without a constraint": "structured_outputs",
    "completions logprobs 6": "logprobs",
    "completions logprobs negative": "logprobs",
    "completions echo string": "echo",
    "completions max_tokens string": "max_tokens",
}
