"""Prompt logprobs over HTTP, on `tiny`: completions' `echo` with `logprobs` (the legacy object covers the prompt,
then the sampled tokens), `max_tokens: 0` with `echo` (score the prompt, generate nothing: lm-evaluation-harness'
loglikelihood call), plain and streamed, and vLLM's `prompt_logprobs` on completions and chat; the refusals; and
that scoring a greedy continuation gives back the logprobs it was sampled with."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from server_helpers import KEY, USER, assert_error, call, sse_events

from structgen.engine.async_engine import AsyncEngine
from structgen.sampling_params import SamplingParams
from structgen.server import build_app

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = "The quick brown fox jumps over the lazy dog"
OTHER = "Once upon a time"
# Greedy (each token the most likely) and long enough to run past any stop.
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    return build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY)


def tolerance(engine: AsyncEngine) -> float:
    """How far a prompt position's logprob and a decode step's of the same token may be apart: float32 (CPUs
    without bf16 in hardware) agrees to ~1e-5; bf16 rounds the two paths' activations differently (~8e-3 seen)."""
    return 1e-3 if engine.engine.runner.dtype == torch.float32 else 2e-2


def text_of(engine: AsyncEngine, token_id: int) -> str:
    return engine.engine.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def prompt_ids(engine: AsyncEngine, prompt: str) -> list[int]:
    return engine.engine.tokenizer.encode(prompt)


def completion(app: Any, **body: Any) -> dict[str, Any]:
    response = call(app, "POST", COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def assert_prompt_part(engine: AsyncEngine, logprobs: dict[str, Any], prompt: str, top: int) -> None:
    """The legacy object's first entries are the prompt's tokens: no logprob for the first, then each token's
    logprob with the `top` most likely tokens there and the prompt's own token (vLLM's and OpenAI's legacy
    `logprobs + 1`), listed first with its own logprob."""
    ids = prompt_ids(engine, prompt)
    count = len(ids)
    assert logprobs["tokens"][:count] == [text_of(engine, t) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for token, logprob, alternatives in zip(
        logprobs["tokens"][1:count],
        logprobs["token_logprobs"][1:count],
        logprobs["top_logprobs"][1:count],
        strict=True,
    ):
        assert logprob <= 0 and 1 <= len(alternatives) <= top + 1
        assert next(iter(alternatives)) == token and alternatives[token] == logprob
        assert max(alternatives.values()) >= logprob
    offsets = logprobs["text_offset"][:count]
    assert offsets[0] == 0
    for offset, token in zip(offsets, logprobs["tokens"][:count], strict=True):
        assert prompt[offset : offset + len(token)] == token  # ASCII prompts: offsets point at each token


# -- echo with logprobs ---------------------------------------------------------------------------------------


def test_echo_with_logprobs_covers_the_prompt_then_the_sampled_tokens(app: Any, engine: AsyncEngine) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 2} | GREEDY
    data = completion(app, **body)
    (choice,) = data["choices"]
    count = data["usage"]["prompt_tokens"]
    assert count == len(prompt_ids(engine, PROMPT)) and data["usage"]["completion_tokens"] == 3
    logprobs = choice["logprobs"]
    assert all(len(logprobs[key]) == count + 3 for key in logprobs)
    assert_prompt_part(engine, logprobs, PROMPT, top=2)
    assert choice["text"].startswith(PROMPT)
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[count] == len(PROMPT)
    # The sampled part is what the same request answers without echo.
    plain = completion(app, **body | {"echo": False})["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    assert logprobs["tokens"][count:] == plain["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][count:] == pytest.approx(
        plain["logprobs"]["token_logprobs"], abs=tolerance(engine)
    )
    assert [o - len(PROMPT) for o in offsets[count:]] == plain["logprobs"]["text_offset"]
    assert "prompt_logprobs" not in choice  # vLLM's field only when asked for


def test_each_choice_echoes_its_own_prompt_and_its_logprobs(app: Any, engine: AsyncEngine) -> None:
    body = {"prompt": [PROMPT, OTHER], "n": 2, "max_tokens": 2, "echo": True, "logprobs": 1, "seed": 5}
    data = completion(app, **body, temperature=0.8, ignore_eos=True)
    choices = sorted(data["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for choice, prompt in zip(choices, [PROMPT, PROMPT, OTHER, OTHER], strict=True):
        assert choice["text"].startswith(prompt)
        assert len(choice["logprobs"]["tokens"]) == len(prompt_ids(engine, prompt)) + 2
        assert_prompt_part(engine, choice["logprobs"], prompt, top=1)
    # Samples of one prompt share its scored prompt.
    count = len(prompt_ids(engine, PROMPT))
    first, second = (c["logprobs"] for c in choices[:2])
    assert first["token_logprobs"][:count] == second["token_logprobs"][:count]
    assert data["usage"]["completion_tokens"] == 4 * 2


# -- max_tokens 0 ---------------------------------------------------------------------------------------------


def test_max_tokens_0_with_echo_scores_the_prompt_and_generates_nothing(
    app: Any, engine: AsyncEngine
) -> None:
    count = len(prompt_ids(engine, PROMPT))
    data = completion(app, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    (choice,) = data["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == count
    assert_prompt_part(engine, choice["logprobs"], PROMPT, top=1)
    assert data["usage"] == {"prompt_tokens": count, "completion_tokens": 0, "total_tokens": count}
    # Without logprobs: the prompt alone; a token prompt echoes as its text.
    bare = completion(app, prompt=PROMPT, max_tokens=0, echo=True)["choices"][0]
    assert bare["text"] == PROMPT and bare["logprobs"] is None and bare["finish_reason"] == "length"
    ids = prompt_ids(engine, OTHER)
    tokens = completion(app, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert tokens["choices"][0]["text"] == OTHER
    assert tokens["choices"][0]["logprobs"]["tokens"] == [text_of(engine, t) for t in ids]
    # `logprobs: 0`: each position lists the prompt's own token alone, as vLLM answers.
    echoed = tokens["choices"][0]["logprobs"]
    assert echoed["top_logprobs"][1:] == [
        {text_of(engine, t): lp} for t, lp in zip(ids[1:], echoed["token_logprobs"][1:], strict=True)
    ]
    assert tokens["usage"]["completion_tokens"] == 0


# -- streaming ------------------------------------------------------------------------------------------------


def test_a_streamed_echo_sends_the_prompts_logprobs_first(app: Any, engine: AsyncEngine) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 2} | GREEDY
    plain = completion(app, **body)["choices"][0]
    events = sse_events(call(app, "POST", COMPLETIONS, json=body | {"stream": True}))
    choices = [e["choices"][0] for e in events]
    echoed = choices[0]
    assert echoed["text"] == PROMPT and echoed["finish_reason"] is None
    assert len(echoed["logprobs"]["tokens"]) == len(prompt_ids(engine, PROMPT))
    assert_prompt_part(engine, echoed["logprobs"], PROMPT, top=2)
    assert "".join(c["text"] for c in choices) == plain["text"]
    streamed = {
        key: [v for c in choices if c["logprobs"] for v in c["logprobs"][key]] for key in plain["logprobs"]
    }
    assert streamed["tokens"] == plain["logprobs"]["tokens"]
    assert (
        streamed["text_offset"] == plain["logprobs"]["text_offset"]
    )  # the sampled ones go on after the prompt
    count = len(echoed["logprobs"]["tokens"])
    assert streamed["token_logprobs"][count:] == pytest.approx(
        plain["logprobs"]["token_logprobs"][count:], abs=tolerance(engine)
    )


def test_a_streamed_max_tokens_0_echoes_the_prompt_alone(app: Any) -> None:
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True}
    body["stream_options"] = {"include_usage": True}
    events = sse_events(call(app, "POST", COMPLETIONS, json=body))
    usage = events[-1]["usage"]
    choices = [e["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in choices) == PROMPT
    assert choices[-1]["finish_reason"] == "length"
    assert sum(len(c["logprobs"]["tokens"]) for c in choices) == usage["prompt_tokens"]
    assert usage["completion_tokens"] == 0


# -- vLLM's prompt_logprobs -----------------------------------------------------------------------------------


def assert_vllm_positions(engine: AsyncEngine, positions: list[Any], ids: list[int], top: int) -> None:
    """vLLM's shape: null first, then per position the prompt token (with its rank) and the `top` best."""
    assert len(positions) == len(ids) and positions[0] is None
    for token_id, position in zip(ids[1:], positions[1:], strict=True):
        own = position[str(token_id)]
        assert own["decoded_token"] == text_of(engine, token_id)
        assert isinstance(own["rank"], int) and own["rank"] >= 1 and own["logprob"] <= 0
        others = {k: v for k, v in position.items() if k != str(token_id)}
        assert len(position) == top + (own["rank"] > top)
        assert sorted(v["rank"] for v in others.values()) == [
            r for r in range(1, top + 1) if r != own["rank"]
        ]
        assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in others.values())


def test_prompt_logprobs_on_completions_agree_with_the_echoed_ones(app: Any, engine: AsyncEngine) -> None:
    body = {"prompt": [PROMPT, OTHER], "max_tokens": 1, "prompt_logprobs": 3, "echo": True, "logprobs": 1}
    data = completion(app, **body)
    for choice, prompt in zip(data["choices"], [PROMPT, OTHER], strict=True):
        ids = prompt_ids(engine, prompt)
        assert_vllm_positions(engine, choice["prompt_logprobs"], ids, top=3)
        own = [p[str(t)]["logprob"] for t, p in zip(ids[1:], choice["prompt_logprobs"][1:], strict=True)]
        assert choice["logprobs"]["token_logprobs"][1 : len(ids)] == own
        assert_prompt_part(engine, choice["logprobs"], prompt, top=1)  # `logprobs` keeps its own count
    # Without echo: the prompt is scored all the same, and the choice has no legacy logprobs.
    plain = completion(app, prompt=PROMPT, max_tokens=1, prompt_logprobs=0)["choices"][0]
    assert_vllm_positions(engine, plain["prompt_logprobs"], prompt_ids(engine, PROMPT), top=0)
    assert plain["logprobs"] is None
    assert "prompt_logprobs" not in completion(app, prompt=PROMPT, max_tokens=1)["choices"][0]


def test_prompt_logprobs_on_chat_are_the_rendered_conversations(app: Any, engine: AsyncEngine) -> None:
    response = call(app, "POST", CHAT, json={"messages": USER, "max_tokens": 2, "prompt_logprobs": 2})
    assert response.status_code == 200, response.text
    data = response.json()
    ids = engine.engine.tokenizer.encode_chat(USER)
    assert data["usage"]["prompt_tokens"] == len(ids)
    assert_vllm_positions(engine, data["prompt_logprobs"], ids, top=2)
    assert "prompt_logprobs" not in data["choices"][0]
    plain = call(app, "POST", CHAT, json={"messages": USER, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain


# -- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fields", "param", "words"),
    [
        (COMPLETIONS, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when stream"),
        (CHAT, {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs", "not available when stream"),
        (COMPLETIONS, {"prompt_logprobs": 21}, "prompt_logprobs", "20"),
        (CHAT, {"prompt_logprobs": -1}, "prompt_logprobs", "0"),
        (COMPLETIONS, {"prompt_logprobs": "2"}, "prompt_logprobs", ""),
        (COMPLETIONS, {"max_tokens": 0}, "max_tokens", "echo"),
        (COMPLETIONS, {"max_tokens": 0, "echo": False, "logprobs": 1}, "max_tokens", "echo"),
        (COMPLETIONS, {"max_tokens": -1, "echo": True}, "max_tokens", ""),
        (CHAT, {"max_tokens": 0}, "max_tokens", ""),
    ],
)
def test_refusals_are_400s_naming_the_field(
    app: Any, path: str, fields: dict[str, Any], param: str, words: str
) -> None:
    body = ({"messages": USER} if path == CHAT else {"prompt": PROMPT}) | {"max_tokens": 2} | fields
    error = assert_error(call(app, "POST", path, json=body), 400, words)
    assert error["param"] == param


# -- consistency ----------------------------------------------------------------------------------------------


def test_scoring_a_greedy_continuation_gives_back_its_sampled_logprobs(app: Any, engine: AsyncEngine) -> None:
    """What lm-evaluation-harness relies on: the logprob of a continuation scored as part of the prompt is the
    one the model gave it while generating."""
    k = 4
    ids = prompt_ids(engine, PROMPT)
    generated = completion(app, prompt=ids, max_tokens=k, logprobs=0, **GREEDY)["choices"][0]["logprobs"]

    async def greedy_ids() -> list[
        int
    ]:  # the same continuation's token ids (the legacy object has texts only)
        params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        async for output in engine.generate(ids, params):
            if output.finished:
                return output.outputs[0].token_ids
        raise AssertionError("no finished output")

    continuation = asyncio.run(greedy_ids())
    assert [text_of(engine, t) for t in continuation] == generated["tokens"]
    scored = completion(app, prompt=ids + continuation, max_tokens=0, echo=True, logprobs=0, temperature=0)
    logprobs = scored["choices"][0]["logprobs"]
    assert logprobs["tokens"][-k:] == generated["tokens"]
    assert logprobs["token_logprobs"][-k:] == pytest.approx(
        generated["token_logprobs"], abs=tolerance(engine)
    )
