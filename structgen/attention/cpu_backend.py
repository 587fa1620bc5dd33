"""The CPU attention backend: native kernels that read and write the paged KV cache in place.

Decode rows (a pure decode step, and the decoding sequences of a mixed step) go through one
`paged_decode_attention` call that walks each sequence's block table itself, instead of gathering every group
of sequences into a padded copy first; new keys/values are stored by one `write_kv_cache` call per layer.
So do the few new tokens of a sequence extending a cached context (the tokens a grammar forced after the last
pick, jump-forward, are fed with the next one: 2-10 tokens on a long context): each token is one more decode
row, seeing the context up to itself, where the prefill path would gather the whole context and run SDPA per
sequence and layer (on structured outputs that was a third of the forward). Longer prefill rows go through one
`prefill_attention` call a sequence (flash attention on the paged cache: bf16 on AVX512-BF16 and fp32 on AVX-512F,
a 960-token prompt's attention ~4x faster than SDPA's causal path in bf16, ~2.8x in fp32; fp32 on AVX2 + FMA
CPUs without AVX-512: 2.8x faster than SDPA at 128 tokens to 1.6x at 2,048 on a 2-core Zen 3), or, on CPUs or
dtypes it does not take, the torch backend's path (SDPA on the fresh keys, or on a gathered cached prefix). The
torch backend stays the reference these kernels are tested against, and the fallback where they cannot be built.
"""

from __future__ import annotations

import torch

from structgen.attention.backend import AttentionMetadata, KVCache
from structgen.attention.torch_backend import TorchAttentionBackend, prefill_attention, prefill_sequences

# New tokens of one sequence on top of a cached context that still go through the decode kernel, one row each.
# Each row reads the whole context again, so this holds for a few tokens only; a prompt's chunk goes to SDPA.
MAX_EXTEND_AS_DECODE = 16


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        from structgen.kernels import cpu_ops, cpu_prefill_attention

        self._ops = cpu_ops
        self._prefill = cpu_prefill_attention
        # The decode rows of a mixed step (see `decode_rows`), computed once per step for all layers.
        self._decode_rows: (
            tuple[AttentionMetadata, frozenset[int], torch.Tensor, torch.Tensor, torch.Tensor] | None
        )
        self._decode_rows = None

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
        self._ops.write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        if metadata.is_decode:
            return self._ops.paged_decode_attention(
                query,
                key_cache,
                value_cache,
                block_tables=metadata.block_tables,
                context_lens=metadata.context_lens,
                scale=scale,
            )
        out = torch.zeros_like(query)  # rows of no sequence (padding) stay finite
        if self._decode_rows is None or self._decode_rows[0] is not metadata:
            self._decode_rows = (metadata, *decode_rows(metadata))
        _, decode_seqs, rows, tables, lens = self._decode_rows
        if len(rows):
            self._ops.paged_decode_attention(
                query,
                key_cache,
                value_cache,
                block_tables=tables,
                context_lens=lens,
                scale=scale,
                out=out,
                rows=rows,
            )
        if len(decode_seqs) == metadata.num_seqs:
            return out
        if self._prefill.supports(query, key_cache):
            self._prefill_from_cache(query, key_cache, value_cache, metadata, out, scale, decode_seqs)
        else:
            prefill_attention(
                query, key, value, key_cache, value_cache, metadata, out=out, scale=scale, skip=decode_seqs
            )
        return out

    def _prefill_from_cache(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor,
        scale: float,
        skip: frozenset[int],
    ) -> None:
        """The sequences with several new tokens (but those in `skip`), one kernel call each, reading the whole
        context (its new keys were just written) from the paged cache."""
        for i, rows, context_len in prefill_sequences(metadata, skip):
            self._prefill.prefill_attention(
                query[rows],
                key_cache,
                value_cache,
                block_table=metadata.block_tables[i],
                context_len=context_len,
                scale=scale,
                out=out[rows],
            )


def decode_rows(
    metadata: AttentionMetadata,
) -> tuple[frozenset[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequences of a mixed step attended as decode rows (one new token, or a few on a cached context),
    and per row: its query row, its sequence's block table and the context it sees (up to itself)."""
    seqs, rows, owners, lens = [], [], [], []
    start = 0
    for i, (query_len, context_len) in enumerate(
        zip(metadata.query_lens_cpu, metadata.context_lens_cpu, strict=True)
    ):
        if query_len == 1 or (query_len <= MAX_EXTEND_AS_DECODE and context_len > query_len):
            seqs.append(i)
            first = context_len - query_len + 1  # the first new token sees the cached context and itself
            rows.extend(range(start, start + query_len))
            owners.extend([i] * query_len)
            lens.extend(range(first, context_len + 1))
        start += query_len
    return (
        frozenset(seqs),
        torch.tensor(rows, dtype=torch.int32),
        metadata.block_tables.index_select(0, torch.tensor(owners, dtype=torch.long)),
        torch.tensor(lens, dtype=torch.int32),
    )
