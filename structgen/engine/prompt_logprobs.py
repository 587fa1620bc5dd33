"""Prompt logprobs (`SamplingParams.prompt_logprobs`): how likely the model found each prompt token given the
tokens before it, scored from the hidden states the prefill computes anyway.

The hidden state at position p gives the distribution of token p + 1, so a prefill chunk over positions
[start, end) scores prompt tokens start + 1 .. end (the last prompt position predicts the first output token,
which is sampled, not scored). Entries are appended to `Sequence.prompt_logprobs` in prompt order; a chunk that
covers positions already scored (a preempted sequence recomputing its prompt) scores nothing again.

A prompt scored before leaves its scores with its blocks in the prefix cache (`BlockManager.commit`), so a
later prompt sharing a prefix with it (lm-evaluation-harness asks for one context with each of its answers)
reuses those blocks with their scores (`cached_scored_prefix`). All but the last of the reused tokens, that is:
the hidden state of the last one is what scores the first token past them, so it runs through the model again.

Logits are taken `PROMPT_LOGITS_CHUNK` rows at a time: a whole 2,048-token chunk of a 49k vocabulary would be
400 MB of float32 for numbers reduced at once to a few per row. On the CPU the reduction (log-normalizer and
rank) is one native call, `structgen.kernels.cpu_token_scores`, where the kernels are built. As the sampled
tokens' logprobs (`structgen.engine.logprobs`) they come before temperature and penalties; a prompt has no
structured-output mask, so they are the model's own distribution (or its logits, in the engine's "*_logits"
`logprobs_mode`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from structgen.engine.block_manager import BlockManager, CachedPrefix, cdiv
from structgen.engine.logprobs import best_logprobs
from structgen.engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from structgen.engine.sequence import Sequence

# Rows of logits computed at a time (256 x 49,152 float32 = 48 MiB).
PROMPT_LOGITS_CHUNK = 256


@dataclass(slots=True)
class PromptSpan:
    """Prompt tokens of one sequence scored this step: `count` tokens from prompt index `first`, whose
    predicting hidden states are the batch's rows `row`, `row + 1`, ..."""

    seq: Sequence
    row: int
    first: int
    count: int


def prompt_spans(seqs: list[Sequence], num_new_tokens: list[int]) -> list[PromptSpan]:
    """The spans of this step's batch (flattened in `seqs` order) that score prompt tokens not yet scored."""
    spans = []
    row = 0
    for seq, n in zip(seqs, num_new_tokens, strict=True):
        if seq.scores_prompt:
            start = seq.num_computed_tokens
            # Position p scores token p + 1; entries 0 .. len(prompt_logprobs) - 1 exist already.
            low = max(start, len(seq.prompt_logprobs) - 1)  # type: ignore[arg-type]
            high = min(start + n, seq.num_prompt_tokens - 1)
            if low < high:
                spans.append(PromptSpan(seq, row + low - start, low + 1, high - low))
        row += n
    return spans


def cached_scored_prefix(
    block_manager: BlockManager, seq: Sequence
) -> tuple[CachedPrefix, list[TokenLogprob | None]]:
    """The cached prefix a sequence scoring its prompt reuses, and the scores of the prompt positions it covers
    and the one after (0 .. its tokens), taken from the cached blocks' scores.

    The leading cached blocks that hold scores with at least the alternatives `seq` asks for cover some c
    tokens; the prefix is the first c - 1 of them (a whole block's last token is reused in part, which copies
    it), so that the model computes token c - 1 again and its hidden state scores token c."""
    found = block_manager.find_cached_prefix(seq)
    wanted = seq.params.prompt_logprobs or 0  # type: ignore[union-attr]
    bs = block_manager.block_size
    scores: list[TokenLogprob | None] = []
    for i, block_id in enumerate(found.blocks):
        stored = block_manager.blocks[block_id].scores
        if stored is None or stored[0] < wanted:
            break
        last = i == len(found.blocks) - 1
        scores.extend(
            _fewer(e, wanted)
            for e in stored[1][: found.partial_tokens if last and found.partial_tokens else bs]
        )
    covered = len(scores)
    if covered < 2:
        return CachedPrefix([]), []
    reused = covered - 1
    return CachedPrefix(found.blocks[: cdiv(reused, bs)], reused % bs), scores


def take_cached_scores(seq: Sequence, scores: list[TokenLogprob | None]) -> None:
    """After `seq` took a prefix from `cached_scored_prefix` (or the whole blocks of it): its scores up to the
    first position it computes, past those it holds already (a preempted sequence kept its own)."""
    entries = seq.prompt_logprobs
    assert entries is not None
    entries.extend(scores[len(entries) : seq.num_computed_tokens + 1])


def _fewer(entry: TokenLogprob | None, k: int) -> TokenLogprob | None:
    """`entry` with its `k` best alternatives only (a cached score may hold more than a request asks)."""
    if entry is None or len(entry.top_logprobs) <= k:
        return entry
    return TokenLogprob(entry.token_id, entry.logprob, entry.top_logprobs[:k], entry.rank)


def span_rows(spans: list[PromptSpan]) -> list[int]:
    """The batch rows whose logits score the spans' tokens, in scoring order."""
    return [r for span in spans for r in range(span.row, span.row + span.count)]


def prompt_logit_chunks(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`rows` in the pieces whose logits are computed at once. Under tensor parallelism every rank takes part in
    each product, so the workers split the rows they are sent exactly as rank 0 does here."""
    return rows.split(PROMPT_LOGITS_CHUNK) if rows.numel() else ()


def score_prompts(
    hidden: torch.Tensor,
    spans: list[PromptSpan],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    *,
    num_valid_tokens: int,
    as_logits: bool = False,
) -> None:
    """Append each span's `TokenLogprob`s (logprob, rank, the `prompt_logprobs` best alternatives) to its
    sequence's `prompt_logprobs`, in prompt order. `as_logits` (the engine's "*_logits" `logprobs_mode`):
    the logits themselves instead of logprobs (the ranks are the same)."""
    if not spans:
        return
    targets: list[int] = []
    wanted: list[int] = []
    owners: list[Sequence] = []
    for span in spans:
        k = span.seq.params.prompt_logprobs or 0  # type: ignore[union-attr]
        targets.extend(span.seq.token_ids[span.first : span.first + span.count])
        wanted.extend([k] * span.count)
        owners.extend([span.seq] * span.count)
    device = hidden.device
    rows = torch.tensor(span_rows(spans), dtype=torch.long, device=device)
    begin = 0
    for index in prompt_logit_chunks(rows):
        end = begin + index.numel()
        target = torch.tensor(targets[begin:end], dtype=torch.long, device=device).unsqueeze(1)
        logits = compute_logits(hidden.index_select(0, index))
        if num_valid_tokens < logits.shape[1]:
            logits[:, num_valid_tokens:] = float("-inf")  # padding rows of the embedding: never tokens
        entries = _score(logits, target, wanted[begin:end], as_logits=as_logits)
        for j, (logprob, rank, top) in enumerate(entries):
            owners[begin + j].prompt_logprobs.append(  # type: ignore[union-attr]
                TokenLogprob(targets[begin + j], logprob, top, rank)
            )
        begin = end


def _score(
    logits: torch.Tensor, target: torch.Tensor, wanted: list[int], *, as_logits: bool
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """(the target's logprob, its rank, the `wanted[j]` best (token, logprob) pairs) per row j of float32
    `logits`; with `as_logits`, logits in place of the logprobs."""
    targets = target.squeeze(1)
    native = _native() if logits.device.type == "cpu" and logits.stride(1) == 1 else None
    if native is not None:
        log_norm, rank = native.token_scores(logits, targets)
    else:
        from structgen.kernels.cpu_token_scores import token_scores_reference

        log_norm, rank = token_scores_reference(logits, targets)
    log_norm = torch.zeros_like(log_norm).unsqueeze(1) if as_logits else log_norm.unsqueeze(1)
    logprobs = (logits.gather(1, target) - log_norm).squeeze(1).tolist()
    best = best_logprobs(logits, log_norm, wanted)
    return list(zip(logprobs, rank.tolist(), best, strict=True))


@functools.cache
def _native() -> ModuleType | None:
    """`structgen.kernels.cpu_token_scores` when the native kernels are built here (the first call may build
    them), else None."""
    from structgen.kernels import cpu_token_scores

    return cpu_token_scores if cpu_token_scores.available() else None
