"""Tensor-parallel sharding math of the linear layers, checked rank by rank without a process group: the shards
each rank's `weight_loader` keeps must recombine into the full layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from structgen.errors import ModelLoadError
from structgen.models.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

HIDDEN = 8
gen = torch.Generator().manual_seed(0)


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_column_parallel_shards_concatenate_to_the_full_output(tp_size: int) -> None:
    weight, bias, x = _rand(12, HIDDEN), _rand(12), _rand(3, HIDDEN)
    outputs = []
    for rank in range(tp_size):
        layer = ColumnParallelLinear(HIDDEN, 12, bias=True, tp_rank=rank, tp_size=tp_size)
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        outputs.append(layer(x))
    torch.testing.assert_close(torch.cat(outputs, dim=-1), F.linear(x, weight, bias))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_merged_gate_up_keeps_each_ranks_slice_of_both(tp_size: int) -> None:
    gate, up, x = _rand(6, HIDDEN), _rand(6, HIDDEN), _rand(2, HIDDEN)
    for rank in range(tp_size):
        layer = MergedColumnParallelLinear(HIDDEN, [6, 6], tp_rank=rank, tp_size=tp_size)
        layer.weight.weight_loader(layer.weight, up, 1)  # shard order in the checkpoint does not matter
        layer.weight.weight_loader(layer.weight, gate, 0)
        rows = slice(rank * 6 // tp_size, (rank + 1) * 6 // tp_size)
        torch.testing.assert_close(layer(x), torch.cat([F.linear(x, gate[rows]), F.linear(x, up[rows])], -1))


@pytest.mark.parametrize(("tp_size", "kv_heads"), [(1, 2), (2, 2), (4, 2), (4, 4), (2, 1)])
def test_qkv_shards_split_query_heads_and_split_or_replicate_kv_heads(tp_size: int, kv_heads: int) -> None:
    heads, head_dim = 4, 2
    q, k, v = (
        _rand(heads * head_dim, HIDDEN),
        _rand(kv_heads * head_dim, HIDDEN),
        _rand(kv_heads * head_dim, HIDDEN),
    )
    for rank in range(tp_size):
        layer = QKVParallelLinear(HIDDEN, head_dim, heads, kv_heads, tp_rank=rank, tp_size=tp_size)
        for shard_id, tensor in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, tensor, shard_id)
        local_heads = heads // tp_size
        q_rows = q.view(heads, head_dim, HIDDEN)[rank * local_heads : (rank + 1) * local_heads]
        # The query heads a rank owns attend to KV head (query head // group), which the rank must hold.
        kv_head = rank * local_heads // (heads // kv_heads)
        local_kv = max(kv_heads // tp_size, 1)
        kv_slice = slice(kv_head, kv_head + local_kv)
        k_rows = k.view(kv_heads, head_dim, HIDDEN)[kv_slice]
        v_rows = v.view(kv_heads, head_dim, HIDDEN)[kv_slice]
        expected = torch.cat([q_rows.flatten(0, 1), k_rows.flatten(0, 1), v_rows.flatten(0, 1)])
        assert torch.equal(layer.weight, expected)
        assert (layer.num_heads, layer.num_kv_heads) == (local_heads, local_kv)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_row_parallel_partial_sums_add_up_to_the_full_output(tp_size: int) -> None:
    weight, bias, x = _rand(5, 12), _rand(5), _rand(3, 12)
    total = torch.zeros(3, 5)
    for rank in range(tp_size):
        layer = RowParallelLinear(12, 5, bias=True, tp_rank=rank, tp_size=tp_size)
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        cols = slice(rank * 12 // tp_size, (rank + 1) * 12 // tp_size)
        total += F.linear(x[:, cols], layer.weight)  # what each rank contributes to the all-reduce
        assert torch.equal(layer.bias, bias)
    torch.testing.assert_close(total + bias, F.linear(x, weight, bias))


@pytest.mark.parametrize("tp_size", [1, 2, 3])
def test_vocab_shards_cover_the_vocabulary_once(tp_size: int) -> None:
    vocab, weight, hidden = 10, _rand(10, HIDDEN), _rand(2, HIDDEN)
    rows, logits = [], []
    for rank in range(tp_size):
        head = ParallelLMHead(vocab, HIDDEN, tp_rank=rank, tp_size=tp_size)
        head.weight.weight_loader(head.weight, weight)
        real = head.vocab_end - head.vocab_start
        rows.append(head.weight[:real])
        assert torch.all(head.weight[real:] == 0)  # padding of the last shard
        logits.append(F.linear(hidden, head.weight))
    assert torch.equal(torch.cat(rows), weight)
    full = torch.cat(logits, dim=-1)[:, :vocab]
    torch.testing.assert_close(full, F.linear(hidden, weight))


def test_single_rank_layers_run_without_a_process_group() -> None:
    weight, ids = _rand(10, HIDDEN), torch.tensor([0, 9, 3])
    emb = VocabParallelEmbedding(10, HIDDEN)
    emb.weight.weight_loader(emb.weight, weight)
    assert torch.equal(emb(ids), weight[ids])
    head = ParallelLMHead(10, HIDDEN, shared_weight=emb.weight)
    assert head.weight is emb.weight
    torch.testing.assert_close(head.compute_logits(weight[ids]), weight[ids] @ weight.T)


def test_sharding_errors_are_clear() -> None:
    with pytest.raises(
        ModelLoadError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"
    ):
        QKVParallelLinear(HIDDEN, 2, 4, 2, tp_rank=0, tp_size=3)
    with pytest.raises(
        ModelLoadError, match=r"tensor_parallel_size \(4\) must be a multiple of num_key_value_heads \(3\)"
    ):
        QKVParallelLinear(HIDDEN, 2, 12, 3, tp_rank=0, tp_size=4)
    layer = QKVParallelLinear(HIDDEN, 2, 4, 2)
    with pytest.raises(ModelLoadError, match="shard id 'x' is not one of 'q', 'k', 'v'"):
        layer.weight.weight_loader(layer.weight, _rand(8, HIDDEN), "x")
    merged = MergedColumnParallelLinear(HIDDEN, [4, 4])
    with pytest.raises(ModelLoadError, match=r"shard id 2 is not one of 0\.\.1"):
        merged.weight.weight_loader(merged.weight, _rand(4, HIDDEN), 2)
