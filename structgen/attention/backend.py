"""The contract between models and attention implementations.

A model never sees how keys and values are stored: each attention layer hands its new q/k/v and its slice of
the paged KV cache to a backend, together with one `AttentionMetadata` that describes the whole flattened batch.
The torch backend (CPU, and the reference for kernels) and the Triton backend (GPU) implement the same call.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from structgen.attention.cpu_cache_memory import check_fits
from structgen.attention.huge_pages import zeros_on_huge_pages


@dataclass(slots=True)
class AttentionMetadata:
    """One engine step's batch, flattened: the new tokens of every sequence are concatenated.

    Sequence `i` owns rows `query_start_loc[i]:query_start_loc[i+1]` of q/k/v. Those new tokens sit at positions
    `context_lens[i] - query_len_i ... context_lens[i] - 1`; the earlier `context_lens[i] - query_len_i` tokens
    (prefix-cache hits, earlier chunks of a chunked prefill, earlier decode steps) are already in the cache.
    A decode step is the special case where every sequence has exactly one new token.

    Cache addressing: logical token `t` of sequence `i` lives in physical block `block_tables[i, t // block_size]`
    at offset `t % block_size`, i.e. flat slot `block * block_size + offset`.
    """

    slot_mapping: (
        torch.Tensor
    )  # [num_tokens] int64: flat cache slot each new token is written to; -1 = padding
    block_tables: (
        torch.Tensor
    )  # [num_seqs, max_blocks_per_seq] int32; entries past a sequence's blocks are -1
    context_lens: torch.Tensor  # [num_seqs] int32: tokens in the cache once this step's tokens are written
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: prefix sums of the new-token counts
    max_query_len: int
    max_context_len: int
    block_size: int
    # Host copies, so CPU backends and launch-grid sizing never force a device sync.
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's (key_cache, value_cache), each `[num_blocks, block_size, num_kv_heads, head_dim]`."""


class AttentionBackend(ABC):
    """Writes the new keys/values into the paged cache, then attends each new token causally to its sequence."""

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        *,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store key/value at `metadata.slot_mapping` (skipping -1), then return the attention output."""


def allocate_kv_cache(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    huge_pages: bool = True,
    commit: bool = True,
) -> list[KVCache]:
    """One (key, value) cache pair per layer, zero-filled so unwritten slots never hold NaNs; on the CPU on 2 MB
    pages where the OS gives them (see `huge_pages`; `huge_pages=False`: `torch.zeros`' pages, for comparison).
    `commit=False` (CPU, on 2 MB pages): the memory is committed as the cache first writes to it, not now.
    A CPU cache larger than the memory available raises `cpu_cache_memory.KVCacheTooLargeError`."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu:
        check_fits(2 * num_layers * math.prod(shape) * dtype.itemsize)
    if huge_pages and on_cpu:
        return [
            (
                zeros_on_huge_pages(shape, dtype, commit=commit),
                zeros_on_huge_pages(shape, dtype, commit=commit),
            )
            for _ in range(num_layers)
        ]
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
