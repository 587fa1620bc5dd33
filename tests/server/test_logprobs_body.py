"""OpenAI's logprobs objects built from sampled tokens (text, bytes, top alternatives and text offsets), an echoed
prompt's legacy object, and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from structgen.engine.outputs import TokenLogprob
from structgen.server.logprobs_body import (
    chat_logprobs,
    completion_logprobs,
    joined_completion_logprobs,
    prompt_completion_logprobs,
    vllm_prompt_logprobs,
)

# Token 3 ends inside a character (its text shows the replacement character, its bytes stay exact).
VOCAB = {1: b"He", 2: b"llo", 3: b" \xc3", 4: b"\xa9"}


class _Bytes:
    def token_bytes(self, token_id: int) -> bytes:
        return VOCAB[token_id]


ENTRIES = [TokenLogprob(1, -0.5, [(1, -0.5), (2, -1.5)]), TokenLogprob(3, -2.0, [])]


def test_chat_logprobs_carry_each_tokens_text_bytes_and_alternatives() -> None:
    body = chat_logprobs(_Bytes(), ENTRIES)
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


def test_completion_logprobs_count_offsets_from_where_the_text_starts() -> None:
    body = completion_logprobs(_Bytes(), ENTRIES, offset=7)
    assert body["tokens"] == ["He", " \ufffd"]
    assert body["token_logprobs"] == [-0.5, -2.0]
    assert body["top_logprobs"] == [{"He": -0.5, "llo": -1.5}, {}]
    assert body["text_offset"] == [7, 9]


# An echoed prompt "He" "llo" " \xc3": nothing precedes its first token; "llo" ranks 2nd after "He".
PROMPT_IDS = [1, 2, 3]
PROMPT_ENTRIES = [
    None,
    TokenLogprob(2, -1.5, [(1, -0.5), (2, -1.5), (4, -3.0)], rank=2),
    TokenLogprob(3, -4.0, [(1, -0.25), (2, -2.0), (4, -3.5)], rank=7),
]


def test_an_echoed_prompt_has_null_first_entries_and_the_asked_alternatives() -> None:
    body = prompt_completion_logprobs(_Bytes(), PROMPT_IDS, PROMPT_ENTRIES, top=2)
    assert body["tokens"] == ["He", "llo", " \ufffd"]
    assert body["token_logprobs"] == [None, -1.5, -4.0]
    # The engine scored 3 alternatives (for vLLM's `prompt_logprobs`); the legacy object shows the 2 asked for.
    assert body["top_logprobs"] == [None, {"He": -0.5, "llo": -1.5}, {"He": -0.25, "llo": -2.0}]
    assert body["text_offset"] == [0, 2, 5]
    sampled = completion_logprobs(_Bytes(), ENTRIES, offset=7)
    both = joined_completion_logprobs(body, sampled)
    assert both["tokens"] == body["tokens"] + sampled["tokens"]
    assert both["text_offset"] == [0, 2, 5, 7, 9]
    assert both["token_logprobs"] == [None, -1.5, -4.0, -0.5, -2.0]


def test_vllm_prompt_logprobs_hold_the_prompt_token_with_its_rank_then_the_top_ones() -> None:
    first, second, third = vllm_prompt_logprobs(_Bytes(), PROMPT_ENTRIES, top=2)
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
    assert vllm_prompt_logprobs(_Bytes(), PROMPT_ENTRIES, top=0)[2] == {
        "3": {"logprob": -4.0, "rank": 7, "decoded_token": " \ufffd"}
    }
