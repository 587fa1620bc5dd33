"""CUDA graphs for decode steps: each (padded batch size, context bucket) is captured once and then replayed.

A decode step launches a few kernels per layer; at small batches their launch overhead rivals the work. A graph
replays the whole forward in one launch, but it reads its inputs from fixed addresses and its kernel grids are
frozen at capture. So the live batch is copied into static buffers, padded up to the nearest captured batch
size, and the attention grid is sized for an upper bound of the context length: the context's power-of-two
bucket, which becomes part of the graph's key. Padding rows are harmless by construction: their slot is -1
(nothing is stored), their context is one token in block 0 (finite garbage is read), and their outputs are
sliced away. Only the Triton attention backend reads lengths on the device, so graphs are used with it only.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from dataclasses import dataclass

import torch
from torch import nn

from structgen.attention import AttentionMetadata, KVCache

logger = logging.getLogger(__name__)

CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MIN_CONTEXT_BUCKET = 1024


def padded_batch_size(num_seqs: int, sizes: tuple[int, ...] = CAPTURE_SIZES) -> int | None:
    """The smallest captured size that holds `num_seqs` sequences; None when the batch is larger than all."""
    i = bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def context_bucket(max_context_len: int) -> int:
    """The power of two (at least `MIN_CONTEXT_BUCKET`) a graph's attention grid is sized for."""
    return max(MIN_CONTEXT_BUCKET, 1 << (max_context_len - 1).bit_length())


@dataclass(slots=True)
class DecodeBuffers:
    """The static inputs every captured graph reads; graph `size` uses the first `size` rows."""

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32
    context_lens: torch.Tensor  # [max_batch] int32
    query_start_loc: torch.Tensor  # [max_batch + 1] int32: 0, 1, 2, ... (one token per sequence, fixed)

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> DecodeBuffers:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_batch, dtype=torch.long),
            positions=zeros(max_batch, dtype=torch.long),
            slot_mapping=zeros(max_batch, dtype=torch.long),
            block_tables=zeros(max_batch, max_blocks, dtype=torch.int32),
            context_lens=zeros(max_batch, dtype=torch.int32),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
        )

    def fill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, size: int
    ) -> None:
        """Copy a live decode batch into the first rows and make rows `num_seqs .. size-1` padding."""
        n, width = metadata.block_tables.shape
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.context_lens[:n].copy_(metadata.context_lens)
        # Columns past `width` keep stale entries: the kernels read only a sequence's first
        # ceil(context_len / block_size) columns, which all lie in the copied part.
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.context_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].zero_()

    def metadata(self, size: int, *, max_context_len: int, block_size: int) -> AttentionMetadata:
        """Metadata over the first `size` rows. Its host fields are what capture sees: `max_context_len` is the
        bucket (an upper bound) and the per-sequence lists only say "one token each"."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_context_len=max_context_len,
            block_size=block_size,
            query_lens_cpu=[1] * size,
            context_lens_cpu=[max_context_len] * size,
        )


class CUDAGraphRunner:
    """Runs decode steps of `model` through captured graphs (captured lazily, on the first step of each key)."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[KVCache],
        *,
        block_size: int,
        max_context_len: int,
        device: torch.device,
        sizes: tuple[int, ...] = CAPTURE_SIZES,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_context_len = max_context_len
        self.sizes = sizes
        max_blocks = -(-context_bucket(max_context_len) // block_size)
        self.buffers = DecodeBuffers.allocate(sizes[-1], max_blocks, device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None  # one memory pool shared by every graph (their outputs are never live together)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return (
            metadata.is_decode
            and padded_batch_size(metadata.num_seqs, self.sizes) is not None
            and metadata.max_context_len <= self.max_context_len
            and metadata.block_tables.shape[1] <= self.buffers.block_tables.shape[1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states `[num_seqs, hidden]` of a decode batch (`can_run` must hold). The result is a view of
        the graph's output buffer: valid until the next `run`."""
        size = padded_batch_size(metadata.num_seqs, self.sizes)
        assert size is not None
        key = (size, context_bucket(metadata.max_context_len))
        self.buffers.fill(input_ids, positions, metadata, size)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(*key)
        graph, output = entry
        graph.replay()
        return output[: metadata.num_seqs]

    def _capture(self, size: int, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        buffers = self.buffers
        metadata = buffers.metadata(size, max_context_len=bucket, block_size=self.block_size)
        args = (buffers.input_ids[:size], buffers.positions[:size], self.kv_caches, metadata)
        # One eager run first: Triton compiles its kernels (and autotunes nothing) outside the capture.
        self.model(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.model(*args)
        if self._pool is None:
            self._pool = graph.pool()
        logger.info("captured a decode CUDA graph: batch %d, context bucket %d", size, bucket)
        return graph, output


def uses_triton_attention(model: nn.Module) -> bool:
    """Whether every attention layer of `model` runs the Triton backend (graphs need device-side lengths)."""
    backends = [m.attn_backend for m in model.modules() if hasattr(m, "attn_backend")]
    return bool(backends) and all(getattr(b, "name", "") == "triton" for b in backends)
