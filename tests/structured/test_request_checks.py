"""The sampler's check of a lazy pick takes an allowed one into the request's grammar at once
(`StructuredRequest.take_checked`), with the forced tokens after it, and puts it back where the pick is not
appended: the grammar always holds exactly the output's tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from structured_helpers import allowed_tokens

from structgen.structured import StructuredOutputConfig, StructuredOutputManager, StructuredOutputsParams
from structgen.structured.bitmask import unpack_bitmask
from structgen.structured.logits_processor import StructuredLogitsProcessor
from structgen.structured.request import StructuredRequest


@pytest.fixture()
def manager(info, backends):
    m = StructuredOutputManager(info, backends={"llguidance": backends["llguidance"]})
    yield m
    m.shutdown()


def _deferred_step(manager, info, request):
    from structgen.sampling_params import SamplingParams

    seqs = [SimpleNamespace(grammar=request.grammar, params=SamplingParams(), structured=request)]
    processor = StructuredLogitsProcessor(manager, lambda seq: seq.grammar, defer=True)
    processor.prepare(seqs)
    mask = processor(torch.zeros(1, info.vocab_size), seqs)
    assert mask is not None and list(mask.unfilled) == [0]
    return mask


def _started(manager, schema) -> StructuredRequest:
    request = StructuredRequest(manager, StructuredOutputsParams(json=schema))
    request.future.result(timeout=60)
    request.start()
    return request


def test_a_deferred_rows_check_takes_an_allowed_pick_into_its_grammar_once(manager, info, encode) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    request, twin = _started(manager, schema), _started(manager, schema)
    mask = _deferred_step(manager, info, request)
    brace, letter = encode("{")[0], encode("x")[0]
    assert mask.allows([0], torch.tensor([letter])) == [False]
    assert request.checked_token is None  # a rejected pick leaves the grammar as it was
    assert mask.allows([0], torch.tensor([brace])) == [True]
    assert request.checked_token == brace and request.grammar.validate_tokens([brace]) == 0  # taken
    forced = request.checked_forced  # found with the pick, while the grammar's state is in the caches
    step = request.advance(brace, left=100)
    twin_step = twin.advance(brace, left=100)
    assert request.checked_token is None and request.checked_forced is None
    assert forced and step.tokens[: len(forced)] == forced  # `{` forces `"a":"` (or its first tokens)
    assert step.tokens == twin_step.tokens  # the grammar took the pick once: where it stands is the twin's
    assert torch.equal(
        allowed_tokens(request.grammar, info.vocab_size), allowed_tokens(twin.grammar, info.vocab_size)
    )
    assert request.finisher.scanner.offset == twin.finisher.scanner.offset


def test_a_taken_pick_is_put_back_before_its_row_is_filled_or_another_token_appended(
    manager, info, encode
) -> None:
    request, twin = _started(manager, {"type": "integer"}), _started(manager, {"type": "integer"})
    before = allowed_tokens(request.grammar, info.vocab_size)
    one, two = encode("1")[0], encode("2")[0]
    mask = _deferred_step(manager, info, request)
    assert mask.allows([0], torch.tensor([one])) == [True] and request.checked_token == one
    mask.ensure_filled([0])  # the sampler draws the row again (a batch retried without a dead row)
    assert request.checked_token is None
    assert torch.equal(unpack_bitmask(mask.bitmask[0], info.vocab_size), before)
    assert torch.equal(allowed_tokens(request.grammar, info.vocab_size), before)
    # Taken, then another token appended in its place: the grammar holds that one alone.
    mask = _deferred_step(manager, info, request)
    assert mask.allows([0], torch.tensor([one])) == [True] and request.checked_token == one
    request.advance(two, left=100)
    twin.advance(two, left=100)
    assert request.checked_token is None
    assert request.finisher.scanner.offset == twin.finisher.scanner.offset == 1
    assert torch.equal(
        allowed_tokens(request.grammar, info.vocab_size), allowed_tokens(twin.grammar, info.vocab_size)
    )


def test_a_check_never_takes_eos(manager, info, encode) -> None:
    request = _started(manager, {"type": "integer"})
    request.accept(encode("7"))
    eos = info.eos_token_ids[0]
    mask = _deferred_step(manager, info, request)
    assert mask.allows([0], torch.tensor([eos])) == [True]  # the integer may end here
    assert request.checked_token is None and not request.grammar.is_terminated()


def test_a_check_finds_no_forced_tokens_with_jump_forward_off(info, backends, encode) -> None:
    manager = StructuredOutputManager(
        info, StructuredOutputConfig(jump_forward=False), backends={"llguidance": backends["llguidance"]}
    )
    try:
        schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
        request = _started(manager, schema)
        mask = _deferred_step(manager, info, request)
        assert mask.allows([0], torch.tensor(encode("{")[:1])) == [True]
        assert request.checked_token is not None and request.checked_forced is None
        assert request.advance(request.checked_token, left=100, jump_forward=False).tokens == []
    finally:
        manager.shutdown()
