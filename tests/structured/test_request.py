"""The per-request state the engine holds, and the batch logits processor: a mixed batch (constrained rows on
different backends, unconstrained rows) leaves the unconstrained rows bit-identical."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from structured_helpers import allowed_tokens

from structgen.structured import (
    GrammarRejectedTokenError,
    StructuredOutputManager,
    StructuredOutputsParams,
    UnsupportedSchemaError,
)
from structgen.structured.bitmask import unpack_bitmask
from structgen.structured.logits_processor import StructuredLogitsProcessor
from structgen.structured.request import StructuredRequest


@pytest.fixture()
def manager(info, backends):
    m = StructuredOutputManager(info, backends={n: backends[n] for n in ("llguidance", "xgrammar")})
    yield m
    m.shutdown()


def test_request_lifecycle(manager, encode, tiny_tokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
        "additionalProperties": False,
    }
    req = StructuredRequest(manager, StructuredOutputsParams(json=schema))
    req.future.result(timeout=60)
    assert req.ready()
    req.accept(encode("{"))
    forced = req.jump_forward()
    assert forced and req.num_forced_tokens == len(forced)
    with pytest.raises(GrammarRejectedTokenError, match="rejected sampled tokens"):
        req.accept(encode("}"))
    req.accept(encode('"name":"Bo"}'[len(tiny_tokenizer.decode(forced)) :]))
    assert req.is_terminated()
    assert req.validate('{"name":"Bo"}').valid and not req.should_retry()
    report = req.report()
    assert report["backend"] == "llguidance" and report["path"] == "exact" and report["valid"] is True


def test_rows_expected_narrow_are_filled_and_listed_first_without_waiting_for_the_others(
    manager, backends, info, encode
) -> None:
    """`narrow_rows` waits for the rows expected narrow only (filled, then listed, on the mask thread); the other
    rows filled ahead (here one that needs its whole mask, on a backend that takes its time) are waited for by
    the processor's call, after the lm_head."""
    import threading

    from structgen.sampling_params import SamplingParams
    from structgen.structured.pick_hints import PickHints

    release = threading.Event()

    class SlowBackend:
        def fill_bitmask_batch(self, items, bitmask) -> None:
            assert release.wait(30)
            for _, row in items:
                bitmask[row].fill_(-1)

    slow = SimpleNamespace(backend=SlowBackend(), checks_tokens_cheaply=False)
    digit = backends["llguidance"].compile(StructuredOutputsParams(regex=r"[0-9]").to_spec())
    seqs = [
        SimpleNamespace(
            grammar=digit,
            params=SamplingParams(),
            structured=SimpleNamespace(pick_hints=PickHints(), hint_context=None),
        ),
        SimpleNamespace(grammar=slow, params=SamplingParams(top_p=0.9)),  # its mask is needed whole
    ]
    processor = StructuredLogitsProcessor(manager, lambda seq: seq.grammar, defer=True)
    processor.narrow_limit = 64
    processor.prepare(seqs)
    narrow = processor.narrow_rows(seqs, info.vocab_size)
    assert not release.is_set()  # returned while the other row is still being filled
    digits = sorted(encode(str(d))[0] for d in range(10))
    assert list(narrow) == [0] and narrow[0].tolist() == digits
    release.set()
    mask = processor(torch.zeros(len(seqs), info.vocab_size), seqs)
    assert mask is not None and mask.rows == [0, 1] and mask.eager == [0] and not mask.unfilled
    assert bool((mask.bitmask[1] == -1).all())  # the slow row was filled before the sampler got it
    assert mask.allowed[0].tolist() == digits
    # Listed up to the bitmask's width: ids past the model's vocabulary are left out.
    processor.prepare(seqs)
    assert processor.narrow_rows(seqs, digits[5])[0].tolist() == digits[:5]


def test_a_position_in_doubt_is_filled_ahead_for_one_row_a_step(manager, backends, info, encode) -> None:
    from structgen.sampling_params import SamplingParams
    from structgen.structured.pick_hints import PickHints

    digit = backends["llguidance"].compile(StructuredOutputsParams(regex=r"[0-9]").to_spec())
    doubtful, sure = PickHints(), PickHints()
    doubtful.saw_width(None, narrow=False)
    doubtful.saw_width(None, narrow=False)  # found wide lately: expected narrow, but only as a try
    seqs = [
        SimpleNamespace(
            grammar=digit,
            params=SamplingParams(),
            structured=SimpleNamespace(pick_hints=hints, hint_context=None),
        )
        for hints in (doubtful, doubtful, doubtful, sure, sure)
    ]
    processor = StructuredLogitsProcessor(manager, lambda seq: seq.grammar, defer=True)
    processor.narrow_limit = 64
    processor.prepare(seqs)
    assert sorted(processor.narrow_rows(seqs, info.vocab_size)) == [0, 3, 4]
    assert doubtful.sure_narrow(None)  # its row was narrow: every row there is filled ahead again
    processor(torch.zeros(len(seqs), info.vocab_size), seqs)
    processor.prepare(seqs)
    assert sorted(processor.narrow_rows(seqs, info.vocab_size)) == [0, 1, 2, 3, 4]


def test_a_row_in_open_text_is_left_unfilled(manager, backends, info) -> None:
    """A row at a kind of position the hints know as open text is not filled for narrow logits: its pick is
    checked against its grammar alone, and its row filled only if the sampler needs it."""
    from structgen.sampling_params import SamplingParams
    from structgen.structured.pick_hints import PickHints

    digit = backends["llguidance"].compile(StructuredOutputsParams(regex=r"[0-9]").to_spec())
    hints = PickHints()
    hints.saw_text(None, open_text=True)
    seqs = [
        SimpleNamespace(
            grammar=digit,
            params=SamplingParams(),
            structured=SimpleNamespace(pick_hints=hints, hint_context=None),
        )
    ]
    processor = StructuredLogitsProcessor(manager, lambda seq: seq.grammar, defer=True)
    processor.narrow_limit = 64
    processor.prepare(seqs)
    assert processor.narrow_rows(seqs, info.vocab_size) == {}
    mask = processor(torch.zeros(1, info.vocab_size), seqs)
    assert mask is not None and list(mask.unfilled) == [0] and mask.eager == []


def test_hint_context_tells_positions_and_members_apart(manager, encode) -> None:
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "maxLength": 2},
            "n": {"type": "integer"},
            "t": {"type": "string"},
        },
        "required": ["s", "n", "t"],
        "additionalProperties": False,
    }
    req = StructuredRequest(manager, StructuredOutputsParams(json=schema))
    req.start()
    contexts = []
    for piece in ('{"s":', '"', "a", "b", '","n":', "1", "2", ',"t":', '"', "a"):
        req.accept(encode(piece))
        contexts.append(req.hint_context)
    before_s, in_s, in_s_again, s_full, before_n, in_n, in_n_again, before_t, in_t, in_t_again = contexts
    assert (in_s, in_n, in_t) == (in_s_again, in_n_again, in_t_again)  # same position, same context
    # A string with room differs from one at its maxLength (its closing quote forced), a value's start from
    # its content, and each member from the others.
    assert len({before_s, in_s, s_full, before_n, in_n, before_t, in_t}) == 7
    # Strings with room are open text (never filled ahead for their width), told once each; the forced quote
    # and the positions between values or in a number are not asked about.
    assert req.pick_hints.text == {in_s: True, in_t: True}


def test_only_strings_that_take_free_text_are_open_text(manager, encode) -> None:
    """An enum's string and a pattern of digits are narrow candidates like any structural point; a key is told
    apart from the value before it (its object's last key still names that member while it is written)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "color": {"enum": ["red", "green", "blue"]},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "tag": {"type": "string"},
        },
        "required": ["name", "color", "zip", "tag"],
        "additionalProperties": False,
    }
    req = StructuredRequest(manager, StructuredOutputsParams(json=schema))
    req.start()
    contexts = {}
    for label, piece in (
        ("before", '{"name":'),
        ("name", '"a'),
        ("key", '","'),
        ("color", 'color":"'),
        ("zip", 'red","zip":"1'),
        ("tag", '2345","tag":"x'),
    ):
        req.accept(encode(piece))
        contexts[label] = req.hint_context
    hints = req.pick_hints
    assert hints.text == {
        contexts["name"]: True,
        contexts["color"]: False,
        contexts["zip"]: False,
        contexts["tag"]: True,
    }
    assert contexts["key"] != contexts["name"] and contexts["key"] not in hints.text
    assert hints.expects_narrow(contexts["color"]) and not hints.expects_narrow(contexts["name"])


def test_requests_of_one_compile_share_their_pick_hints(manager) -> None:
    first, second, other = (
        StructuredRequest(manager, StructuredOutputsParams(json=schema))
        for schema in ({"type": "integer"}, {"type": "integer"}, {"type": "boolean"})
    )
    for req in (first, second, other):
        req.start()
    assert first.pick_hints is second.pick_hints  # what one request learnt, the next starts with
    assert other.pick_hints is not first.pick_hints
    assert first.fork().pick_hints is first.pick_hints
    # A seeded request keeps its own (the path a row is drawn by picks the token for a given seed), and so
    # does each of its samples.
    seeded = StructuredRequest(manager, StructuredOutputsParams(json={"type": "integer"}), share_hints=False)
    seeded.start()
    assert seeded.pick_hints is not first.pick_hints
    seeded.pick_hints.picked_lazily(None, rejected=True)
    sibling = seeded.fork()
    assert sibling.pick_hints is not seeded.pick_hints and sibling.pick_hints.rates == seeded.pick_hints.rates
    assert sibling.pick_hints.first_decides  # alone, each member is learnt from its first look


def test_relaxed_request_retries_then_flags(manager, encode) -> None:
    req = StructuredRequest(
        manager, StructuredOutputsParams(json={"type": "array", "uniqueItems": True}, strict=True)
    )
    req.start()
    assert req.compiled is not None and req.compiled.needs_validation
    for _ in range(manager.config.max_validation_retries + 1):
        req.accept(encode("[1,1]"))
        assert not req.validate("[1,1]").valid
        if not req.should_retry():
            break
        req.restart()
    assert req.retries == manager.config.max_validation_retries
    assert req.failed_strict()  # strict: the request fails rather than return an invalid output
    assert req.report()["path"] == "relaxed" and "relax uniqueItems at #" in req.report()["changes"]


def test_compile_errors_surface_on_start(manager) -> None:
    req = StructuredRequest(manager, StructuredOutputsParams(json={"$ref": "https://example.com/x.json"}))
    req.future.exception(timeout=60)
    assert req.ready()
    with pytest.raises(UnsupportedSchemaError, match=r"\$ref"):
        req.start()


@pytest.mark.parametrize("prepared", ["same batch", "other batch", "not prepared"])
def test_mixed_batch_masks_only_constrained_rows(manager, backends, info, encode, prepared: str) -> None:
    llg = backends["llguidance"].compile(StructuredOutputsParams(json={"type": "object"}).to_spec())
    xgr = backends["xgrammar"].compile(StructuredOutputsParams(regex=r"[0-9]+").to_spec())
    assert xgr.accept_tokens(encode("12"))
    seqs = [
        SimpleNamespace(grammar=None),
        SimpleNamespace(grammar=llg),
        SimpleNamespace(grammar=None),
        SimpleNamespace(grammar=xgr),
        SimpleNamespace(grammar=None),
    ]
    processor = StructuredLogitsProcessor(manager, lambda seq: seq.grammar)
    logits = torch.randn(len(seqs), info.vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    if prepared == "same batch":
        processor.prepare(seqs)  # the fill overlaps what would be the forward
    elif prepared == "other batch":
        processor.prepare(list(reversed(seqs)))  # rows would not line up: the processor refills
    processor(logits, seqs)
    for row, seq in enumerate(seqs):
        if seq.grammar is None:
            assert torch.equal(logits[row], before[row])  # same logits, hence the same sampled token
        else:
            allowed = allowed_tokens(seq.grammar, info.vocab_size)
            assert torch.equal(torch.isinf(logits[row]), ~allowed)
            assert torch.equal(logits[row][allowed], before[row][allowed])
    # A batch with no grammar at all is left alone.
    plain = before.clone()
    processor(plain, [SimpleNamespace(grammar=None)] * len(seqs))
    assert torch.equal(plain, before)


def test_deferred_rows_are_checked_by_their_grammar_and_filled_only_when_needed(
    manager, backends, info, encode
) -> None:
    from structgen.sampling_params import SamplingParams

    llg = backends["llguidance"].compile(StructuredOutputsParams(json={"type": "object"}).to_spec())
    xgr = backends["xgrammar"].compile(StructuredOutputsParams(regex=r"[0-9]+").to_spec())
    llg_top_p = backends["llguidance"].compile(StructuredOutputsParams(regex=r"[a-z]+").to_spec())
    seqs = [
        SimpleNamespace(grammar=llg, params=SamplingParams()),  # deferred: llguidance, picked lazily
        SimpleNamespace(grammar=xgr, params=SamplingParams()),  # filled ahead: no cheap token check
        SimpleNamespace(grammar=llg_top_p, params=SamplingParams(top_p=0.9)),  # needs the whole mask
        SimpleNamespace(grammar=None, params=SamplingParams()),
    ]
    processor = StructuredLogitsProcessor(manager, lambda seq: seq.grammar, defer=True)
    processor.prepare(seqs)
    mask = processor(torch.zeros(len(seqs), info.vocab_size), seqs)
    assert mask is not None and mask.rows == [0, 1, 2] and list(mask.unfilled) == [0]
    for row in (1, 2):  # filled ahead, on the mask thread
        assert torch.equal(
            unpack_bitmask(mask.bitmask[row], info.vocab_size),
            allowed_tokens(seqs[row].grammar, info.vocab_size),
        )
    brace, letter = encode("{")[0], encode("x")[0]
    assert mask.allows([0, 0, 2, 2], torch.tensor([brace, letter, letter, brace])) == [
        True,
        False,
        True,
        False,
    ]
    assert list(mask.unfilled) == [0]  # checking a token does not fill the row
    logits = torch.zeros(len(seqs), info.vocab_size)
    mask.apply(logits, [0])  # masking needs the whole row: filled now
    assert not mask.unfilled
    assert torch.equal(torch.isfinite(logits[0]), allowed_tokens(llg, info.vocab_size))


def test_a_deferred_row_is_masked_first_once_hinted(manager, backends, info, encode) -> None:
    from structgen.sampling_params import SamplingParams
    from structgen.structured.pick_hints import PickHints

    llg = backends["llguidance"].compile(StructuredOutputsParams(json={"type": "object"}).to_spec())
    request = SimpleNamespace(pick_hints=PickHints(), hint_context=None)
    seqs = [SimpleNamespace(grammar=llg, params=SamplingParams(), structured=request)]
    processor = StructuredLogitsProcessor(manager, lambda seq: seq.grammar, defer=True)
    processor.prepare(seqs)
    first = processor(torch.zeros(1, info.vocab_size), seqs)
    assert first is not None and list(first.unfilled) == [0] and first.eager == []
    first.rejected = [0]  # what the sampler records for a lazy row it had to mask
    processor.prepare(seqs)
    again = processor(torch.zeros(1, info.vocab_size), seqs)
    assert again is not None and again.eager == []  # one rejection is not a habit yet
    again.rejected = [0]
    processor.prepare(seqs)
    second = processor(torch.zeros(1, info.vocab_size), seqs)
    assert second is not None and not second.unfilled and second.eager == [0]
    assert torch.equal(
        unpack_bitmask(second.bitmask[0], info.vocab_size), allowed_tokens(llg, info.vocab_size)
    )


@pytest.mark.parametrize("overlap", [True, False])
def test_fills_in_place_without_the_mask_thread_give_the_same_masks(
    manager, backends, info, encode, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    llg = backends["llguidance"].compile(StructuredOutputsParams(json={"type": "object"}).to_spec())
    xgr = backends["xgrammar"].compile(StructuredOutputsParams(regex=r"[0-9]+").to_spec())
    assert xgr.accept_tokens(encode("12"))
    seqs = [SimpleNamespace(grammar=llg), SimpleNamespace(grammar=None), SimpleNamespace(grammar=xgr)]
    on_thread: list[object] = []
    real = manager.on_mask_thread
    monkeypatch.setattr(
        manager, "on_mask_thread", lambda job, *args: on_thread.append(job) or real(job, *args)
    )
    processor = StructuredLogitsProcessor(manager, lambda seq: seq.grammar, overlap=overlap)
    logits = torch.randn(len(seqs), info.vocab_size, generator=torch.Generator().manual_seed(0))
    processor.prepare(seqs)
    processor(logits, seqs)
    assert bool(on_thread) == overlap  # in place: nothing went to the mask thread
    for row in (0, 2):
        assert torch.equal(torch.isinf(logits[row]), ~allowed_tokens(seqs[row].grammar, info.vocab_size))


def test_a_fill_that_raises_in_place_fails_where_its_result_is_read(manager, monkeypatch) -> None:
    processor = StructuredLogitsProcessor(manager, lambda seq: seq.grammar, overlap=False)

    def broken(items, bitmask):
        raise RuntimeError("fill bug")

    monkeypatch.setattr(manager, "fill_bitmask", broken)
    seqs = [SimpleNamespace(grammar=object())]
    processor.prepare(seqs)  # does not raise here, as a fill on the mask thread would not
    with pytest.raises(RuntimeError, match="fill bug"):
        processor(torch.zeros(1, 8), seqs)
