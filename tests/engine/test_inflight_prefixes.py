"""`InflightPrefixes`: which waiting sequences wait for blocks another sequence's prompt is computing."""

from __future__ import annotations

from structgen.engine.block_manager import BlockManager
from structgen.engine.inflight_prefixes import InflightPrefixes
from structgen.engine.sequence import Sequence
from structgen.sampling_params import SamplingParams

PREFIX = list(range(500, 512))  # 3 blocks of 4


def sequence(seq_id: int, own: list[int], prompt_logprobs: int | None = None) -> Sequence:
    seq = Sequence(seq_id, PREFIX + own, params=SamplingParams(prompt_logprobs=prompt_logprobs))
    seq.prompt_logprobs = [None] if prompt_logprobs is not None else None
    return seq


def test_only_blocks_still_to_compute_and_a_whole_block_left_to_read() -> None:
    bm = BlockManager(32, 4)
    leader = sequence(0, [1, 2, 3])
    inflight = InflightPrefixes(bm, [leader])
    assert inflight.holds_next(sequence(1, [7]), 0)
    assert inflight.holds_next(sequence(2, [7]), 8)  # block 2 is in flight too
    assert not inflight.holds_next(sequence(3, [7]), 12)  # nothing past the shared blocks
    assert not inflight.holds_next(sequence(4, []), 8)  # block 2 holds its last token, which always runs
    assert not inflight.holds_next(leader, 0)
    leader.num_committed_blocks = 3  # registered: read from the cache now, nothing to wait for
    assert not InflightPrefixes(bm, [leader]).holds_next(sequence(5, [7]), 0)
    leader.num_committed_blocks, leader.num_computed_tokens = 0, len(leader.token_ids)  # decoding
    assert not InflightPrefixes(bm, [leader]).holds_next(sequence(6, [7]), 0)


def test_a_scoring_sequence_waits_only_for_blocks_that_keep_enough_scores() -> None:
    bm = BlockManager(32, 4)
    plain, scores_one, scores_three = sequence(0, [1]), sequence(1, [1], 1), sequence(2, [1], 3)
    assert not InflightPrefixes(bm, [plain]).holds_next(sequence(3, [7], 0), 0)
    assert not InflightPrefixes(bm, [scores_one]).holds_next(sequence(4, [7], 2), 0)
    assert InflightPrefixes(bm, [scores_three]).holds_next(sequence(5, [7], 2), 0)
    # A scoring prefix of 7 tokens reads 8 (the 8th runs again): the next block it reads is block 2.
    assert InflightPrefixes(bm, [scores_three]).holds_next(sequence(6, [7], 2), 7)
    # A plain sequence waits for a scoring leader's blocks too.
    assert InflightPrefixes(bm, [scores_one]).holds_next(sequence(7, [7]), 4)
