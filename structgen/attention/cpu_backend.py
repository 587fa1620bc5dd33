"""The CPU attention backend: native kernels that read and write the paged KV cache in place.

Decode rows (a pure decode step, and the decoding sequences of a mixed step) go through one
`paged_decode_attention` call that walks each sequence's block table itself, instead of gathering every group
of sequences into a padded copy first; new keys/values are stored by one `write_kv_cache` call per layer.
Prefill rows keep the torch backend's path (SDPA on the fresh keys, or on a gathered cached prefix), where a
GEMM-based kernel beats a per-token loop. The torch backend stays the reference these kernels are tested
against, and the fallback where the kernels cannot be built.
"""

from __future__ import annotations

import torch

from structgen.attention.backend import AttentionMetadata, KVCache
from structgen.attention.torch_backend import TorchAttentionBackend, prefill_attention


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        from structgen.kernels import cpu_ops

        self._ops = cpu_ops
        # The decoding sequences of a mixed step and their query rows, computed once per step for all layers.
        self._decode_rows: (
            tuple[AttentionMetadata, list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None
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
            self._decode_rows = (metadata, *_decode_rows(metadata))
        _, decode_seqs, rows, tables, lens = self._decode_rows
        if decode_seqs:
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
        prefill_attention(query, key, value, key_cache, value_cache, metadata, out=out, scale=scale)
        return out


def _decode_rows(
    metadata: AttentionMetadata,
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoding sequences of a mixed step, their query rows, block tables and context lengths."""
    seqs, rows = [], []
    start = 0
    for i, query_len in enumerate(metadata.query_lens_cpu):
        if query_len == 1:
            seqs.append(i)
            rows.append(start)
        start += query_len
    index = torch.tensor(seqs, dtype=torch.long)
    return (
        seqs,
        torch.tensor(rows, dtype=torch.int32),
        metadata.block_tables.index_select(0, index),
        metadata.context_lens.index_select(0, index),
    )
