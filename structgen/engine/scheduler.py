"""Iteration-level (continuous) batching with chunked prefill and preemption by recomputation.

Every step has a token budget (`max_num_batched_tokens`). Running sequences go first, oldest first: a decode
takes one token, an unfinished prefill takes a chunk of what is left. Then waiting sequences are admitted in
arrival order (FCFS) while the budget, `max_num_seqs` and free blocks allow, reusing prefix-cache hits. A
sequence waiting on something external (`WAITING_FOR_GRAMMAR`) is passed over until its `ready()` says so,
without holding up the ones behind it. When a running sequence needs a block and none is free, the most recently
admitted sequence is preempted: its blocks go back to the pool and it waits at the front of the queue to
recompute its tokens (its registered blocks often come straight back from the prefix cache).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from structgen.config import SchedulerConfig
from structgen.engine.block_manager import BlockManager, CachedPrefix
from structgen.engine.inflight_prefixes import InflightPrefixes
from structgen.engine.prompt_logprobs import cached_scored_prefix, take_cached_scores
from structgen.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    import torch

# Makes the sampling generator of fork `index` of a sequence (seeded requests derive `seed + index`).
GeneratorFactory = Callable[[Sequence, int], "torch.Generator | None"]


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch. `seqs[i]` runs its next `num_new_tokens[i]` tokens through the model.

    `sample_seqs[j]` samples its next token from the logits at the last new token of `seqs[sample_indices[j]]`
    (forks of `n > 1` share their parent's row).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    forked: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    newly_scheduled: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        *,
        fork_generator: GeneratorFactory | None = None,
        watermark: float = 0.01,
        max_loras: int | None = None,
    ) -> None:
        self.config = config
        # With LoRA: the most distinct adapters the running sequences may use at once (the model's slots); a
        # waiting sequence of another adapter waits until one of them has no running sequence left.
        self.max_loras = max_loras
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._fork_generator = fork_generator
        # Admission leaves a few blocks free so running sequences can grow without preempting at once.
        self._watermark_blocks = int(watermark * block_manager.num_blocks)
        self._seq_ids = itertools.count(1 << 40)  # forks get ids far from the engine's own counter

    # -- queue management --------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_for_grammar(self) -> int:
        return sum(1 for seq in self.waiting if seq.status is SequenceStatus.WAITING_FOR_GRAMMAR)

    def fork_unscheduled(self, seq: Sequence) -> list[Sequence]:
        """The pending `n - 1` samples of a sequence that ends before it ever ran (a grammar that forces the
        whole output): copies of it, with no blocks to share."""
        children = []
        for index in range(1, seq.num_pending_forks + 1):
            generator = self._fork_generator(seq, index) if self._fork_generator else None
            children.append(seq.fork(next(self._seq_ids), index, generator))
        seq.num_pending_forks = 0
        return children

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark `seq` finished and return its blocks now; it leaves the queues on the next `schedule()`."""
        assert status.is_finished, status
        seq.status = status
        self.block_manager.free(seq)

    # -- the step ----------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.drop_finished()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        forked: list[Sequence] = []

        # 1. Running sequences, oldest first; preempt from the newest end when the pool runs dry.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = len(seq.token_ids) - seq.num_computed_tokens
            # A chunk leaves one token of budget for each running sequence behind it, so decodes never starve.
            num_new = min(num_new, budget - (len(self.running) - i - 1))
            if num_new <= 0:
                i += 1
                continue
            copies = self.block_manager.allocate_slots(seq, num_new)
            while copies is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                copies = self.block_manager.allocate_slots(seq, num_new)
            if copies is None:
                continue  # `seq` preempted itself; it was the last one
            budget -= self._schedule(out, seq, num_new, copies, forked)
            i += 1

        # 2. Waiting sequences in arrival order; none are admitted in a step that had to preempt.
        if not out.preempted:
            budget = self._admit(out, budget, forked)

        self.running.extend(forked)
        return out

    def _admit(self, out: SchedulerOutput, budget: int, forked: list[Sequence]) -> int:
        bm = self.block_manager
        skipped: list[Sequence] = []
        # Prompt blocks computed now: a waiting sequence that would compute them too waits for the cache. Listed
        # on the first sequence that gets that far (most steps admit nobody), then kept up as sequences start.
        inflight: InflightPrefixes | None = None
        loras = {s.lora for s in self.running if s.lora is not None} if self.max_loras is not None else set()
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.status is SequenceStatus.WAITING_FOR_GRAMMAR:
                if seq.ready is not None and seq.ready():
                    seq.status = SequenceStatus.WAITING
                else:
                    skipped.append(self.waiting.popleft())
                    continue
            if (
                self.max_loras is not None
                and seq.lora is not None
                and seq.lora not in loras
                and len(loras) >= self.max_loras
            ):
                skipped.append(self.waiting.popleft())  # every slot is taken by adapters still running
                continue
            if len(self.running) + len(forked) + 1 + seq.num_pending_forks > self.config.max_num_seqs:
                break
            watermark = self._watermark_blocks if self.running else 0
            scores = None
            if seq.scores_prompt:  # only blocks whose prompt scores were kept with them
                cached, scores = cached_scored_prefix(bm, seq)
            else:
                cached = bm.find_cached_prefix(seq)
            if inflight is None and bm.enable_prefix_caching:
                inflight = InflightPrefixes(bm, self.running)
            if inflight is not None and inflight.holds_next(seq, cached.num_tokens(bm.block_size)):
                skipped.append(self.waiting.popleft())  # it reads those blocks from the cache next step
                continue
            num_new = self._prefill_fits(cached, seq, budget, watermark)
            if num_new is None and cached.partial_tokens:
                # Reusing a block in part costs its copy: where the pool is too small for that (a prompt that
                # needs every block), recompute those tokens instead of waiting for room that never comes.
                cached = cached.whole_blocks()
                num_new = self._prefill_fits(cached, seq, budget, watermark)
            if num_new is None:
                break
            self.waiting.popleft()
            bm.allocate_cached(seq, cached)
            if scores:
                take_cached_scores(seq, scores)
            copies = bm.allocate_slots(seq, num_new)  # a block reused in part is copied first
            assert copies is not None, "can_allocate promised room"
            seq.status = SequenceStatus.RUNNING
            if seq.lora is not None:
                loras.add(seq.lora)
            self.running.append(seq)
            out.newly_scheduled.append(seq)
            if inflight is not None:
                inflight.add(seq)
            budget -= self._schedule(out, seq, num_new, copies, forked)
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _prefill_fits(self, cached: CachedPrefix, seq: Sequence, budget: int, watermark: int) -> int | None:
        """The new tokens a waiting sequence computes this step on top of `cached`, or None where it cannot
        start now: a prompt over the budget without chunked prefill, or too few free blocks."""
        bm = self.block_manager
        num_cached = cached.num_tokens(bm.block_size)
        num_new = len(seq.token_ids) - num_cached
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return None
            num_new = budget
        if not bm.can_allocate(cached, num_cached + num_new, watermark=watermark):
            return None
        return num_new

    def _schedule(
        self,
        out: SchedulerOutput,
        seq: Sequence,
        num_new: int,
        copies: list[tuple[int, int]],
        forked: list[Sequence],
    ) -> int:
        out.seqs.append(seq)
        out.num_new_tokens.append(num_new)
        out.blocks_to_copy.extend(copies)
        if seq.num_computed_tokens + num_new == len(seq.token_ids):
            row = len(out.seqs) - 1
            out.sample_seqs.append(seq)
            out.sample_indices.append(row)
            if seq.num_pending_forks:
                # The prompt is complete after this step: the other `n - 1` samples start here, sharing its
                # blocks and sampling from the same logits row.
                for index in range(1, seq.num_pending_forks + 1):
                    generator = self._fork_generator(seq, index) if self._fork_generator else None
                    child = seq.fork(next(self._seq_ids), index, generator)
                    child.num_computed_tokens = seq.num_computed_tokens + num_new
                    self.block_manager.fork(seq, child)
                    forked.append(child)
                    out.forked.append(child)
                    out.sample_seqs.append(child)
                    out.sample_indices.append(row)
                seq.num_pending_forks = 0
        return num_new

    def update(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens now have KV; offer newly full blocks to the prefix cache."""
        bm = self.block_manager
        for seq, num_new in zip(out.seqs, out.num_new_tokens, strict=True):
            if seq.is_finished:
                continue  # aborted while the step ran; its blocks are already back
            seq.num_computed_tokens += num_new
            bm.commit(seq)

    # -- helpers -----------------------------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def restart(self, seq: Sequence) -> None:
        """Send a running sequence back to the front of the queue to generate again from its (already reset)
        tokens: its blocks go back to the pool, and its prompt usually returns from the prefix cache."""
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.block_hashes = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def drop_finished(self) -> None:
        """Forget finished sequences (their blocks were returned by `finish`)."""
        if any(seq.is_finished for seq in self.running):
            self.running = [seq for seq in self.running if not seq.is_finished]
        if any(seq.is_finished for seq in self.waiting):
            self.waiting = deque(seq for seq in self.waiting if not seq.is_finished)
