"""OpenAI's logprobs objects built from sampled tokens: text, bytes, top alternatives and text offsets."""

from __future__ import annotations

from structgen.engine.outputs import TokenLogprob
from structgen.server.logprobs_body import chat_logprobs, completion_logprobs

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
