"""Tensor-parallel-ready linear and embedding layers (the vLLM / Megatron split).

Each layer allocates only its rank's shard and gives every parameter a `weight_loader(param, loaded_weight,
shard_id=None)` that takes the *full* checkpoint tensor, checks its shape and copies the rank's slice in. Column
layers split the output features (q/k/v, gate/up: no communication, the next layer consumes the shard); row layers
split the input features and sum partial results across ranks (o_proj, down_proj). Fusing q/k/v and gate/up into
one matmul each also halves the kernel launches of a CPU decode step. With tp_size == 1 the collectives vanish.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from structgen.errors import ModelLoadError

LinearKernel = Callable[[torch.Tensor], torch.Tensor]
"""`x -> x @ W^T` for this rank's weight, computed another way than `F.linear` (prepacked bf16, int4): set
after loading by `structgen.models.cpu_linear` (the bias, if any, is still added by the layer)."""


def _check_shape(expected: tuple[int, ...], loaded: torch.Tensor) -> None:
    if tuple(loaded.shape) != expected:
        raise ModelLoadError(f"shape mismatch: expected {list(expected)}, got {list(loaded.shape)}")


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ModelLoadError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def _all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        torch.distributed.all_reduce(x)
    return x


def _gather_last_dim_to_rank0(x: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank 0 gets the shards concatenated; the other ranks keep their own shard. Only rank 0 samples, so a
    gather moves (tp_size - 1) shards where an all-gather would move tp_size x (tp_size - 1)."""
    if tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size)] if tp_rank == 0 else None
    torch.distributed.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else x


def _new_param(*shape: int) -> nn.Parameter:
    # torch.empty, not a random init: every value is overwritten by the checkpoint (unloaded ones are an error).
    return nn.Parameter(torch.empty(shape), requires_grad=False)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Replicated parameters (norms): the checkpoint tensor is copied whole."""
    _check_shape(tuple(param.shape), loaded_weight)
    param.data.copy_(loaded_weight)


class ColumnParallelLinear(nn.Module):
    """`y = x W^T + b` with W's output rows split across ranks; the output stays sharded."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        local_output_size: int | None = None,  # for layers whose shards are not an even split (replicated KV)
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.local_output_size = local_output_size or _divide(output_size, tp_size, "output size")
        self.weight = _new_param(self.local_output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = _new_param(self.local_output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
        self.kernel: LinearKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return F.linear(x, self.weight, self.bias)
        y = self.kernel(x)
        return y if self.bias is None else y + self.bias

    def _copy_rows(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        *,
        full_rows: int,
        dst_offset: int,
        rows: int,
        src_offset: int,
    ) -> None:
        expected = (full_rows, self.input_size) if param.dim() == 2 else (full_rows,)
        _check_shape(expected, loaded)
        param.data.narrow(0, dst_offset, rows).copy_(loaded.narrow(0, src_offset, rows))

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        rows = self.local_output_size
        self._copy_rows(
            param,
            loaded_weight,
            full_rows=self.output_size,
            dst_offset=0,
            rows=rows,
            src_offset=self.tp_rank * rows,
        )


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_proj and up_proj: shards 0, 1)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias, tp_rank=tp_rank, tp_size=tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ModelLoadError(f"shard id {shard_id!r} is not one of 0..{len(self.output_sizes) - 1}")
        rows = _divide(self.output_sizes[shard_id], self.tp_size, "merged projection size")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        self._copy_rows(
            param,
            loaded_weight,
            full_rows=self.output_sizes[shard_id],
            dst_offset=offset,
            rows=rows,
            src_offset=self.tp_rank * rows,
        )


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; query heads split across ranks, KV heads split or, when there are fewer KV
    heads than ranks, replicated so each rank holds the KV head its query heads attend to."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        *,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            if tp_size % total_num_kv_heads:
                raise ModelLoadError(
                    f"tensor_parallel_size ({tp_size}) must be a multiple of num_key_value_heads "
                    f"({total_num_kv_heads}) when it exceeds it"
                )
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            (total_num_heads + 2 * total_num_kv_heads) * head_dim,
            bias=bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            local_output_size=self.q_size + 2 * self.kv_size,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id == "q":
            full_rows, dst, rows, src = self.total_num_heads * self.head_dim, 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            full_rows, rows = self.total_num_kv_heads * self.head_dim, self.kv_size
            dst = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            src = self.tp_rank // self.num_kv_head_replicas
        else:
            raise ModelLoadError(f"shard id {shard_id!r} is not one of 'q', 'k', 'v'")
        self._copy_rows(
            param, loaded_weight, full_rows=full_rows, dst_offset=dst, rows=rows, src_offset=src * rows
        )


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` with W's input columns split across ranks: partial products are summed across ranks."""

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.local_input_size = _divide(input_size, tp_size, "input size")
        self.weight = _new_param(output_size, self.local_input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = _new_param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
        self.kernel: LinearKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 and self.kernel is None:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight) if self.kernel is None else self.kernel(x)
        y = _all_reduce(y, self.tp_size)
        return y if self.bias is None else y + self.bias  # the bias is added once, after the sum

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if param.dim() == 1:  # the bias is replicated
            default_weight_loader(param, loaded_weight)
            return
        _check_shape((self.output_size, self.input_size), loaded_weight)
        cols = self.local_input_size
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * cols, cols))


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary split into contiguous per-rank ranges (the last padded)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        shared_weight: nn.Parameter | None = None,  # tie to another layer's (identically sharded) weight
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.rows_per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        if shared_weight is not None:
            self.weight = shared_weight
        else:
            self.weight = _new_param(self.rows_per_rank, embedding_dim)
            self.weight.weight_loader = self.weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return _all_reduce(out, self.tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        _check_shape((self.num_embeddings, self.embedding_dim), loaded_weight)
        rows = self.vocab_end - self.vocab_start
        param.data[rows:].zero_()  # padding rows of the last rank produce logits that are sliced away
        param.data[:rows].copy_(loaded_weight.narrow(0, self.vocab_start, rows))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, sharded like the embedding so tied checkpoints can share one parameter."""

    kernel: LinearKernel | None = None  # the lm_head's own product (the embedding lookup keeps `weight`)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on rank 0; with tensor parallelism, other ranks get their shard only."""
        local = F.linear(hidden_states, self.weight) if self.kernel is None else self.kernel(hidden_states)
        logits = _gather_last_dim_to_rank0(local, self.tp_rank, self.tp_size)
        return logits[..., : self.num_embeddings] if self.tp_size > 1 and self.tp_rank == 0 else logits

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)


def kernel_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every layer with a `kernel` hook: the linear layers and the lm_head."""
    kinds = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    return [(name, m) for name, m in model.named_modules() if isinstance(m, kinds)]
