"""Attention backends over a paged KV cache: a torch reference (CPU) and Triton kernels (GPU)."""

from structgen.attention.backend import AttentionBackend, AttentionMetadata, KVCache, allocate_kv_cache

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "allocate_kv_cache"]
