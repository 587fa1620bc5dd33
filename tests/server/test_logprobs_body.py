"""OpenAI's logprobs objects built from sampled tokens (text, bytes, top alternatives and text offsets), an echoed
prompt's legacy object, and vLLM's `prompt_logprobs`; -inf logprobs as -9999.0; text offsets against the real
text (characters split over tokens, skipped special tokens, a BOS only the tokens have, a stop string's cut),
the same whether the tokens come at once or streamed."""

from __future__ import annotations

import json
import math

import pytest

from structgen.engine.outputs import TokenLogprob
from structgen.server.logprobs_body import (
    MIN_LOGPROB,
    SampledOffsets,
    chat_logprobs,
    completion_logprobs,
    joined_completion_logprobs,
    prompt_completion_logprobs,
    prompt_offsets,
    vllm_prompt_logprobs,
)
from structgen.tokenizer import StopChecker

# Token 3 ends inside a character (its text shows the replacement character, its bytes stay exact); 4 ends it.
# 5 is a special token (left out of sampled text), 6 a BOS-like one; ids from 9 on are past the vocabulary.
VOCAB = {1: b"He", 2: b"llo", 3: b" \xc3", 4: b"\xa9", 5: b"<|end|>", 6: b"<s>", 7: b" world", 8: b"!"}
SPECIAL = frozenset({5, 6})


class _Bytes:
    all_special_ids = SPECIAL
    vocab_size = 9

    def token_bytes(self, token_id: int) -> bytes:
        if token_id not in VOCAB:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        return VOCAB[token_id]


TOKENIZER = _Bytes()
ENTRIES = [TokenLogprob(1, -0.5, [(1, -0.5), (2, -1.5)]), TokenLogprob(3, -2.0, [])]


def test_chat_logprobs_carry_each_tokens_text_bytes_and_alternatives() -> None:
    body = chat_logprobs(TOKENIZER, ENTRIES)
    assert body["refusal"] is None
    first, second = body["content"]
    assert first == {
        "token": "He",
        "logprob": -0.5,
        "bytes": [72, 101],
        "top_logprobs": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
            {"token": "llo", "logprob": -1.5, "bytes": [108, 108, 111]},
        ],
    }
    assert second["token"] == " \ufffd" and second["bytes"] == [32, 0xC3] and second["top_logprobs"] == []


def test_chat_top_logprobs_stay_the_best_ones_without_the_sampled_token() -> None:
    # OpenAI's chat lists exactly `top_logprobs` alternatives; the sampled token is not added to them.
    entry = TokenLogprob(7, -3.0, [(1, -0.5), (2, -1.5)])
    (content,) = chat_logprobs(TOKENIZER, [entry])["content"]
    assert [t["token"] for t in content["top_logprobs"]] == ["He", "llo"]


def test_completion_top_logprobs_hold_the_chosen_token_first_then_the_best_ones() -> None:
    # vLLM's completions (and OpenAI's legacy API): up to `logprobs + 1` entries, the chosen token's own.
    entries = [
        TokenLogprob(7, -3.0, [(1, -0.5), (2, -1.5)]),  # not among the best: one more entry
        TokenLogprob(2, -1.5, [(1, -0.5), (2, -1.5)]),  # among them: listed once
        TokenLogprob(1, -0.25, []),  # `logprobs: 0`: the chosen token alone
    ]
    body = completion_logprobs(TOKENIZER, entries, [0, 6, 9])
    assert body["top_logprobs"] == [
        {" world": -3.0, "He": -0.5, "llo": -1.5},
        {"llo": -1.5, "He": -0.5},
        {"He": -0.25},
    ]
    assert [list(top) for top in body["top_logprobs"]] == [[" world", "He", "llo"], ["llo", "He"], ["He"]]
    for token, logprob, top in zip(body["tokens"], body["token_logprobs"], body["top_logprobs"], strict=True):
        assert top[token] == logprob  # lm-evaluation-harness' is_greedy: max(top.values()) == logprob
    assert body["text_offset"] == [0, 6, 9]


def test_a_chosen_token_shares_its_text_with_a_better_one_and_keeps_its_own_logprob() -> None:
    # Two byte tokens both show U+FFFD: the chosen one's entry is its own logprob (keyed by text, one entry).
    entry = TokenLogprob(3, -4.0, [(4, -0.5), (1, -1.0)])
    vocab = VOCAB | {4: b" \xc4"}

    class Collide(_Bytes):
        def token_bytes(self, token_id: int) -> bytes:
            return vocab[token_id]

    (top,) = completion_logprobs(Collide(), [entry], [0])["top_logprobs"]
    assert top == {" \ufffd": -4.0, "He": -1.0}


# An echoed prompt "He" "llo" " \xc3": nothing precedes its first token; "llo" ranks 2nd after "He".
PROMPT_IDS = [1, 2, 3]
PROMPT_ENTRIES = [
    None,
    TokenLogprob(2, -1.5, [(1, -0.5), (2, -1.5), (4, -3.0)], rank=2),
    TokenLogprob(3, -4.0, [(1, -0.25), (2, -2.0), (4, -3.5)], rank=7),
]


def test_an_echoed_prompt_has_null_first_entries_and_the_asked_alternatives_with_its_token() -> None:
    text = "Hello \ufffd"
    offsets = prompt_offsets(TOKENIZER, PROMPT_IDS, text)
    assert offsets == [0, 2, 5]
    body = prompt_completion_logprobs(TOKENIZER, PROMPT_IDS, PROMPT_ENTRIES, offsets, top=2)
    assert body["tokens"] == ["He", "llo", " \ufffd"]
    assert body["token_logprobs"] == [None, -1.5, -4.0]
    # The engine scored 3 alternatives (for vLLM's `prompt_logprobs`); the legacy object shows the 2 asked
    # for, and the prompt's own token where it is not among them.
    assert body["top_logprobs"] == [
        None,
        {"llo": -1.5, "He": -0.5},
        {" \ufffd": -4.0, "He": -0.25, "llo": -2.0},
    ]
    sampled = completion_logprobs(TOKENIZER, ENTRIES, [7, 9])
    both = joined_completion_logprobs(body, sampled)
    assert both["tokens"] == body["tokens"] + sampled["tokens"]
    assert both["text_offset"] == [0, 2, 5, 7, 9]
    assert both["token_logprobs"] == [None, -1.5, -4.0, -0.5, -2.0]
    assert prompt_completion_logprobs(TOKENIZER, PROMPT_IDS, PROMPT_ENTRIES, offsets, top=0)[
        "top_logprobs"
    ] == [None, {"llo": -1.5}, {" \ufffd": -4.0}]
    with pytest.raises(ValueError, match="offsets"):
        prompt_completion_logprobs(TOKENIZER, PROMPT_IDS, PROMPT_ENTRIES, offsets[:2], top=0)


def test_vllm_prompt_logprobs_hold_the_prompt_token_with_its_rank_then_the_top_ones() -> None:
    first, second, third = vllm_prompt_logprobs(TOKENIZER, PROMPT_ENTRIES, top=2)
    assert first is None
    # The prompt token is among the top ones: one entry, with its own rank.
    assert second == {
        "2": {"logprob": -1.5, "rank": 2, "decoded_token": "llo"},
        "1": {"logprob": -0.5, "rank": 1, "decoded_token": "He"},
    }
    assert list(second) == ["2", "1"]  # the prompt token first, as vLLM lists it
    assert third == {
        "3": {"logprob": -4.0, "rank": 7, "decoded_token": " \ufffd"},
        "1": {"logprob": -0.25, "rank": 1, "decoded_token": "He"},
        "2": {"logprob": -2.0, "rank": 2, "decoded_token": "llo"},
    }
    assert vllm_prompt_logprobs(TOKENIZER, PROMPT_ENTRIES, top=0)[2] == {
        "3": {"logprob": -4.0, "rank": 7, "decoded_token": " \ufffd"}
    }


# -- -inf -----------------------------------------------------------------------------------------------------


def test_minus_infinity_goes_out_as_minus_9999_in_every_body() -> None:
    """A token the model cannot produce (a padded embedding row, id 9 here, which has no text either) scores
    -inf: JSON has no infinities, so every body sends vLLM's -9999.0 and stays valid strict JSON."""
    impossible = TokenLogprob(9, -math.inf, [(1, -0.5), (2, -math.inf)], rank=12)
    chat = chat_logprobs(TOKENIZER, [impossible])
    legacy = completion_logprobs(TOKENIZER, [impossible], [0])
    echoed = prompt_completion_logprobs(TOKENIZER, [1, 9], [None, impossible], [0, 2], top=2)
    vllm = vllm_prompt_logprobs(TOKENIZER, [None, impossible], top=2)
    for body in (chat, legacy, echoed, vllm):
        json.dumps(body, allow_nan=False)  # raises on an infinity
    (content,) = chat["content"]
    assert content["token"] == "" and content["bytes"] == [] and content["logprob"] == MIN_LOGPROB
    assert [t["logprob"] for t in content["top_logprobs"]] == [-0.5, MIN_LOGPROB]
    assert legacy["token_logprobs"] == [MIN_LOGPROB] and legacy["tokens"] == [""]
    assert legacy["top_logprobs"] == [{"": MIN_LOGPROB, "He": -0.5, "llo": MIN_LOGPROB}]
    assert echoed["token_logprobs"] == [None, MIN_LOGPROB]
    assert vllm[1] == {
        "9": {"logprob": MIN_LOGPROB, "rank": 12, "decoded_token": ""},
        "1": {"logprob": -0.5, "rank": 1, "decoded_token": "He"},
        "2": {"logprob": MIN_LOGPROB, "rank": 2, "decoded_token": "llo"},
    }


# -- text offsets ---------------------------------------------------------------------------------------------


def sampled_offsets(token_ids: list[int], text: str, *, start: int = 0, skip: bool = True) -> list[int]:
    places = SampledOffsets(TOKENIZER, start=start, skip_special_tokens=skip)
    places.push(token_ids)
    return places.settled(text)


def test_a_character_split_over_tokens_is_one_character_of_the_text() -> None:
    # "He" "llo" " \xc3" "\xa9" " world": "Hello é world"; token 4 continues the "é" token 3 began.
    ids = [1, 2, 3, 4, 7]
    text = "Hello é world"
    assert sampled_offsets(ids, text) == [0, 2, 5, 6, 7]
    assert sampled_offsets(ids, text, start=4) == [4, 6, 9, 10, 11]
    assert prompt_offsets(TOKENIZER, ids, text) == [0, 2, 5, 6, 7]
    # Summing token texts (" \ufffd" and "\ufffd" are 2 and 1 characters) would put " world" at 8.


def test_special_tokens_sit_where_the_text_has_them() -> None:
    # Sampled text leaves special tokens out (the engine's skip_special_tokens): no place of their own.
    assert sampled_offsets([1, 5, 2, 8], "Hello!") == [0, 2, 2, 5]
    # Kept (a token prompt is echoed with them, as vLLM decodes it): they have their text.
    assert sampled_offsets([1, 5, 2], "He<|end|>llo", skip=False) == [0, 2, 9]
    assert prompt_offsets(TOKENIZER, [6, 1, 5, 2], "<s>He<|end|>llo") == [0, 3, 5, 12]
    # A BOS the tokenizer added to a text prompt is not in the prompt's text: it sits at its start.
    assert prompt_offsets(TOKENIZER, [6, 1, 2, 7], "Hello world") == [0, 0, 2, 5]
    # An id past the vocabulary (a padded embedding row) has no text.
    assert prompt_offsets(TOKENIZER, [1, 9, 2], "Hello") == [0, 2, 2]


def test_a_text_that_differs_inside_keeps_the_offsets_monotone_and_inside_it() -> None:
    # Sentencepiece's decode drops the first token's leading space: the rest still lines up.
    assert prompt_offsets(TOKENIZER, [7, 8, 7], "world! world") == [0, 5, 6]
    # A text that shares nothing with the tokens: offsets stay in order and within it.
    offsets = prompt_offsets(TOKENIZER, [1, 2, 7, 8], "xyz")
    assert offsets == sorted(offsets) and all(0 <= o <= 3 for o in offsets)


def test_a_stop_string_that_cuts_the_text_leaves_no_offset_past_its_end() -> None:
    # "Hello world!" stopped at "o w": the text is "Hell"; " world" began inside the cut.
    assert sampled_offsets([1, 2, 7, 8], "Hell", start=3) == [3, 5, 7, 7]


def stream(token_ids: list[int], stop: list[str]) -> tuple[str, list[int], list[list[int]]]:
    """The engine's text of these sampled tokens one by one (held back where it may start a stop string) and the
    offsets a stream sends with each chunk, as `streaming.completion_chunks` sends them: a chunk per step whose
    text grew, and the last."""
    checker = StopChecker(stop)
    text = ""
    places = SampledOffsets(TOKENIZER)
    sent = 0
    chunks = []
    pieces = {t: VOCAB[t].decode("utf-8", errors="replace") for t in token_ids}
    for step, token_id in enumerate(token_ids):
        last = step == len(token_ids) - 1
        delta, matched = checker.push(pieces[token_id])
        delta += checker.flush() if last and matched is None else ""
        text += delta
        if delta or last or matched is not None:
            places.push(token_ids[len(places) : step + 1])
            settled = places.settled(text, since=sent, finished=last or matched is not None)
            chunks.append(settled)
            sent += len(settled)
        if matched is not None:
            break
    return text, [o for chunk in chunks for o in chunk], chunks


@pytest.mark.parametrize(
    ("token_ids", "stop"),
    [
        ([1, 2, 7, 8, 1], []),
        ([1, 2, 7, 8, 1], ["o w"]),  # cut inside "llo", completed by " world"
        ([1, 2, 2, 7, 8], ["olloX"]),  # held back over two tokens, then released
        ([1, 8, 8, 8, 2], ["!!!?"]),  # "!" "!" "!" held, released by "llo"
        (
            [1, 8, 8, 8, 8],
            ["!!?"],
        ),  # "!!" held; the third "!" lets the first go while the hold still spans two
    ],
)
def test_a_stream_sends_the_offsets_the_whole_answer_has(token_ids: list[int], stop: list[str]) -> None:
    text, streamed, chunks = stream(token_ids, stop)
    count = sum(len(c) for c in chunks)
    assert streamed == sampled_offsets(token_ids[:count], text)
    assert streamed == sorted(streamed) and all(o <= len(text) for o in streamed)


def test_a_stream_holds_back_an_entry_whose_place_is_not_settled() -> None:
    # "He" then "!" x4 with stop "!!?": the third "!" releases the first, so the text is "He!" while the second
    # and third are held; the third starts at 4, past that text: its entry waits (sent with the text's end
    # it would have been 3) and goes with the last chunk.
    text, streamed, chunks = stream([1, 8, 8, 8, 8], ["!!?"])
    assert text == "He!!!!"
    assert chunks == [[0], [2, 3], [4, 5]]
    assert streamed == sampled_offsets([1, 8, 8, 8, 8], text)
