"""Block manager invariants under random add / prefill / decode / fork / free / preempt sequences.

A fake KV cache stores, in each slot, the token written there. That makes the strongest check possible without
a model: every computed token of every live sequence must be readable through its block table, so prefix-cache
hits and copy-on-write forks are checked for content, not just bookkeeping.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from structgen.engine.block_manager import BlockManager, CachedPrefix, cdiv
from structgen.engine.outputs import TokenLogprob
from structgen.engine.sequence import Sequence
from structgen.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 24
# Few distinct tokens, so random prompts often share prefixes and hit the cache.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=30)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True, cache_salt="test")
        self.kv: list[list[int | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.ids = itertools.count()

    # -- helpers -----------------------------------------------------------------------------------------------

    def _compute(self, seq: Sequence, num_new: int) -> bool:
        evictions = self.bm.num_evictions
        copies = self.bm.allocate_slots(seq, num_new)
        if copies is None:
            return False
        if self.bm.num_evictions > evictions:
            event("eviction")
        for src, dst in copies:
            event("copy-on-write")
            assert self.bm.blocks[dst].ref_count == 1
            self.kv[dst] = list(self.kv[src])
        for t in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            block = seq.block_table[t // BLOCK_SIZE]
            assert self.bm.blocks[block].ref_count == 1, f"write into shared block {block}"
            assert self.bm.blocks[block].hash is None, f"write into cached block {block}"
            self.kv[block][t % BLOCK_SIZE] = seq.token_ids[t]
        seq.num_computed_tokens += num_new
        self.bm.commit(seq)
        return True

    def _admit(self, seq: Sequence, chunk: int) -> bool:
        cached = self.bm.find_cached_prefix(seq)
        num_cached = cached.num_tokens(BLOCK_SIZE)
        assert num_cached < len(seq), "a hit must leave the last token to compute"
        if cached.blocks:
            event("prefix hit")
        if cached.partial_tokens:
            event("part of a block reused")
        num_new = min(chunk, len(seq) - num_cached)
        if not self.bm.can_allocate(cached, num_cached + num_new):
            return False
        free_before = self.bm.num_free_blocks
        self.bm.allocate_cached(seq, cached)
        assert self._compute(seq, num_new), "can_allocate promised room"
        reclaimed = free_before - self.bm.num_free_blocks
        assert reclaimed <= cdiv(num_cached + num_new, BLOCK_SIZE) + (cached.partial_tokens > 0)
        self.running.append(seq)
        return True

    # -- rules -------------------------------------------------------------------------------------------------

    @rule(prompt=tokens, chunk=st.integers(1, 40))
    def add(self, prompt: list[int], chunk: int) -> None:
        seq = Sequence(next(self.ids), prompt)
        if not self._admit(seq, chunk):
            self.waiting.append(seq)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 40))
    def readmit(self, data: st.DataObject, chunk: int) -> None:
        seq = self.waiting[data.draw(st.integers(0, len(self.waiting) - 1))]
        if self._admit(seq, chunk):
            self.waiting.remove(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2), chunk=st.integers(1, 40))
    def step(self, data: st.DataObject, token: int, chunk: int) -> None:
        seq = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        if seq.num_computed_tokens < len(seq):  # unfinished prefill: next chunk
            self._compute(seq, min(chunk, len(seq) - seq.num_computed_tokens))
            return
        seq.append_token(token)
        if not self._compute(seq, 1):
            seq.token_ids.pop()
            seq.output_token_ids.pop()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        child = parent.fork(next(self.ids), 1, None)
        self.bm.fork(parent, child)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.bm.free(seq)

    @precondition(lambda self: self.running)
    @rule()
    def preempt_newest(self) -> None:
        seq = self.running.pop()
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        self.waiting.insert(0, seq)

    # -- invariants --------------------------------------------------------------------------------------------

    @invariant()
    def ref_counts_exact_and_pool_disjoint(self) -> None:
        owners = [0] * NUM_BLOCKS
        for seq in self.running:
            assert len(seq.block_table) == cdiv(seq.num_computed_tokens, BLOCK_SIZE)
            for block in seq.block_table:
                owners[block] += 1
        for seq in self.waiting:
            assert seq.block_table == []
        free = self.bm.free_block_ids()
        for block in self.bm.blocks:
            assert block.ref_count == owners[block.block_id], block
            assert (block.block_id in free) == (block.ref_count == 0), block
        assert self.bm.num_free_blocks == len(free) == owners.count(0)

    @invariant()
    def every_computed_token_readable(self) -> None:
        for seq in self.running:
            for t in range(seq.num_computed_tokens):
                assert self.kv[seq.block_table[t // BLOCK_SIZE]][t % BLOCK_SIZE] == seq.token_ids[t]

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        for block_hash, block_id in self.bm._cached.items():
            block = self.bm.blocks[block_id]
            assert block.hash == block_hash
            assert tuple(self.kv[block_id]) == block.token_ids
        # The index of partial reuse lists exactly the registered blocks, each under its parent and first token.
        listed = {b: key for key, ids in self.bm._children.items() for b in ids}
        assert listed == {
            b: (self.bm.blocks[b].parent, self.bm.blocks[b].token_ids[0]) for b in self.bm._cached.values()
        }

    def teardown(self) -> None:
        for seq in self.running:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == NUM_BLOCKS
        assert all(block.ref_count == 0 for block in self.bm.blocks)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- targeted cases ----------------------------------------------------------------------------------------------


def _prefill(bm: BlockManager, seq: Sequence) -> None:
    cached = bm.find_cached_prefix(seq)
    bm.allocate_cached(seq, cached)
    copies = bm.allocate_slots(seq, len(seq) - seq.num_computed_tokens)
    assert copies is not None and len(copies) == (cached.partial_tokens > 0)
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)


def test_prefix_hit_reuses_blocks_and_keeps_last_token() -> None:
    bm = BlockManager(16, 4)
    first = Sequence(0, list(range(12)))
    _prefill(bm, first)
    table = list(first.block_table)
    bm.free(first)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 16
    # The whole 12-token prompt is cached, but the last token must be recomputed: 2 blocks and 3 tokens hit.
    assert bm.find_cached_prefix(Sequence(1, list(range(12)))) == CachedPrefix(table, 3)
    longer = Sequence(2, [*range(12), 99])
    assert bm.find_cached_prefix(longer) == CachedPrefix(table)
    bm.allocate_cached(longer, bm.find_cached_prefix(longer))
    assert longer.num_computed_tokens == 12
    assert bm.num_hit_tokens == 12 and bm.num_queried_tokens == 12 + 13  # the first prefill queried too


def test_hit_requires_same_chain_and_salt() -> None:
    bm = BlockManager(16, 4)
    _prefill(bm, Sequence(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: the chained hash differs, so no hit on either.
    assert bm.find_cached_prefix(Sequence(1, [0, 2, 3, 4, 5, 6, 7, 8, 9])) == CachedPrefix([])
    assert len(bm.find_cached_prefix(Sequence(2, [1, 2, 3, 4, 5, 6, 7, 8, 0])).blocks) == 2
    other_model = BlockManager(16, 4, cache_salt="other")
    seq = Sequence(3, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _prefill(bm, seq)
    assert other_model.find_cached_prefix(Sequence(4, [1, 2, 3, 4, 5, 6, 7, 8, 9])) == CachedPrefix([])


def test_lru_eviction_only_of_unreferenced_blocks() -> None:
    bm = BlockManager(4, 2)
    a = Sequence(0, [1, 2, 3, 4])  # two full blocks
    _prefill(bm, a)
    a_table = list(a.block_table)
    bm.free(a)
    b = Sequence(1, [5, 6, 7, 8])
    _prefill(bm, b)  # takes the two never-cached blocks
    assert bm.num_evictions == 0 and bm.num_cached_blocks == 4
    # b is still running: the next allocation must evict from a's released blocks, tail block first.
    c = Sequence(2, [9, 10])
    _prefill(bm, c)
    assert bm.num_evictions == 1
    assert c.block_table == [a_table[1]]
    assert bm.find_cached_prefix(Sequence(3, [1, 2, 3, 4, 0])).blocks == [
        a_table[0]
    ]  # a's head block survived
    assert bm.allocate_slots(Sequence(4, [0] * 9), 9) is None  # b and c hold their blocks; nothing fits
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 4


def test_cow_on_fork_of_partial_block() -> None:
    bm = BlockManager(8, 4)
    parent = Sequence(0, [1, 2, 3, 4, 5, 6])  # one full block, one partial block
    _prefill(bm, parent)
    child = parent.fork(1, 1, None)
    bm.fork(parent, child)
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    parent.append_token(7)
    copies = bm.allocate_slots(parent, 1)
    assert copies == [(child.block_table[1], parent.block_table[1])]
    assert parent.block_table[0] == child.block_table[0]
    child.append_token(8)
    assert bm.allocate_slots(child, 1) == []  # the last holder writes in place
    assert [bm.blocks[b].ref_count for b in child.block_table] == [2, 1]


def test_part_of_a_cached_block_is_reused_and_copied_before_it_is_written() -> None:
    bm = BlockManager(8, 4)
    a = Sequence(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # two full blocks, registered
    _prefill(bm, a)
    shared = a.block_table[1]
    # b shares a's first block and the first two tokens of its second; a is still running.
    b = Sequence(1, [1, 2, 3, 4, 5, 6, 0, 0])
    cached = bm.find_cached_prefix(b)
    assert cached == CachedPrefix(a.block_table[:2], 2) and cached.num_tokens(4) == 6
    assert bm.can_allocate(cached, len(b))
    bm.allocate_cached(b, cached)
    assert b.num_computed_tokens == 6 and bm.blocks[shared].ref_count == 2
    copies = bm.allocate_slots(b, 2)
    assert copies == [(shared, b.block_table[1])] and b.block_table[1] != shared
    assert bm.blocks[shared].ref_count == 1 and bm.blocks[shared].token_ids == (5, 6, 7, 8)
    # With a gone, its block sits in the LRU; a reuse in part still copies it (nobody else holds it).
    bm.free(a)
    c = Sequence(2, [1, 2, 3, 4, 5, 9])
    cached = bm.find_cached_prefix(c)
    assert cached == CachedPrefix([b.block_table[0], shared], 1)
    bm.allocate_cached(c, cached)
    assert bm.allocate_slots(c, 1) == [(shared, c.block_table[1])]
    assert bm.blocks[shared].ref_count == 0 and shared in bm.free_block_ids()
    # Nothing shared past the last whole block: no partial reuse; a different first token: none either.
    assert bm.find_cached_prefix(Sequence(3, [1, 2, 3, 4, 0, 5])) == CachedPrefix([b.block_table[0]])
    assert bm.find_cached_prefix(Sequence(4, [1, 2, 3])) == CachedPrefix([b.block_table[0]], 2)


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = Sequence(0, list(range(9)))
    _prefill(bm, a)
    bm.free(a)
    assert bm.find_cached_prefix(Sequence(1, list(range(9)))) == CachedPrefix([])
    assert bm.num_cached_blocks == 0


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_bad_pool_size(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks, 16)


def test_prompt_scores_stay_with_registered_blocks_until_evicted() -> None:
    bm = BlockManager(3, BLOCK_SIZE, enable_prefix_caching=True)
    seq = Sequence(0, list(range(10, 20)), params=SamplingParams(prompt_logprobs=2))
    seq.prompt_logprobs = [None] + [TokenLogprob(t, -1.0) for t in range(11, 17)]  # scored up to position 6
    bm.allocate_cached(seq, CachedPrefix([]))
    assert bm.allocate_slots(seq, 8) == []
    seq.num_computed_tokens = 8
    bm.commit(seq)
    first, second = (bm.blocks[b] for b in seq.block_table)
    assert first.scores == (2, tuple(seq.prompt_logprobs[:4]))
    assert second.scores is None  # position 7 is not scored yet: nothing kept for its block
    bm.free(seq)
    other = Sequence(1, list(range(50, 62)))
    bm.allocate_cached(other, CachedPrefix([]))
    assert bm.allocate_slots(other, 12) == []  # takes the free block and evicts both cached ones
    assert bm.num_evictions == 2 and all(bm.blocks[b].scores is None for b in other.block_table)
