"""Thin launchers of the native CPU kernels (`csrc/cpu_*.cpp`), each beside the pure-torch reference it must match.

A launcher calls `torch.ops.structgen_cpu.*` directly: the kernels check every shape, dtype and index they rely
on (TORCH_CHECK) before touching memory, so nothing is checked twice on the hot path (Python checks cost more
than the small kernels themselves: ~40 us a call, measured). When a kernel refuses a call, the launcher's own
checks name the argument at fault, and the error is a ValueError either way. `available()` says whether the
library could be built and loaded (see `cpu_build`). The references spell out the arithmetic the kernels reproduce, roundings included: the model code
uses the same formulas on devices where the kernels do not run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from structgen.kernels import cpu_build
from structgen.kernels._launch import check_dtype, check_shape

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether the native ops can be used (builds them on the first call)."""
    return cpu_build.load()


def _check_cpu(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"{name}: CPU tensors only, got {t.device}")


def _kernel_message(exc: RuntimeError) -> str:
    """The kernel's own TORCH_CHECK message, without the C++ frames torch appends."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)


def _check_rows(name: str, what: str, tensor: torch.Tensor) -> None:
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name}: {what} must be contiguous in its last dimension")


# -- paged decode attention ------------------------------------------------------------------------------------


def paged_decode_attention(
    query: torch.Tensor,  # [rows, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor | None = None,
    rows: torch.Tensor
    | None = None,  # [num_seqs] int32: the query/out row of each sequence (default: row = seq)
) -> torch.Tensor:
    """Each sequence's newest token attended over its cached context, read from the paged cache in place."""
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    try:
        torch.ops.structgen_cpu.paged_decode_attention(
            query, key_cache, value_cache, block_tables, context_lens, float(scale), out, rows
        )
    except RuntimeError as exc:
        _check_paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, out, rows)
        raise ValueError(f"paged_decode_attention: {_kernel_message(exc)}") from None
    return out


def _check_paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor | None,
) -> None:
    name = "paged_decode_attention"
    _check_cpu(name, query, key_cache, value_cache, block_tables, context_lens)
    check_dtype(name, "query", query, KERNEL_DTYPES)
    check_dtype(name, "key_cache", key_cache, KERNEL_DTYPES)
    check_dtype(name, "block_tables", block_tables, (torch.int32,))
    check_dtype(name, "context_lens", context_lens, (torch.int32,))
    _, _, num_kv_heads, head_dim = key_cache.shape
    check_shape(name, "query", query, (None, None, head_dim))
    check_shape(name, "value_cache", value_cache, tuple(key_cache.shape))
    if value_cache.dtype != key_cache.dtype or not (
        key_cache.is_contiguous() and value_cache.is_contiguous()
    ):
        raise ValueError(f"{name}: key and value caches must be contiguous and of one dtype")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"{name}: {query.shape[1]} query heads do not group over {num_kv_heads} KV heads")
    num_seqs = context_lens.shape[0]
    check_shape(name, "block_tables", block_tables, (num_seqs, None))
    _check_rows(name, "query", query)
    _check_rows(name, "block_tables", block_tables)
    if not context_lens.is_contiguous():
        raise ValueError(f"{name}: context_lens must be contiguous")
    if rows is None and query.shape[0] != num_seqs:
        raise ValueError(f"{name}: {query.shape[0]} query rows for {num_seqs} sequences (pass rows=)")
    if rows is not None:
        check_dtype(name, "rows", rows, (torch.int32,))
        check_shape(name, "rows", rows, (num_seqs,))
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be {list(query.shape)} {query.dtype} with contiguous rows")


def paged_decode_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One sequence at a time: gather its blocks, attend in float32 (GQA by repeating KV heads)."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for i, n in enumerate(context_lens.tolist()):
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = key_cache.index_select(0, blocks).flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        v = value_cache.index_select(0, blocks).flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", query[i].float() * scale, k), dim=-1)
        out[i] = torch.einsum("ht,thd->hd", weights, v).to(query.dtype)
    return out


# -- KV cache write --------------------------------------------------------------------------------------------


def write_kv_cache(
    key: torch.Tensor,  # [tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens] int64, -1 = not stored
) -> None:
    """Store each token's key/value at its flat slot (`block * block_size + offset`), in the cache's dtype."""
    try:
        torch.ops.structgen_cpu.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    except RuntimeError as exc:
        _check_write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        raise ValueError(f"write_kv_cache: {_kernel_message(exc)}") from None


def _check_write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    name = "write_kv_cache"
    _check_cpu(name, key, value, key_cache, value_cache, slot_mapping)
    check_dtype(name, "key", key, KERNEL_DTYPES)
    check_dtype(name, "key_cache", key_cache, KERNEL_DTYPES)
    check_dtype(name, "slot_mapping", slot_mapping, (torch.int64,))
    check_shape(name, "key", key, (None, key_cache.shape[2], key_cache.shape[3]))
    check_shape(name, "value", value, tuple(key.shape))
    check_shape(name, "slot_mapping", slot_mapping, (key.shape[0],))
    _check_rows(name, "key", key)
    _check_rows(name, "value", value)
    if not slot_mapping.is_contiguous():
        raise ValueError(f"{name}: slot_mapping must be contiguous")


def write_kv_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    heads, dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, heads, dim).index_copy_(0, slots, key[keep].to(key_cache.dtype))
    value_cache.view(-1, heads, dim).index_copy_(0, slots, value[keep].to(value_cache.dtype))


# -- RMSNorm ---------------------------------------------------------------------------------------------------


def _check_norm(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    _check_cpu(name, x, weight)
    check_dtype(name, "input", x, KERNEL_DTYPES)
    if x.dim() != 2 or weight.shape != (x.shape[1],) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(
            f"{name}: input [rows, hidden] and weight [hidden] of one dtype, got "
            f"{list(x.shape)} {x.dtype} and {list(weight.shape)} {weight.dtype}"
        )
    _check_rows(name, "input", x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """`weight * norm(x)` (see `rms_norm_reference`)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    try:
        torch.ops.structgen_cpu.rms_norm(x, weight, float(eps), out)
    except RuntimeError as exc:
        _check_norm("rms_norm", x, weight)
        raise ValueError(f"rms_norm: {_kernel_message(exc)}") from None
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(x + residual), x + residual)`; the sum is written into `residual` in place."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    try:
        torch.ops.structgen_cpu.fused_add_rms_norm(x, residual, weight, float(eps), out)
    except RuntimeError as exc:
        _check_norm("fused_add_rms_norm", x, weight)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError("fused_add_rms_norm: residual must match the input") from None
        raise ValueError(f"fused_add_rms_norm: {_kernel_message(exc)}") from None
    return out, residual


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm: normalize in float32, round to the model dtype, scale in the model dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


# -- rotary embedding ------------------------------------------------------------------------------------------


def rotary_embedding_(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q `[tokens, heads, dim]` and k `[tokens, kv_heads, dim]` in place; cos/sin `[tokens, 1, dim/2]`."""
    try:
        torch.ops.structgen_cpu.rotary_embedding(query, key, cos, sin)
    except RuntimeError as exc:
        _check_rotary(query, key, cos, sin)
        raise ValueError(f"rotary_embedding: {_kernel_message(exc)}") from None


def _check_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    name = "rotary_embedding"
    _check_cpu(name, query, key, cos, sin)
    check_dtype(name, "query", query, KERNEL_DTYPES)
    tokens, _, dim = query.shape
    if key.dim() != 3 or key.shape[0] != tokens or key.shape[2] != dim or dim % 2:
        raise ValueError(f"{name}: query {list(query.shape)} and key {list(key.shape)} do not fit")
    if {key.dtype, cos.dtype, sin.dtype} != {query.dtype}:
        raise ValueError(f"{name}: query, key, cos and sin must share a dtype")
    if cos.numel() != tokens * dim // 2 or sin.shape != cos.shape or cos.shape[-1] != dim // 2:
        raise ValueError(f"{name}: cos/sin must hold [tokens, dim / 2], got {list(cos.shape)}")
    _check_rows(name, "query", query)
    _check_rows(name, "key", key)
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"{name}: cos and sin must be contiguous")


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin`, written on the two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# -- SwiGLU ----------------------------------------------------------------------------------------------------


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a fused `[rows, gate | up]` projection."""
    name = "silu_and_mul"
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"{name}: input must be [rows, 2 * width], got {list(x.shape)}")
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    try:
        torch.ops.structgen_cpu.silu_and_mul(x, out)
    except RuntimeError as exc:
        _check_cpu(name, x)
        check_dtype(name, "input", x, KERNEL_DTYPES)
        _check_rows(name, "input", x)
        raise ValueError(f"{name}: {_kernel_message(exc)}") from None
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
