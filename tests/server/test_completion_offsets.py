"""The legacy `logprobs` object's `text_offset` against the choice's real text, over HTTP on `tiny` (cl100k: "🎉"
is three byte tokens): an echoed text prompt and its sampled tokens, a token prompt holding special tokens and a
padded embedding row (whose -inf logprob goes out as -9999.0), a stop string cutting the text inside a token,
and the streamed chunks carrying the same offsets as the plain answer."""

from __future__ import annotations

from typing import Any

import pytest
from server_helpers import KEY, call, sse_events

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app
from structgen.server.logprobs_body import MIN_LOGPROB

COMPLETIONS = "/v1/completions"
PROMPT = "Café naïve 🎉 über straße"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    return build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY)


def post(app: Any, body: dict[str, Any]) -> dict[str, Any]:
    response = call(app, "POST", COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    # Strict JSON: Python's parser would take `-Infinity`, no client's must.
    assert "Infinity" not in response.text and "NaN" not in response.text
    return response.json()


def streamed(app: Any, body: dict[str, Any]) -> tuple[str, dict[str, list[Any]]]:
    """The streamed choice's text and its logprobs' lists, concatenated over the chunks."""
    response = call(app, "POST", COMPLETIONS, json=body | {"stream": True})
    assert "Infinity" not in response.text
    choices = [e["choices"][0] for e in sse_events(response)]
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return "".join(c["text"] for c in choices), {
        k: [v for c in choices for v in c["logprobs"][k]] for k in keys
    }


def special_texts(engine: AsyncEngine) -> set[str]:
    tokenizer = engine.engine.tokenizer
    return {tokenizer.token_bytes(t).decode() for t in tokenizer.all_special_ids}


def assert_offsets_point_into(text: str, logprobs: dict[str, Any], *, skipped: set[str]) -> int:
    """Offsets in order and inside `text`, and each token's text where it says, wherever that is defined: not a
    piece of a character split over tokens (U+FFFD), not a special token the sampled text leaves out. Returns
    how many tokens were checked so."""
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    checked = 0
    for token, offset in zip(logprobs["tokens"], offsets, strict=True):
        if "\ufffd" in token or token in skipped or not token:
            continue
        assert text[offset:].startswith(token), (token, offset, text[offset : offset + 20])
        checked += 1
    return checked


def part(logprobs: dict[str, Any], begin: int, end: int | None) -> dict[str, Any]:
    return {key: values[begin:end] for key, values in logprobs.items()}


def summed(logprobs: dict[str, Any], start: int = 0) -> list[int]:
    """The offsets summing token texts would give (what they were before they followed the text)."""
    offsets = []
    for token in logprobs["tokens"]:
        offsets.append(start)
        start += len(token)
    return offsets


def test_an_echoed_prompt_with_split_characters_and_its_sampled_tokens(app: Any, engine: AsyncEngine) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "echo": True, "logprobs": 2} | GREEDY
    choice = post(app, body)["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    count = len(engine.engine.tokenizer.encode(PROMPT))
    assert text.startswith(PROMPT) and len(logprobs["tokens"]) == count + 12
    assert "\ufffd" in "".join(logprobs["tokens"][:count])  # the emoji's byte tokens
    checked = assert_offsets_point_into(text, logprobs, skipped=special_texts(engine))
    assert checked >= count - 2
    # The emoji's three tokens: the first starts at its space, the two others inside the emoji itself.
    emoji = PROMPT.index("🎉")
    prompt_part = zip(logprobs["text_offset"][:count], logprobs["tokens"][:count], strict=True)
    pieces = [offset for offset, token in prompt_part if "\ufffd" in token]
    assert pieces == [emoji - 1, emoji, emoji]
    assert logprobs["text_offset"][count] == len(PROMPT)  # the sampled tokens start after the prompt
    assert summed(logprobs) != logprobs["text_offset"]  # summed token texts drift here
    # Without echo: the same sampled tokens and offsets, counted from the sampled text's start.
    plain = post(app, body | {"echo": False})["choices"][0]
    assert plain["logprobs"]["tokens"] == logprobs["tokens"][count:]
    assert plain["logprobs"]["text_offset"] == [o - len(PROMPT) for o in logprobs["text_offset"][count:]]
    # Streamed: the echo's chunk, then the sampled tokens', with the plain answer's offsets.
    stream_text, stream_logprobs = streamed(app, body)
    assert stream_text == text
    assert stream_logprobs["tokens"] == logprobs["tokens"]
    assert stream_logprobs["text_offset"] == logprobs["text_offset"]
    assert stream_logprobs["top_logprobs"][:count] == logprobs["top_logprobs"][:count]


def test_a_token_prompt_with_special_tokens_and_a_padded_row(app: Any, engine: AsyncEngine) -> None:
    """A token prompt echoes with its special tokens (as vLLM decodes it), each at its place. An id past the
    tokenizer (the model's padded embedding rows: the engine takes it) has no text, and the model gives it
    -inf, sent as -9999.0 in the legacy object and in vLLM's `prompt_logprobs`."""
    tokenizer = engine.engine.tokenizer
    bos, im_start = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_start|>")
    padded = tokenizer.vocab_size + 3
    assert padded < engine.engine.vocab_size
    ids = [
        bos,
        *tokenizer.encode("Café 🎉"),
        im_start,
        *tokenizer.encode(" ok"),
        padded,
        *tokenizer.encode("!"),
    ]
    body = {"prompt": ids, "max_tokens": 6, "echo": True, "logprobs": 1, "prompt_logprobs": 1} | GREEDY
    choice = post(app, body)["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    echoed = "<|endoftext|>Café 🎉<|im_start|> ok!"
    assert text.startswith(echoed)
    # The echo holds its special tokens' texts; the sampled text leaves special tokens out.
    count = len(ids)
    checked = assert_offsets_point_into(text, part(logprobs, 0, count), skipped=set())
    assert checked == count - 4  # all but the emoji's 3 byte tokens and the padded row
    assert_offsets_point_into(text, part(logprobs, count, None), skipped=special_texts(engine))
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets[ids.index(im_start)] == echoed.index("<|im_start|>")
    at = ids.index(padded)
    assert logprobs["tokens"][at] == "" and offsets[at] == offsets[at + 1] == echoed.index("!")
    assert logprobs["token_logprobs"][at] == MIN_LOGPROB
    assert logprobs["top_logprobs"][at][""] == MIN_LOGPROB and len(logprobs["top_logprobs"][at]) == 2
    assert logprobs["text_offset"][len(ids)] == len(echoed)
    assert choice["prompt_logprobs"][at][str(padded)]["logprob"] == MIN_LOGPROB
    assert summed(logprobs) != offsets
    # Streamed, the same.
    no_prompt_logprobs = {k: v for k, v in body.items() if k != "prompt_logprobs"}
    stream_text, stream_logprobs = streamed(app, no_prompt_logprobs)
    assert stream_text == text and stream_logprobs["text_offset"] == offsets
    assert stream_logprobs["token_logprobs"][at] == MIN_LOGPROB


def test_a_stop_string_cutting_inside_a_token_leaves_no_offset_past_the_text(app: Any) -> None:
    """A stop string that begins in one token's text and ends in the next cuts the text before the first one
    ends: the next token's offset is the text's end (summing token texts put it past the end)."""
    body = {"prompt": "The quick brown fox", "max_tokens": 16, "logprobs": 1} | GREEDY
    full = post(app, body)["choices"][0]
    tokens, starts, text = full["logprobs"]["tokens"], full["logprobs"]["text_offset"], full["text"]
    found = None
    for k in range(1, len(tokens) - 1):
        this, then = tokens[k], tokens[k + 1]
        if not this or not then or "\ufffd" in this + then:
            continue
        stop = this[-1] + then
        if text.find(stop) == starts[k] + len(this) - 1:
            found = k, stop
            break
    assert found is not None, tokens  # greedy `tiny` output has such a pair
    k, stop = found
    cut = post(app, body | {"stop": [stop]})["choices"][0]
    assert cut["text"] == text[: starts[k] + len(tokens[k]) - 1] and cut["finish_reason"] == "stop"
    logprobs = cut["logprobs"]
    assert logprobs["tokens"] == tokens[: k + 2]
    assert logprobs["text_offset"] == [*starts[: k + 1], len(cut["text"])]
    assert summed(logprobs)[-1] > len(cut["text"])
    stream_text, stream_logprobs = streamed(app, body | {"stop": [stop]})
    assert stream_text == cut["text"] and stream_logprobs["text_offset"] == logprobs["text_offset"]


# -- both tokenizers, and SmolLM2 over HTTP -------------------------------------------------------------------

TEXTS = ["日本語 🎉 émoji ünïcode — “quotes”", "  two  spaces\n\ttab", "Straße 👩‍👩‍👧 ok"]


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2-135m", marks=pytest.mark.slow)])
def test_offsets_follow_each_tokenizers_decoding(model: str) -> None:
    """Token ids with special tokens between texts of split characters: the sampled offsets against the text
    the engine's detokenizer makes of them (special tokens left out), the prompt offsets against the token
    prompt's echo (special tokens kept), each token where its text is."""
    from structgen.models.registry import resolve_model
    from structgen.server.echo import prompt_text
    from structgen.server.logprobs_body import SampledOffsets, prompt_offsets, token_text
    from structgen.tokenizer import IncrementalDetokenizer, Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model(model))
    specials = sorted(tokenizer.all_special_ids)[:3]
    ids = [specials[0]]
    for text, special in zip(TEXTS, specials, strict=True):
        ids += [*tokenizer.encode(text, add_special_tokens=False), special]
    detokenizer = IncrementalDetokenizer(tokenizer)
    engine_text = "".join(detokenizer.push(t) for t in ids) + detokenizer.flush()
    assert engine_text == "".join(TEXTS)
    places = SampledOffsets(tokenizer, start=0)
    places.push(ids)
    echoed = prompt_text(tokenizer, None, ids)
    for text, offsets, skipped in (
        (engine_text, places.settled(engine_text), set(specials)),
        (echoed, prompt_offsets(tokenizer, ids, echoed), set()),
    ):
        assert offsets == sorted(offsets) and offsets[-1] <= len(text)
        split = 0
        for token_id, offset in zip(ids, offsets, strict=True):
            token = token_text(tokenizer, token_id)
            if "\ufffd" in token:
                split += 1
            elif token_id not in skipped:
                assert text[offset:].startswith(token), (token, offset, text[offset : offset + 10])
        assert split >= 3  # the test holds characters split over tokens


@pytest.mark.slow
def test_smollm2_echo_of_a_token_prompt_with_special_tokens(smollm2_engine: AsyncEngine) -> None:
    app = build_app(smollm2_engine, smollm2_engine.engine.tokenizer, model_name="smollm2-135m", api_key=KEY)
    tokenizer = smollm2_engine.engine.tokenizer
    text = "<|im_start|>user\nCafé 🎉 naïve?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text)
    assert tokenizer.token_to_id("<|im_start|>") in ids
    body = {"prompt": ids, "max_tokens": 8, "echo": True, "logprobs": 1} | GREEDY
    choice = post(app, body)["choices"][0]
    assert choice["text"].startswith(text)
    count = len(ids)
    assert_offsets_point_into(choice["text"], part(choice["logprobs"], 0, count), skipped=set())
    assert_offsets_point_into(
        choice["text"], part(choice["logprobs"], count, None), skipped=special_texts(smollm2_engine)
    )
    assert choice["logprobs"]["text_offset"][count] == len(text)
    stream_text, stream_logprobs = streamed(app, body)
    assert (
        stream_text == choice["text"] and stream_logprobs["text_offset"] == choice["logprobs"]["text_offset"]
    )
