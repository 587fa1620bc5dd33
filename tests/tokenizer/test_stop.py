"""StopChecker: stop strings split across deltas are caught and never leak into the stream."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structgen.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer


def _run(checker: StopChecker, deltas: list[str]) -> tuple[list[str], str | None]:
    emitted: list[str] = []
    for delta in deltas:
        text, matched = checker.push(delta)
        emitted.append(text)
        if matched is not None:
            return emitted, matched
    emitted.append(checker.flush())
    return emitted, None


def test_stop_split_across_deltas_never_leaks() -> None:
    checker = StopChecker(["<|end|>"])
    assert checker.push("Hello <") == ("Hello ", None)
    assert checker.pending == "<"
    assert checker.push("|en") == ("", None)
    assert checker.push("d|> trailing") == ("", "<|end|>")
    assert checker.matched == "<|end|>"
    assert checker.push("more") == ("", "<|end|>")  # finished
    assert checker.flush() == ""


def test_include_stop_str_in_output() -> None:
    emitted, matched = _run(StopChecker(["STOP"], include_stop_str_in_output=True), ["abc S", "TO", "P def"])
    assert "".join(emitted) == "abc STOP" and matched == "STOP"


def test_false_start_is_released() -> None:
    checker = StopChecker(["\n\n"])
    assert checker.push("line\n") == ("line", None)
    assert checker.push("next") == ("\nnext", None)
    assert checker.push("\n") == ("", None)
    assert checker.flush() == "\n"  # the end of the stream: it was not a stop after all


def test_earliest_then_longest_stop_wins() -> None:
    emitted, matched = _run(StopChecker(["world", "o w"]), ["hello w", "orld"])
    assert "".join(emitted) == "hell" and matched == "o w"
    emitted, matched = _run(StopChecker(["ab", "abc"]), ["xab", "c"])
    # "ab" completes first, so it matches before "abc" could.
    assert "".join(emitted) == "x" and matched == "ab"
    emitted, matched = _run(StopChecker(["ab", "abc"]), ["xabcd"])
    assert "".join(emitted) == "x" and matched == "abc"


def test_no_stops_passes_everything_through() -> None:
    checker = StopChecker([])
    assert checker.push("any <| text") == ("any <| text", None)


def test_bad_stop_strings_are_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker(["ok", ""])
    with pytest.raises(TypeError, match="must be str"):
        StopChecker([3])  # type: ignore[list-item]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab<|>\n ", max_size=40),
    stops=st.lists(st.text(alphabet="ab<|>\n ", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    include=st.booleans(),
)
def test_stream_equals_reference_truncation(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    emitted, matched = _run(StopChecker(stops, include_stop_str_in_output=include), deltas)

    # Reference: after each delta, look for stops in the whole text so far (no holding back); the first delta
    # that completes one decides, and within it the earliest start wins (the longest stop on a tie).
    seen = ""
    for delta in deltas:
        seen += delta
        hits = [(seen.find(s), -len(s), s) for s in stops if s in seen]
        if hits:
            start, _, stop = min(hits)
            assert matched == stop
            assert "".join(emitted) == text[: start + len(stop) if include else start]
            return
    assert matched is None and "".join(emitted) == text


def test_stop_over_detokenized_stream(tiny_tokenizer: Tokenizer) -> None:
    output = 'Answer: {"a": 1}<tool_call> ignored 🎉'
    ids = tiny_tokenizer.encode(output, add_special_tokens=False)
    detok, checker = IncrementalDetokenizer(tiny_tokenizer), StopChecker(["}<tool", "🎉"])
    shown = []
    for token_id in ids:
        text, matched = checker.push(detok.push(token_id))
        shown.append(text)
        if matched:
            break
    assert "".join(shown) == 'Answer: {"a": 1' and matched == "}<tool"
