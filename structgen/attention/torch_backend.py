"""Pure-torch paged attention: the CPU backend and the reference every kernel is tested against.

Decode rows (one new token per sequence) are attended in vectorized passes: gather each sequence's blocks
through its block table, mask slots past its context length, attend in float32. Gathering every sequence up to
the batch's longest context copies (and attends over) mostly padding when lengths differ, and that copy is the
bulk of a CPU decode step's attention, so sequences are grouped by context length first (`decode_length_groups`)
and each group is padded only to its own longest. Sequences with several new tokens (prefill, chunked prefill on
top of a cached prefix) go one at a time through `scaled_dot_product_attention`: causal where the cached prefix is
shorter than the new tokens (zero queries stand in for the cached positions), else with a causal mask offset by
the cached prefix length.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from structgen.attention.backend import AttentionBackend, AttentionMetadata, KVCache

# A new group starts when padding the next (shorter) sequence to the group's longest would waste more than this
# share of the group's span and more than this many slots: below that, one more gather call costs more than the
# padding it saves (each call has a fixed cost of roughly a couple of thousand gathered slots on CPU).
GROUP_WASTE_SHARE = 0.3
GROUP_WASTE_SLOTS = 128


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        # The grouping depends only on the step's metadata, which every layer shares: plan once per step.
        self._groups: tuple[AttentionMetadata, list[DecodeGroup]] | None = None

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
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        if metadata.is_decode:
            if self._groups is None or self._groups[0] is not metadata:
                self._groups = (metadata, decode_length_groups(metadata.context_lens_cpu, key_cache.shape[1]))
            return grouped_decode_attention(
                query, key_cache, value_cache, metadata, self._groups[1], scale=scale
            )
        return self._mixed(query, key, value, key_cache, value_cache, metadata, scale=scale)

    def _mixed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
    ) -> torch.Tensor:
        out = torch.zeros_like(query)  # rows of no sequence (padding) stay finite
        starts, decode_seqs = [], []
        start = 0
        for i, query_len in enumerate(metadata.query_lens_cpu):
            starts.append(start)
            if query_len == 1:
                decode_seqs.append(i)
            start += query_len

        # Sequences that are decoding inside a mixed (chunked-prefill) step still take the batched path.
        if decode_seqs:
            lens = [metadata.context_lens_cpu[i] for i in decode_seqs]
            grouped_decode_attention(
                query,
                key_cache,
                value_cache,
                metadata,
                decode_length_groups(lens, key_cache.shape[1]),
                scale=scale,
                seqs=decode_seqs,
                rows=[starts[i] for i in decode_seqs],
                out=out,
            )

        prefill_attention(query, key, value, key_cache, value_cache, metadata, out=out, scale=scale)
        return out


def prefill_sequences(
    metadata: AttentionMetadata, skip: frozenset[int] = frozenset()
) -> Iterator[tuple[int, slice, int]]:
    """(sequence, its query rows, its context length) for each sequence with several new tokens, but those in
    `skip`: the ones a prefill path attends."""
    start = 0
    for i, (query_len, context_len) in enumerate(
        zip(metadata.query_lens_cpu, metadata.context_lens_cpu, strict=True)
    ):
        if query_len > 1 and i not in skip:
            yield i, slice(start, start + query_len), context_len
        start += query_len


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    out: torch.Tensor,
    scale: float,
    skip: frozenset[int] = frozenset(),
) -> None:
    """Attention of the sequences with several new tokens (but those in `skip`, attended elsewhere), one at a
    time, written into their rows of `out`."""
    block_size = key_cache.shape[1]
    for i, rows, context_len in prefill_sequences(metadata, skip):
        query_len = rows.stop - rows.start
        q = query[rows].transpose(0, 1)  # [heads, q, head_dim]
        cached = context_len - query_len
        mask = None
        if cached == 0:  # nothing cached before: attend to the fresh keys directly
            k, v = key[rows], value[rows]
        else:
            num_blocks = -(-context_len // block_size)
            blocks = metadata.block_tables[i, :num_blocks].long()
            k = key_cache.index_select(0, blocks).flatten(0, 1)[:context_len]
            v = value_cache.index_select(0, blocks).flatten(0, 1)[:context_len]
            if cached < query_len:
                # A short cached prefix (a chat template's first block, a partly reused block): causal attention
                # over the whole context, with zero queries standing in for the cached positions, is the same
                # attention for the new rows and costs (cached + new)^2 / 2 scores, where the offset mask below
                # costs new x (cached + new) and loses the kernel's causal skipping: bit-identical, and 1.4-1.6x
                # faster for ~950 new tokens on 2-37 cached ones (2-core Zen 5, fp32 and bf16).
                q = torch.cat([q.new_zeros(q.shape[0], cached, q.shape[2]), q], dim=1)
            else:
                # New token j sits at position cached + j and sees every position up to it.
                query_pos = torch.arange(cached, context_len, device=query.device)
                mask = torch.arange(context_len, device=query.device)[None, :] <= query_pos[:, None]
        k, v = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
        if k.shape[0] != q.shape[0]:
            # GQA by repeating KV heads (HF's repeat_kv order), a small copy, so that the flash kernel below
            # serves every shape (enable_gqa is not supported by all of SDPA's CPU kernels).
            group = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        # A leading batch dim: SDPA takes its CPU flash kernel only for 4-D inputs (3-D ones run the unfused math
        # path, ~80x slower on a 1,000-token prompt).
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale
        )[0]
        out[rows] = o[:, o.shape[1] - query_len :].transpose(0, 1)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new keys/values into their flat cache slots; slot -1 marks padding rows that are not stored."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    slots = slot_mapping.long()
    padding = slots < 0
    if bool(padding.any()):
        keep = ~padding
        slots, key, value = slots[keep], key[keep], value[keep]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(value_cache.dtype))


@dataclass(slots=True, frozen=True)
class DecodeGroup:
    seqs: list[int]  # positions in the batch, longest context first
    max_context_len: int


def decode_length_groups(context_lens: list[int], block_size: int) -> list[DecodeGroup]:
    """Split sequences (longest first) into groups whose padding to the group's longest context stays small."""
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__, reverse=True)
    groups: list[DecodeGroup] = []
    lead_span = 0
    for i in order:
        span = -(-context_lens[i] // block_size) * block_size
        waste = lead_span - span
        if groups and (waste <= GROUP_WASTE_SLOTS or waste <= GROUP_WASTE_SHARE * lead_span):
            groups[-1].seqs.append(i)
            continue
        groups.append(DecodeGroup([i], context_lens[i]))
        lead_span = span
    return groups


def grouped_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    groups: list[DecodeGroup],
    *,
    scale: float,
    seqs: list[int] | None = None,
    rows: list[int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_decode_attention` of each length group, written into `out` (a new tensor by default).

    The groups index `seqs`, the decoding sequences of the batch (all of them by default, a pure decode step);
    sequence `seqs[k]`'s new token is query row `rows[k]` (row = sequence by default).
    """
    if seqs is None and len(groups) == 1:  # the whole batch in one pass, no gather of rows
        return paged_decode_attention(
            query,
            key_cache,
            value_cache,
            block_tables=metadata.block_tables,
            context_lens=metadata.context_lens,
            max_context_len=metadata.max_context_len,
            scale=scale,
        )
    out = torch.empty_like(query) if out is None else out
    for group in groups:
        members = group.seqs if seqs is None else [seqs[k] for k in group.seqs]
        index = torch.tensor(members, device=query.device)
        row_index = (
            index if rows is None else torch.tensor([rows[k] for k in group.seqs], device=query.device)
        )
        out[row_index] = paged_decode_attention(
            query[row_index],
            key_cache,
            value_cache,
            block_tables=metadata.block_tables[index],
            context_lens=metadata.context_lens[index],
            max_context_len=group.max_context_len,
            scale=scale,
        )
    return out


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one new token per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # [num_seqs]
    max_context_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention of each sequence's newest token over its whole cached context, all sequences at once."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_blocks = -(-max_context_len // block_size)
    span = num_blocks * block_size
    # Whole blocks are gathered; unused table entries (-1) fetch block 0, and everything past a sequence's
    # context length is masked out below.
    tables = block_tables[:, :num_blocks].long().clamp(min=0).flatten()
    k, v = (
        cache.index_select(0, tables).view(num_seqs, span, num_kv_heads, head_dim).transpose(1, 2).float()
        for cache in (key_cache, value_cache)
    )
    within = torch.arange(span, device=query.device)[None, :] < context_lens[:, None].to(torch.long)
    # Query heads h*group .. h*group+group-1 share KV head h (HF's repeat_kv order), so viewing each KV head's
    # group of query heads as `group` query rows attends GQA without repeating keys; SDPA reads the gathered
    # keys in place (strided). Measured faster on CPU than per-head bmm + softmax, and than SDPA's enable_gqa.
    q = query.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=within[:, None, None, :], scale=scale)
    # reshape, not view: CUDA's SDPA kernels return a layout these dims cannot be viewed through.
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
