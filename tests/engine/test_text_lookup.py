"""Prompt lookup by text: the continuation of the output's recent text in the prompt, closed inside a string."""

from __future__ import annotations

from structgen.engine.text_lookup import TextLookup

PROMPT = "Hi, I'm Chloe Larsen, engineering manager. Reach me at chloe.larsen@acme.com or +1 555 0115."


def _lookup() -> TextLookup:
    # One "token" per character keeps the expectations readable.
    return TextLookup.build(lambda text: [ord(c) for c in text])


def _text(tokens: list[int]) -> str:
    return "".join(map(chr, tokens))


def test_the_longest_suffix_found_continues_as_the_prompt_does() -> None:
    tokens, closes = _lookup().propose(PROMPT, '{"name":"Chl', k=6, in_string=False)
    assert _text(tokens) == "oe Lar" and not closes
    tokens, _ = _lookup().propose(PROMPT, '"email":"chloe.lar', k=20, in_string=False)
    assert _text(tokens) == "sen@acme.com or +1 5"  # the email's dots are not where it ends


def test_inside_a_string_the_copy_stops_at_the_prompts_punctuation() -> None:
    tokens, closes = _lookup().propose(PROMPT, '"name":"Chloe', k=10, in_string=True)
    assert _text(tokens) == " Larsen" and closes
    tokens, closes = _lookup().propose(PROMPT, '"phone":"+1 555 01', k=10, in_string=True)
    assert _text(tokens) == "15" and closes  # a full stop at the end: the sentence ends
    tokens, closes = _lookup().propose(PROMPT, '"email":"chloe.lar', k=10, in_string=True)
    assert _text(tokens) == "sen@acme.c" and not closes  # an email's dots are not a sentence's end
    tokens, closes = _lookup().propose(PROMPT, '"name":"Chloe', k=3, in_string=True)
    assert _text(tokens) == " La" and not closes  # the span runs past the proposal: nothing to close yet


def test_nothing_matches_below_the_minimum() -> None:
    assert _lookup().propose(PROMPT, '"x":"Zq', k=4, in_string=True) == ([], False)
    assert _lookup().closings[0] == tuple(map(ord, '",'))
