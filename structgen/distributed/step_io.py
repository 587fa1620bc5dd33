"""What rank 0 tells the workers: a fixed 8-int header, then (for a step) one flat int64 payload.

Two `dist.broadcast` calls per step, both plain tensors, instead of pickling the batch: nothing is serialized
and on CUDA the payload never leaves the device (it is concatenated from the tensors rank 0 already built).
`structgen.bench.tp_scaling` measures the difference against `broadcast_object_list`.

Payload layout (all int64): input_ids, positions, slot_mapping (num_tokens each), context_lens (num_seqs),
query_start_loc (num_seqs + 1), block_tables (num_seqs x max_blocks), logit rows (num_rows), block copies
(2 x num_copies: sources then destinations), prompt-scoring rows (num_prompt_rows).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.distributed as dist

from structgen.attention import AttentionMetadata

HEADER_SIZE = 9


class Command(enum.IntEnum):
    STEP = 1
    INIT_CACHE = 2  # header[1] = max_model_len: every rank sizes its KV cache, the group keeps the minimum
    EXIT = 3


@dataclass(slots=True)
class StepInput:
    """One step as the workers need it: the model input plus which hidden rows produce logits."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logit_rows: torch.Tensor  # [num_rows] int64, empty when nothing samples this step
    blocks_to_copy: list[tuple[int, int]]
    # [num_prompt_rows] int64: rows whose logits score prompt tokens (`structgen.engine.prompt_logprobs`), taken
    # before the sampling rows, `PROMPT_LOGITS_CHUNK` at a time on every rank.
    prompt_rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))


def send_command(command: Command, *args: int, device: torch.device) -> None:
    values = [int(command), *args]
    header = torch.zeros(HEADER_SIZE, dtype=torch.long)
    header[: len(values)] = torch.tensor(values, dtype=torch.long)
    dist.broadcast(header.to(device), src=0)


def send_step(step: StepInput, *, device: torch.device) -> None:
    """Rank 0: broadcast one step (header, then payload)."""
    md = step.metadata
    num_seqs, max_blocks = md.block_tables.shape
    copies = [s for s, _ in step.blocks_to_copy] + [d for _, d in step.blocks_to_copy]
    send_command(
        Command.STEP,
        step.input_ids.numel(),
        num_seqs,
        max_blocks,
        step.logit_rows.numel(),
        len(step.blocks_to_copy),
        md.max_query_len,
        md.max_context_len,
        step.prompt_rows.numel(),
        device=device,
    )
    payload = torch.cat(
        [
            step.input_ids,
            step.positions,
            md.slot_mapping,
            md.context_lens.long(),
            md.query_start_loc.long(),
            md.block_tables.long().flatten(),
            step.logit_rows,
            torch.tensor(copies, dtype=torch.long, device=device),
            step.prompt_rows.to(device),
        ]
    )
    dist.broadcast(payload, src=0)


def receive_header(device: torch.device) -> list[int]:
    header = torch.empty(HEADER_SIZE, dtype=torch.long, device=device)
    dist.broadcast(header, src=0)
    return header.tolist()


def receive_step(header: list[int], *, device: torch.device, block_size: int) -> StepInput:
    """Workers: the payload that follows a STEP header, unpacked into the same tensors rank 0 runs on."""
    _, num_tokens, num_seqs, max_blocks, num_rows, num_copies, max_query_len, max_context_len, num_scored = (
        header
    )
    sizes = [num_tokens] * 3 + [
        num_seqs,
        num_seqs + 1,
        num_seqs * max_blocks,
        num_rows,
        2 * num_copies,
        num_scored,
    ]
    payload = torch.empty(sum(sizes), dtype=torch.long, device=device)
    dist.broadcast(payload, src=0)
    ids, positions, slots, context_lens, query_start, tables, rows, copies, prompt_rows = payload.split(sizes)
    # Host copies of the per-sequence lengths (one transfer), as rank 0's `_prepare` keeps them.
    lengths = torch.cat([context_lens, query_start]).tolist()
    context_lens_cpu, starts = lengths[:num_seqs], lengths[num_seqs:]
    metadata = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables.view(num_seqs, max_blocks).int(),
        context_lens=context_lens.int(),
        query_start_loc=query_start.int(),
        max_query_len=max_query_len,
        max_context_len=max_context_len,
        block_size=block_size,
        query_lens_cpu=[b - a for a, b in pairwise(starts)],
        context_lens_cpu=context_lens_cpu,
    )
    pairs = copies.tolist()
    return StepInput(
        input_ids=ids,
        positions=positions,
        metadata=metadata,
        logit_rows=rows,
        blocks_to_copy=list(zip(pairs[:num_copies], pairs[num_copies:], strict=True)),
        prompt_rows=prompt_rows,
    )
