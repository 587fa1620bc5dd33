"""The CPU-testable half of decode CUDA graphs: choosing the padded batch size and context bucket, filling the
static buffers (padding rows: slot -1, one-token context in block 0), and that a padded batch run the way a graph
runs it (Triton backend under the interpreter, grid sized for the bucket) gives the live rows' exact outputs and
cache writes."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports structgen.kernels

import pytest
import torch
from structgen.kernels import paged_attention_decode as decode_module

from structgen.attention import AttentionMetadata, TorchAttentionBackend
from structgen.attention.triton_backend import TritonAttentionBackend
from structgen.engine.cuda_graphs import (
    CAPTURE_SIZES,
    DecodeBuffers,
    context_bucket,
    padded_batch_size,
    uses_triton_attention,
)

BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 4, 2, 4, 16


@pytest.mark.parametrize(("n", "size"), [(1, 1), (3, 4), (17, 24), (200, 224), (256, 256), (257, None)])
def test_padded_batch_size(n: int, size: int | None) -> None:
    assert padded_batch_size(n) == size


def test_context_bucket() -> None:
    assert [context_bucket(n) for n in (1, 1024, 1025, 5000)] == [1024, 1024, 2048, 8192]
    assert tuple(sorted(CAPTURE_SIZES)) == CAPTURE_SIZES


def _live_batch() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    # Three decoding sequences with 5, 1 and 8 tokens of context (the newest one is written this step).
    tables = torch.tensor([[3, 1], [4, -1], [0, 2]], dtype=torch.int32)
    contexts = [5, 1, 8]
    slots = [
        int(tables[i, (c - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (c - 1) % BLOCK_SIZE
        for i, c in enumerate(contexts)
    ]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        max_query_len=1,
        max_context_len=8,
        block_size=BLOCK_SIZE,
        query_lens_cpu=[1, 1, 1],
        context_lens_cpu=contexts,
    )
    return torch.tensor([11, 12, 13]), torch.tensor([4, 0, 7]), metadata


def test_fill_pads_and_slices() -> None:
    buffers = DecodeBuffers.allocate(8, 5, torch.device("cpu"))
    buffers.block_tables.fill_(7)  # stale contents from an earlier step
    ids, positions, live = _live_batch()
    buffers.fill(ids, positions, live, 4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [4, 0, 7, 0]
    assert buffers.slot_mapping[:4].tolist() == [*live.slot_mapping.tolist(), -1]
    assert buffers.context_lens[:4].tolist() == [5, 1, 8, 1]
    assert buffers.block_tables[:3, :2].tolist() == live.block_tables.tolist()
    assert int(buffers.block_tables[3, 0]) == 0  # the padding row reads block 0
    metadata = buffers.metadata(4, max_context_len=1024, block_size=BLOCK_SIZE)
    assert metadata.is_decode and metadata.num_seqs == 4 and metadata.max_context_len == 1024
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert (
        metadata.block_tables.data_ptr() == buffers.block_tables.data_ptr()
    )  # views: a graph sees new steps


def test_padded_bucketed_batch_matches_live_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (6, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    q = torch.randn(3, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(3, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(3, KV_HEADS, HEAD_DIM, generator=gen)
    ids, positions, live = _live_batch()
    expected_cache = (cache[0].clone(), cache[1].clone())
    expected = TorchAttentionBackend().forward(q, k, v, expected_cache, live, scale=0.25)

    buffers = DecodeBuffers.allocate(8, 5, torch.device("cpu"))
    buffers.fill(ids, positions, live, 4)
    padded = buffers.metadata(4, max_context_len=context_bucket(8), block_size=BLOCK_SIZE)
    pad = torch.randn(1, HEADS, HEAD_DIM, generator=gen)
    q4, k4, v4 = torch.cat([q, pad]), torch.cat([k, pad[:, :KV_HEADS]]), torch.cat([v, pad[:, :KV_HEADS]])
    for split in (False, True):  # both decode-kernel paths a capture may freeze
        monkeypatch.setattr(decode_module, "_should_split", lambda *args, split=split: split)
        run_cache = (cache[0].clone(), cache[1].clone())
        out = TritonAttentionBackend().forward(q4, k4, v4, run_cache, padded, scale=0.25)
        torch.testing.assert_close(out[:3], expected, atol=2e-5, rtol=2e-5)
        assert bool(out[3].isfinite().all())
        assert torch.equal(run_cache[0], expected_cache[0]) and torch.equal(run_cache[1], expected_cache[1])


def test_uses_triton_attention() -> None:
    class Layer(torch.nn.Module):
        def __init__(self, backend: object) -> None:
            super().__init__()
            self.attn_backend = backend

    assert uses_triton_attention(
        torch.nn.Sequential(Layer(TritonAttentionBackend()), Layer(TritonAttentionBackend()))
    )
    assert not uses_triton_attention(
        torch.nn.Sequential(Layer(TritonAttentionBackend()), Layer(TorchAttentionBackend()))
    )
    assert not uses_triton_attention(torch.nn.Linear(2, 2))
