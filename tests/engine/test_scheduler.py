"""The scheduler on its own, with fake tokens instead of a model: batching, chunking, preemption, FCFS, forks."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from structgen.config import SchedulerConfig
from structgen.engine.block_manager import BlockManager
from structgen.engine.scheduler import Scheduler, SchedulerOutput
from structgen.engine.sequence import Sequence, SequenceStatus

ids = itertools.count()


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    max_num_seqs: int = 16,
    budget: int = 64,
    chunked: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
    )
    return Scheduler(config, BlockManager(num_blocks, block_size), watermark=0.0)


def seq(prompt_len: int, *, max_tokens: int = 4, **kwargs: object) -> Sequence:
    """A sequence whose prompt shares no prefix with any other (so no accidental cache hits)."""
    seq_id = next(ids)
    prompt = list(range(seq_id * 1000, seq_id * 1000 + prompt_len))
    return Sequence(seq_id, prompt, max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step with a fake model: every sampling sequence appends a token; finished ones leave."""
    out = sched.schedule()
    sched.update(out)
    for s in out.sample_seqs:
        s.append_token(1000 + s.num_output_tokens)
        assert s.max_tokens is not None
        if s.num_output_tokens >= s.max_tokens:
            sched.finish(s, SequenceStatus.FINISHED_LENGTH)
    return out


def run(sched: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched))
        assert len(outs) < max_steps, "scheduler made no progress"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return outs


def test_decodes_batch_and_new_requests_join_midway() -> None:
    sched = make()
    a, b = seq(5, max_tokens=6), seq(3, max_tokens=6)
    sched.add(a)
    sched.add(b)
    first = step(sched)
    assert first.seqs == [a, b] and first.num_new_tokens == [5, 3]
    assert first.sample_seqs == [a, b]
    c = seq(7, max_tokens=2)
    sched.add(c)
    second = step(sched)
    # a and b decode one token each while c prefills in the same batch.
    assert second.seqs == [a, b, c] and second.num_new_tokens == [1, 1, 7]
    run(sched)
    assert [s.num_output_tokens for s in (a, b, c)] == [6, 6, 2]


def test_chunked_prefill_mixes_with_decodes() -> None:
    sched = make(budget=16)
    short = seq(3, max_tokens=20)
    sched.add(short)
    step(sched)
    long = seq(40, max_tokens=2)
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = step(sched)
        assert out.num_batched_tokens <= 16
        assert short in out.seqs, "the decode is never starved by the chunked prefill"
        chunks.append(out.num_new_tokens[out.seqs.index(long)])
        assert (long in out.sample_seqs) == (long.num_output_tokens == 1)
    assert chunks == [15, 15, 10]
    run(sched)


def test_prefill_without_chunking_waits_for_a_step_with_room() -> None:
    sched = make(budget=16, chunked=False)
    a = seq(10, max_tokens=3)
    b = seq(10, max_tokens=3)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert out.seqs == [a] and out.num_new_tokens == [10]
    out = step(sched)
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 10]
    run(sched)


def test_preemption_of_newest_and_recompute() -> None:
    # 6 blocks of 4 tokens; three sequences that each grow to 12 tokens (3 blocks) cannot all fit.
    sched = make(num_blocks=6, block_size=4)
    seqs = [seq(4, max_tokens=8) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    outs = run(sched)
    preempted = [s for out in outs for s in out.preempted]
    assert preempted, "the pool is too small for all three; someone must be preempted"
    assert preempted[0] is seqs[2], "the most recently admitted goes first"
    assert sched.num_preemptions == len(preempted)
    for s in seqs:
        assert s.num_output_tokens == 8
        assert s.output_token_ids == [1000 + k for k in range(8)], "recompute continues where it stopped"
        assert s.block_table == []


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make(num_blocks=4, block_size=2)
    a, b = seq(2, max_tokens=6), seq(2, max_tokens=6)  # each fits alone (7 slots), not both
    sched.add(a)
    sched.add(b)
    while not any(out.preempted for out in [step(sched)]):
        pass
    assert b.status is SequenceStatus.PREEMPTED and sched.waiting[0] is b
    run(sched)


def test_fcfs_head_of_line_request_is_not_overtaken() -> None:
    sched = make(num_blocks=8, block_size=4, budget=64)
    big_running = seq(20, max_tokens=4)  # takes 6 of the 8 blocks once decoding
    sched.add(big_running)
    step(sched)
    big_waiting = seq(16, max_tokens=2)  # needs 4 blocks: must wait
    small = seq(2, max_tokens=2)  # would fit, but arrived later
    sched.add(big_waiting)
    sched.add(small)
    out = step(sched)
    assert out.seqs == [big_running]
    run(sched)
    assert small.num_output_tokens == 2 and big_waiting.num_output_tokens == 2


def test_waiting_for_grammar_is_skipped_without_blocking() -> None:
    sched = make()
    gate = {"open": False}
    blocked = seq(4, ready=lambda: gate["open"])
    free = seq(4)
    assert blocked.status is SequenceStatus.WAITING_FOR_GRAMMAR
    sched.add(blocked)
    sched.add(free)
    out = step(sched)
    assert out.seqs == [free]
    assert list(sched.waiting) == [blocked], "it keeps its place in the queue"
    gate["open"] = True
    out = step(sched)
    assert blocked in out.seqs and blocked.status is SequenceStatus.RUNNING
    run(sched)


def test_max_num_seqs() -> None:
    sched = make(max_num_seqs=2)
    for _ in range(3):
        sched.add(seq(2, max_tokens=3))
    out = step(sched)
    assert len(out.seqs) == 2 and len(sched.waiting) == 1
    run(sched)


def test_fork_shares_prompt_blocks_and_row() -> None:
    sched = make(block_size=4)
    parent = seq(6, max_tokens=3, num_forks=2)
    sched.add(parent)
    out = step(sched)
    assert len(out.forked) == 2 and out.sample_indices == [0, 0, 0]
    children = out.forked
    assert all(c.block_table == parent.block_table for c in children)
    bm = sched.block_manager
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [3, 3]
    out = step(sched)
    # Each of the first two writers copies the shared partial block; the last one writes in place.
    assert len(out.blocks_to_copy) == 2
    assert parent.block_table[0] == children[0].block_table[0] == children[1].block_table[0]
    assert len({parent.block_table[1], children[0].block_table[1], children[1].block_table[1]}) == 3
    run(sched)
    assert [c.index for c in children] == [1, 2]
    assert all(s.num_output_tokens == 3 for s in (parent, *children))


def test_abort_while_waiting_and_running() -> None:
    sched = make(max_num_seqs=1)
    a, b = seq(8, max_tokens=50), seq(8, max_tokens=50)
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    out = sched.schedule()
    assert out.is_empty and not sched.has_unfinished()


def test_a_prompt_needing_every_block_skips_a_partial_reuse_it_has_no_room_to_copy() -> None:
    # Found by the random workloads below: a cached block [7, 1000] (a prompt and its first output); an
    # 11-token prompt starting with 7 needs all 6 blocks (2 tokens each), and reusing that block in part would
    # need a 7th for its copy. It used to wait forever; it recomputes the token instead.
    sched = make(6, 2, max_num_seqs=1, budget=10)
    first = Sequence(next(ids), [7], max_tokens=2)
    sched.add(first)
    run(sched)
    long = Sequence(next(ids), [7, *range(300, 310)], max_tokens=1)
    assert sched.block_manager.find_cached_prefix(long).partial_tokens == 1
    sched.add(long)
    run(sched, max_steps=10)
    assert long.status is SequenceStatus.FINISHED_LENGTH and long.num_computed_tokens == 11


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(4, 40),
    max_num_seqs=st.integers(1, 6),
    requests=st.lists(
        st.tuples(st.integers(1, 12), st.integers(1, 6), st.integers(0, 2)), min_size=1, max_size=8
    ),
    abort_at=st.integers(0, 60),
)
def test_random_workloads_finish_and_return_every_block(
    num_blocks: int,
    block_size: int,
    budget: int,
    max_num_seqs: int,
    requests: list[tuple[int, int, int]],
    abort_at: int,
) -> None:
    sched = make(num_blocks, block_size, max_num_seqs=max_num_seqs, budget=budget)
    bm = sched.block_manager
    all_seqs: list[Sequence] = []
    for arrival, (prompt_len, max_tokens, forks) in enumerate(requests):
        if prompt_len + max_tokens > num_blocks * block_size:
            continue  # the engine rejects these at add_request
        prompt = list(range(arrival * 100, arrival * 100 + prompt_len))
        if arrival % 2 and all_seqs:  # odd arrivals share a prefix with the first, for cache hits
            prompt = [*all_seqs[0].prompt_token_ids, *prompt][:prompt_len]
        s = Sequence(next(ids), prompt, max_tokens=max_tokens, num_forks=min(forks, max_num_seqs - 1))
        sched.add(s)
        all_seqs.append(s)
    steps = 0
    while sched.has_unfinished():
        out = step(sched)
        steps += 1
        assert steps < 1000, "scheduler made no progress"
        assert out.num_batched_tokens <= budget
        assert len(sched.running) <= max_num_seqs
        all_seqs.extend(out.forked)
        owners = [0] * num_blocks
        for s in sched.running:
            for b in s.block_table:
                owners[b] += 1
        assert [b.ref_count for b in bm.blocks] == owners
        if steps == abort_at and sched.running:
            victim = sched.running[-1]
            sched.finish(victim, SequenceStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == num_blocks
    for s in all_seqs:
        assert s.block_table == []
        if s.status is not SequenceStatus.FINISHED_ABORTED:
            assert s.status is SequenceStatus.FINISHED_LENGTH
            assert s.output_token_ids == [1000 + k for k in range(s.max_tokens or 0)]


def shared(prefix: list[int], suffix_len: int, **kwargs: object) -> Sequence:
    """A sequence whose prompt is `prefix` then tokens of its own."""
    seq_id = next(ids)
    own = list(range(seq_id * 1000, seq_id * 1000 + suffix_len))
    return Sequence(seq_id, prefix + own, max_tokens=2, **kwargs)  # type: ignore[arg-type]


def test_a_prefix_computed_now_is_read_from_the_cache_by_those_arriving_with_it() -> None:
    sched = make(block_size=4, budget=64)
    prefix = list(range(900_000, 900_010))  # 2 whole blocks and 2 tokens
    leader, follower, other = shared(prefix, 5), shared(prefix, 3), seq(6)
    for s in (leader, follower, other):
        sched.add(s)
    out = step(sched)
    # The follower would compute the leader's first two blocks again: it waits, and the one behind it runs.
    assert out.seqs == [leader, other] and list(sched.waiting) == [follower]
    prompt_len = len(follower.token_ids)
    out = step(sched)
    assert follower in out.newly_scheduled
    # Read from the cache: the two whole blocks, and the 2 prefix tokens the leader's third block starts with.
    assert out.num_new_tokens[out.seqs.index(follower)] == prompt_len - 10
    run(sched)


def test_a_follower_waits_while_a_chunked_leader_computes_their_blocks() -> None:
    sched = make(block_size=4, budget=10)
    prefix = list(range(800_000, 800_016))
    leader, follower = shared(prefix, 2), shared(prefix, 1)
    sched.add(leader)
    sched.add(follower)
    step(sched)  # the leader's first 10 tokens
    # The leader's last 8 leave room for the follower, which would read 2 blocks and compute the next 2 again.
    out = step(sched)
    assert out.seqs == [leader] and list(sched.waiting) == [follower]
    out = step(sched)
    assert follower in out.newly_scheduled and out.num_new_tokens[-1] == 1  # all 4 blocks read
    run(sched)


def test_without_prefix_caching_sequences_sharing_a_prefix_start_together() -> None:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64)
    sched = Scheduler(config, BlockManager(64, 4, enable_prefix_caching=False), watermark=0.0)
    prefix = list(range(700_000, 700_010))
    first, second = shared(prefix, 5), shared(prefix, 3)
    sched.add(first)
    sched.add(second)
    assert step(sched).seqs == [first, second]
    run(sched)
