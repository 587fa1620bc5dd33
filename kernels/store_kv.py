"""`store_kv`: scatter the new keys/values of a flattened batch into the paged KV cache by slot mapping.

One program per token copies its `num_kv_heads * head_dim` keys and values to flat slot `slot_mapping[t]` of the
cache (`[num_blocks, block_size, num_kv_heads, head_dim]`, i.e. slot = block * block_size + offset). Slot -1
marks a padding token (a padded CUDA-graph batch): nothing is written for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from structgen.kernels._launch import (
    FLOAT_DTYPES,
    check_contiguous,
    check_device,
    check_dtype,
    check_shape,
    next_power_of_two,
)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    key_stride,
    value_stride,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key_ptr + token.to(tl.int64) * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + token.to(tl.int64) * value_stride + offs, mask=mask)
    tl.store(key_cache_ptr + slot * ROW + offs, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + slot * ROW + offs, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = padding
) -> None:
    """Write `key`/`value` row t into cache slot `slot_mapping[t]` (skipping -1), in place."""
    name = "store_kv"
    check_device(name, key, value, key_cache, value_cache, slot_mapping)
    check_shape(name, "key_cache", key_cache, (None, None, None, None))
    _, _, num_kv_heads, head_dim = key_cache.shape
    check_shape(name, "value_cache", value_cache, tuple(key_cache.shape))
    check_shape(name, "key", key, (None, num_kv_heads, head_dim))
    num_tokens = key.shape[0]
    check_shape(name, "value", value, (num_tokens, num_kv_heads, head_dim))
    check_shape(name, "slot_mapping", slot_mapping, (num_tokens,))
    for what, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_dtype(name, what, t, FLOAT_DTYPES)
    check_dtype(name, "slot_mapping", slot_mapping, (torch.int32, torch.int64))
    check_contiguous(name, "key", key, inner_dims=2)
    check_contiguous(name, "value", value, inner_dims=2)
    check_contiguous(name, "key_cache", key_cache)
    check_contiguous(name, "value_cache", value_cache)
    check_contiguous(name, "slot_mapping", slot_mapping)
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ROW=row,
        BLOCK=next_power_of_two(row),
    )


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Pure torch, one token at a time: what the kernel must do."""
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            flat_k[slot] = key[t].to(key_cache.dtype)
            flat_v[slot] = value[t].to(value_cache.dtype)
