"""The KV block pool: block tables, reference counts and the automatic prefix cache.

Logical token `t` of a sequence lives in `seq.block_table[t // block_size]`. A sequence owns one reference to
each block of its table; blocks are taken exactly when a token needs a slot and released the moment the sequence
finishes, is aborted or preempted.

Prefix caching: once a block is full and its KV computed, it is registered under a chained hash
(sha256 of the parent block's hash + this block's token ids; the root hash covers the model id), so a later
sequence with the same tokens up to that point can reuse it instead of recomputing. Past its last whole
block, a sequence also reuses the leading tokens it shares with a registered block under the same parent (the
same system prompt, then a different question): it takes that block for those tokens and copies it before its
first write into it, as a fork does (`CachedPrefix.partial_tokens`; vLLM reuses whole blocks only, SGLang's
radix tree any prefix). A released cached block
keeps its contents and registration and goes to an LRU list; it is only overwritten when the pool has no
never-cached block left (eviction). Blocks with references are never evicted, and a block another sequence
also references is never written: a sequence about to write into a shared, partially filled block (a fork of
`n > 1`) first copies it (copy-on-write); full blocks are never written again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import islice

from structgen.engine.outputs import TokenLogprob
from structgen.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# How many registered blocks under one parent (and with the same first token) a sequence compares its next
# tokens with, the most recently registered first: many requests share a system prompt and then differ.
PARTIAL_CANDIDATES = 16


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((j for j in range(n) if a[j] != b[j]), n)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # what a registered block holds, to verify a hash hit
    parent: bytes = b""  # the hash its chain continues (a registered block's), for partial reuse
    # A registered block's prompt scores (`structgen.engine.prompt_logprobs`): (the alternatives each entry holds,
    # one entry per token). They depend only on the tokens up to theirs, which the block's hash chain covers.
    scores: tuple[int, tuple[TokenLogprob | None, ...]] | None = None


@dataclass(slots=True)
class CachedPrefix:
    """What a waiting sequence can reuse: whole cached blocks, the last of them possibly only for its first
    `partial_tokens` tokens (0: every block whole)."""

    blocks: list[int]
    partial_tokens: int = 0

    def num_tokens(self, block_size: int) -> int:
        if not self.partial_tokens:
            return len(self.blocks) * block_size
        return (len(self.blocks) - 1) * block_size + self.partial_tokens

    def whole_blocks(self) -> CachedPrefix:
        """The same prefix without a partly reused last block (whose copy costs one more block)."""
        return CachedPrefix(self.blocks[:-1]) if self.partial_tokens else self


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        cache_salt: str = "",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # ref count 0 and not registered
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref count 0, registered; oldest first
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        # (parent hash, first token) -> registered block ids under it, oldest first: partial reuse's candidates.
        self._children: dict[tuple[bytes, int], dict[int, None]] = {}
        # Anything that changes the KV for the same tokens goes into the root hash: the model, and a sequence's
        # LoRA adapter (`_root_of`).
        self._root_hash = hashlib.sha256(f"structgen-kv:{cache_salt}".encode()).digest()
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0

    # -- pool state --------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take now: never-cached ones plus cached ones that no sequence references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def free_block_ids(self) -> set[int]:
        return set(self._free) | set(self._evictable)

    # -- prefix cache ------------------------------------------------------------------------------------------

    def block_hash(self, seq: Sequence, index: int) -> bytes:
        """Chained hash of full block `index` of `seq.token_ids`, memoised on the sequence."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[i - 1] if i else self._root_of(seq)
            tokens = array("q", seq.token_ids[i * bs : (i + 1) * bs]).tobytes()
            hashes.append(hashlib.sha256(parent + tokens).digest())
        return hashes[index]

    def _root_of(self, seq: Sequence) -> bytes:
        """The root hash of `seq`'s chain: the model's, or under a LoRA adapter one of that adapter's own."""
        if seq.lora is None:
            return self._root_hash
        return hashlib.sha256(self._root_hash + seq.lora.cache_key).digest()

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest chain of cached blocks matching `seq`'s leading full blocks, then the registered block
        under the same parent that shares the most of `seq`'s next tokens (if any does).

        Never covers the last token: it must run through the model so there are logits to sample from.
        """
        if not self.enable_prefix_caching:
            return CachedPrefix([])
        bs = self.block_size
        hits: list[int] = []
        for i in range((len(seq.token_ids) - 1) // bs):
            block_id = self._cached.get(self.block_hash(seq, i))
            if block_id is None:
                break
            # A hash match is verified against the stored tokens, so a collision can never serve wrong KV.
            if self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        block_id, shared = self._partial_match(seq, len(hits))
        return CachedPrefix([*hits, block_id], shared) if shared else CachedPrefix(hits)

    def _partial_match(self, seq: Sequence, index: int) -> tuple[int, int]:
        """(block id, tokens shared) of the registered block continuing `seq`'s first `index` blocks that
        shares the most of `seq`'s next tokens (at most all but its last token); (-1, 0) if none."""
        bs = self.block_size
        start = index * bs
        wanted = seq.token_ids[start : min(start + bs, len(seq.token_ids) - 1)]
        if not wanted:
            return -1, 0
        parent = self.block_hash(seq, index - 1) if index else self._root_of(seq)
        candidates = self._children.get((parent, wanted[0]), {})
        best, best_shared = -1, 0
        for block_id in islice(reversed(candidates), PARTIAL_CANDIDATES):
            tokens = self.blocks[block_id].token_ids
            shared = _common_prefix(tokens, wanted)
            if shared > best_shared:
                best, best_shared = block_id, shared
                if shared == len(wanted):
                    break
        return best, best_shared

    def commit(self, seq: Sequence) -> None:
        """Register `seq`'s full, computed blocks in the prefix cache (call after each step that wrote KV)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        for i in range(seq.num_committed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue  # a prefix hit, or a block shared with a fork that already registered it
            block_hash = self.block_hash(seq, i)
            if block_hash in self._cached:
                # Another sequence computed the same block (concurrently, or it was cached and this one scores
                # its prompt): keep the first copy, with this one's prompt scores if it had none.
                self._keep_scores(self.blocks[self._cached[block_hash]], seq, i)
                continue
            block.hash = block_hash
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block.parent = self.block_hash(seq, i - 1) if i else self._root_of(seq)
            self._cached[block_hash] = block.block_id
            self._children.setdefault((block.parent, block.token_ids[0]), {})[block.block_id] = None
            self._keep_scores(block, seq, i)
        seq.num_committed_blocks = max(seq.num_committed_blocks, num_full)

    def _keep_scores(self, block: Block, seq: Sequence, index: int) -> None:
        """Store the prompt scores of `seq`'s block `index` with the registered `block`, where `seq` scored all
        its tokens and the block holds none with as many alternatives."""
        entries = seq.prompt_logprobs
        bs = self.block_size
        if entries is None or len(entries) < (index + 1) * bs or seq.params is None:
            return
        k = seq.params.prompt_logprobs or 0
        if block.scores is None or block.scores[0] < k:
            block.scores = (k, tuple(entries[index * bs : (index + 1) * bs]))

    # -- allocation --------------------------------------------------------------------------------------------

    def can_allocate(self, cached: CachedPrefix, num_tokens: int, *, watermark: int = 0) -> bool:
        """Whether a waiting sequence can take `cached` prefix blocks plus new blocks up to `num_tokens`
        tokens while leaving `watermark` blocks free."""
        # A block reused in part is copied before its first write: one more new block.
        num_new = cdiv(num_tokens, self.block_size) - len(cached.blocks) + (cached.partial_tokens > 0)
        # Hit blocks nobody references sit in the free pool; taking them shrinks it.
        num_reclaimed = sum(1 for b in cached.blocks if self.blocks[b].ref_count == 0)
        return self.num_free_blocks - num_reclaimed - num_new >= watermark

    def allocate_cached(self, seq: Sequence, cached: CachedPrefix) -> None:
        """Give a waiting sequence (no blocks) the prefix-cache hits found for it, marking them computed."""
        assert not seq.block_table, f"{seq} already holds blocks"
        for block_id in cached.blocks:
            self._take_ref(block_id)
        seq.block_table = list(cached.blocks)
        seq.num_computed_tokens = cached.num_tokens(self.block_size)
        seq.num_committed_blocks = seq.num_computed_tokens // self.block_size
        if self.enable_prefix_caching:
            self.num_queried_tokens += len(seq.token_ids)
            self.num_hit_tokens += seq.num_computed_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Make room for `seq`'s next `num_new_tokens` tokens.

        Returns the (src, dst) block copies the runner must do before writing (copy-on-write of a shared,
        partially filled last block), or None, changing nothing, when the pool is too small.
        """
        bs = self.block_size
        table = seq.block_table
        start = seq.num_computed_tokens
        num_missing = cdiv(start + num_new_tokens, bs) - len(table)
        # Shared by a fork, or a registered block reused in part (`CachedPrefix`): never written in place.
        last = self.blocks[table[start // bs]] if start % bs else None
        cow = last is not None and (last.ref_count > 1 or last.hash is not None)
        if num_missing + cow > self.num_free_blocks:
            return None
        copies: list[tuple[int, int]] = []
        if cow:
            index = start // bs
            src = table[index]
            dst = self._take_free()
            self._release(src)
            table[index] = dst
            copies.append((src, dst))
        for _ in range(num_missing):
            table.append(self._take_free())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (including a partial last block, copied on first write)."""
        assert not child.block_table, f"{child} already holds blocks"
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks. Tail blocks go first so the LRU evicts them before shared prefixes."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []

    # -- internals ---------------------------------------------------------------------------------------------

    def _take_ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self._cached[block.hash]  # type: ignore[arg-type]
            siblings = self._children[(block.parent, block.token_ids[0])]
            del siblings[block_id]
            if not siblings:
                del self._children[(block.parent, block.token_ids[0])]
            block.hash = None
            block.token_ids = ()
            block.parent = b""
            block.scores = None
            self.num_evictions += 1
        self.blocks[block_id].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released more often than taken"
        if block.ref_count == 0:
            if block.hash is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)
