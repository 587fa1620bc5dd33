"""Prompt blocks being computed right now, so that a waiting sequence sharing them waits for the cache.

The prefix cache serves blocks once they are computed and registered, after the step that wrote them. Requests
that arrive together with a shared prefix (one system prompt before many questions; lm-evaluation-harness
sending one context with each of its answers in one batch) would all be admitted in the same step and each
compute that prefix. Instead, while the next block a waiting sequence could take from the cache is one that a
running sequence's prompt is computing (a block of the same chained hash, so the same tokens after the same
prefix), the waiting sequence stays queued; the step after that block is registered it takes it from the cache.
The admission of the sequences behind it goes on (SGLang deprioritizes such requests in the same way).

The one computing the block (the leader) is running, so it gets there: a waiting sequence waits as long as the
blocks it would read are in flight and no longer. A sequence scoring its prompt only waits for a leader that
scores its own with at least as many alternatives, because only such blocks keep scores it can use.
"""

from __future__ import annotations

from collections.abc import Iterable

from structgen.engine.block_manager import BlockManager
from structgen.engine.sequence import Sequence


class InflightPrefixes:
    """The full prompt blocks the given (running or just admitted) sequences compute and have not registered."""

    __slots__ = ("_block_manager", "_leaders")

    def __init__(self, block_manager: BlockManager, running: Iterable[Sequence]) -> None:
        self._block_manager = block_manager
        self._leaders: dict[bytes, Sequence] = {}  # block hash -> the first sequence computing it
        for seq in running:
            self.add(seq)

    def add(self, seq: Sequence) -> None:
        """Count the prompt blocks `seq` has still to compute (none once its prefill is done)."""
        if seq.is_prefill_done:
            return
        bm = self._block_manager
        for index in range(seq.num_committed_blocks, len(seq.token_ids) // bm.block_size):
            self._leaders.setdefault(bm.block_hash(seq, index), seq)

    def holds_next(self, seq: Sequence, num_cached_tokens: int) -> bool:
        """Whether the block after the `num_cached_tokens` a waiting sequence would read from the cache is being
        computed by another sequence, one whose registered block `seq` could use."""
        bm = self._block_manager
        if seq.scores_prompt and num_cached_tokens:
            num_cached_tokens += 1  # its cached prefix stops one token short of the blocks it reads
        index = num_cached_tokens // bm.block_size
        if index >= (len(seq.token_ids) - 1) // bm.block_size:
            return False  # no whole block left that the cache could serve (the last token always runs)
        leader = self._leaders.get(bm.block_hash(seq, index))
        if leader is None or leader is seq:
            return False
        if not seq.scores_prompt:
            return True
        wanted = seq.params.prompt_logprobs or 0  # type: ignore[union-attr]
        return leader.scores_prompt and (leader.params.prompt_logprobs or 0) >= wanted  # type: ignore[union-attr]
