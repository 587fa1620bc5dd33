"""Pick hints: a position is hinted once lazy picks there are mostly rejected, per kind of position, and tried
lazily again after a while."""

from __future__ import annotations

from structgen.structured.json_scan import NUMBER, STRING
from structgen.structured.pick_hints import PickHints


def test_hinted_where_lazy_picks_keep_being_rejected() -> None:
    hints = PickHints()
    for _ in range(3):
        hints.picked_lazily(NUMBER, rejected=True)
        hints.picked_lazily(STRING, rejected=False)
    assert hints.hinted(NUMBER) and not hints.hinted(STRING)
    assert not hints.hinted(None)  # a position never seen is picked lazily


def test_an_occasional_rejection_does_not_hint() -> None:
    hints = PickHints()
    for i in range(40):
        hints.picked_lazily(STRING, rejected=i % 5 == 0)
        assert not hints.hinted(STRING)


def test_a_hinted_position_is_tried_lazily_again() -> None:
    hints = PickHints()
    for _ in range(4):
        hints.picked_lazily(NUMBER, rejected=True)
    hinted_in_a_row = 0
    while hints.hinted(NUMBER):
        hints.picked_hinted(NUMBER)
        hinted_in_a_row += 1
    assert 1 <= hinted_in_a_row <= 20
    # A model that now writes the number right is picked lazily from then on.
    for _ in range(3):
        hints.picked_lazily(NUMBER, rejected=False)
    assert not hints.hinted(NUMBER)


def test_narrow_positions_are_filled_ahead_and_wide_ones_tried_again_now_and_then() -> None:
    hints = PickHints()
    assert hints.expects_narrow(NUMBER) and hints.expects_narrow(STRING)  # never measured: fill and see
    for _ in range(4):
        hints.saw_width(NUMBER, narrow=True)
        hints.saw_width(STRING, narrow=False)
    assert hints.expects_narrow(NUMBER) and not hints.expects_narrow(STRING)
    skipped = _rows_left_unfilled_until_retried(hints, STRING)
    assert 3 <= skipped <= 30  # a wide position is filled again after a while, not every step
    assert not hints.sure_narrow(STRING)  # a try: one row of the batch finds out (the logits processor)
    hints.saw_width(STRING, narrow=False)
    assert not hints.expects_narrow(STRING)


def test_a_position_is_sure_narrow_only_while_its_masks_keep_being_narrow() -> None:
    hints = PickHints()
    assert hints.sure_narrow(NUMBER)  # never measured: every row there is filled ahead once
    hints.saw_width(NUMBER, narrow=False)
    hints.saw_width(NUMBER, narrow=False)
    assert hints.expects_narrow(NUMBER) and not hints.sure_narrow(NUMBER)  # in doubt
    for _ in range(4):
        hints.saw_width(NUMBER, narrow=True)
    assert hints.sure_narrow(NUMBER)


def test_a_compiles_shared_table_spaces_its_retries_for_a_batch() -> None:
    """Fed by every row of a batch, the shared table retries a wide position after some tens of rows."""
    hints = PickHints.shared()
    for _ in range(4):
        hints.saw_width(STRING, narrow=False)
    skipped = _rows_left_unfilled_until_retried(hints, STRING)
    assert 30 <= skipped <= 150


def test_a_requests_own_table_learns_a_position_from_its_first_look() -> None:
    """Alone, a request meets each member once an output: its first measure of a position decides it."""
    hints = PickHints.private()
    hints.saw_width(STRING, narrow=False)
    hints.saw_width(NUMBER, narrow=True)
    assert not hints.expects_narrow(STRING) and hints.sure_narrow(NUMBER)
    hints.saw_width(NUMBER, narrow=False)  # later looks average, as in any table
    hints.saw_width(NUMBER, narrow=False)
    assert hints.expects_narrow(NUMBER) and not hints.sure_narrow(NUMBER)
    skipped = _rows_left_unfilled_until_retried(hints, STRING)
    assert 10 <= skipped <= 60  # a wide position is still tried again now and then
    sample = hints.copy()
    assert sample.narrow == hints.narrow and sample.first_decides
    sample.saw_width(STRING, narrow=True)
    assert sample.narrow != hints.narrow  # a sibling sample's table is its own


def test_open_text_is_never_expected_narrow() -> None:
    """A string that takes free text has a wide mask that is costly to fill: never filled ahead, before any look
    and however long it goes unfilled. A string told not to be open text, and other positions, keep their own
    expectations, in copies too."""
    for hints in (PickHints.private(), PickHints.shared()):
        assert hints.expects_narrow(STRING)  # unmeasured: tried
        hints.saw_text(STRING, open_text=True)
        hints.saw_text(STRING + 1, open_text=False)  # an enum's string
        assert not hints.expects_narrow(STRING) and hints.expects_narrow(STRING + 1)
        assert hints.expects_narrow(NUMBER)
        for _ in range(1000):
            hints.left_unfilled(STRING)
        hints.saw_width(STRING, narrow=True)
        assert not hints.expects_narrow(STRING)
        sample = hints.copy()
        assert not sample.expects_narrow(STRING) and sample.expects_narrow(STRING + 1)


def _rows_left_unfilled_until_retried(hints: PickHints, position: int) -> int:
    """How many rows at `position` go unfilled before its expectation fades back to a try."""
    skipped = 0
    while not hints.expects_narrow(position):
        hints.left_unfilled(position)
        skipped += 1
    return skipped


def test_open_text_is_never_hinted() -> None:
    """Lazy picks rejected again and again in a string that takes free text do not hint it (its fill is costly
    and its candidates mostly allowed); the same rejections hint a position that is not open text, and a kind
    of position not yet told apart."""
    for hints in (PickHints.private(), PickHints.shared()):
        hints.saw_text(STRING, open_text=True)
        hints.saw_text(STRING + 1, open_text=False)
        for _ in range(6):
            for position in (STRING, STRING + 1, NUMBER):
                hints.picked_lazily(position, rejected=True)
        assert not hints.hinted(STRING)
        assert hints.hinted(STRING + 1) and hints.hinted(NUMBER)
        assert not hints.copy().hinted(STRING) and hints.copy().hinted(STRING + 1)
