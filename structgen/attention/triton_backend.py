"""The Triton attention backend: `store_kv` writes the step's keys/values into the paged cache, then a pure decode
step runs `paged_attention_decode` (split-K for long contexts) and any step with a prefill chunk runs
`paged_attention_prefill` over the whole flattened batch (its one-token rows are decodes).

On CUDA this is the default. On the CPU it runs only under Triton's interpreter (`TRITON_INTERPRET=1`, set before
the kernels are imported), which is how the tests compare it with the torch backend.
"""

from __future__ import annotations

import torch

from structgen.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from structgen.kernels.paged_attention_decode import paged_attention_decode
from structgen.kernels.paged_attention_prefill import paged_attention_prefill
from structgen.kernels.store_kv import store_kv


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        *,
        scale: float,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        if metadata.is_decode:
            return paged_attention_decode(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.context_lens,
                max_context_len=metadata.max_context_len,
                scale=scale,
            )
        return paged_attention_prefill(
            query,
            key,
            value,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.context_lens,
            metadata.query_start_loc,
            max_query_len=metadata.max_query_len,
            scale=scale,
        )
