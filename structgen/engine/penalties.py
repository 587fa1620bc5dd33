"""Logit edits that depend on a request's history: vLLM's repetition / presence / frequency penalties and
the min_tokens ban of stop tokens. Both work in place on a `[rows, vocab]` float32 tensor, all rows at once;
`apply_history` applies them to a sampler's batch, on a copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from structgen.engine.sampler import SamplingRow
    from structgen.sampling_params import SamplingParams


def apply_history(raw: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Penalties and the min_tokens ban on a copy of `raw` (kept intact for logprobs); `raw` if none apply."""
    penalised = [i for i, row in enumerate(rows) if _has_penalty(row.params)]
    banned = [(i, ids) for i, row in enumerate(rows) if (ids := _min_tokens_ban(row))]
    if not penalised and not banned:
        return raw
    x = raw.clone()
    if penalised:
        # The penalties touch only history tokens, so rows without any get empty histories, not a copy.
        chosen = set(penalised)
        apply_penalties(
            x,
            [row.prompt_token_ids if i in chosen else () for i, row in enumerate(rows)],
            [row.output_token_ids if i in chosen else () for i, row in enumerate(rows)],
            repetition=[row.params.repetition_penalty for row in rows],
            frequency=[row.params.frequency_penalty for row in rows],
            presence=[row.params.presence_penalty for row in rows],
        )
    if banned:
        ban_tokens(x, banned)
    return x


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
    )


def _min_tokens_ban(row: SamplingRow) -> list[int]:
    """Token ids the row may not produce yet: its stop ids, and EOS unless ignore_eos."""
    if len(row.output_token_ids) >= row.params.min_tokens:
        return []
    ids = set(row.params.stop_token_ids or ())
    if not row.params.ignore_eos:
        ids |= row.eos_token_ids
    return sorted(ids)


def apply_penalties(
    logits: Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    *,
    repetition: Sequence[float],
    frequency: Sequence[float],
    presence: Sequence[float],
) -> None:
    """Penalise, in place, tokens a row has already seen (one entry per row in every sequence argument).

    As vLLM defines them: the repetition penalty `r` covers prompt and output tokens and divides a positive
    logit by `r` or multiplies a negative one by `r`; then the frequency penalty subtracts `f * count` and the
    presence penalty `p * (count > 0)`, counting output tokens only. -inf logits stay -inf.

    Only the (row, token) pairs of the histories change, so the work is gathered to those pairs rather than
    done over `[rows, vocab]`: a few hundred history tokens instead of 100k vocabulary entries per row.
    """
    rows, vocab = logits.shape
    for name, values in (
        ("prompt_token_ids", prompt_token_ids),
        ("output_token_ids", output_token_ids),
        ("repetition", repetition),
        ("frequency", frequency),
        ("presence", presence),
    ):
        if len(values) != rows:
            raise ValueError(f"{name} has {len(values)} entries for {rows} rows of logits")
    output_keys = _history_keys(output_token_ids, vocab, what="output")
    # Rows without a repetition penalty do not need their (possibly long) prompts at all.
    prompts = [ids if r != 1.0 else () for ids, r in zip(prompt_token_ids, repetition, strict=True)]
    prompt_keys = _history_keys(prompts, vocab, what="prompt")
    if output_keys.numel() + prompt_keys.numel() == 0:
        return
    # One entry per distinct (row, token) seen, with its count among the output tokens.
    keys, slot = torch.unique(torch.cat([output_keys, prompt_keys]), return_inverse=True)
    counts = torch.zeros(keys.numel()).index_add_(
        0, slot[: output_keys.numel()], torch.ones(output_keys.numel())
    )
    device = logits.device
    row, token = (keys // vocab).to(device), (keys % vocab).to(device)
    counts = counts.to(device=device, dtype=logits.dtype)

    def per_pair(values: Sequence[float]) -> Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device)[row]

    seen = logits[row, token]
    repetition_ = per_pair(repetition)
    seen = torch.where(seen > 0, seen / repetition_, seen * repetition_)
    seen -= per_pair(frequency) * counts + per_pair(presence) * (counts > 0).to(logits.dtype)
    logits[row, token] = seen


def ban_tokens(logits: Tensor, banned: Sequence[tuple[int, Sequence[int]]]) -> None:
    """Set `logits[row, ids]` to -inf for each `(row, ids)`, in place; ids outside the vocabulary are ignored.

    A row where the ban would leave no possible token keeps its logits: there the structured-output mask
    already allows only banned tokens (a finished grammar allows only EOS), and the constraint must win
    over min_tokens rather than leave the row with nothing to sample.
    """
    vocab = logits.shape[1]
    pairs = [(row, tok) for row, ids in banned for tok in ids if 0 <= tok < vocab]
    if not pairs:
        return
    device = logits.device
    row_idx = torch.tensor([row for row, _ in pairs], dtype=torch.long, device=device)
    tok_idx = torch.tensor([tok for _, tok in pairs], dtype=torch.long, device=device)
    saved = logits[row_idx, tok_idx]
    logits[row_idx, tok_idx] = float("-inf")
    rows = sorted({row for row, _ in pairs})
    position = {row: i for i, row in enumerate(rows)}
    rows_alive = torch.isfinite(logits[rows].amax(dim=1))
    alive = rows_alive[torch.tensor([position[row] for row, _ in pairs], device=device)]
    logits[row_idx, tok_idx] = torch.where(alive, torch.full_like(saved, float("-inf")), saved)


def _history_keys(token_ids: Sequence[Sequence[int]], vocab: int, *, what: str) -> Tensor:
    """`row * vocab + token` for every token of every row's history, as one CPU tensor."""
    lengths = [len(ids) for ids in token_ids]
    if not any(lengths):
        return torch.zeros(0, dtype=torch.long)
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.long)
    if int(flat.min()) < 0 or int(flat.max()) >= vocab:
        for row, ids in enumerate(token_ids):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"row {row}: {what} token id {bad[0]} is outside the vocabulary [0, {vocab})"
                )
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), torch.tensor(lengths))
    return rows * vocab + flat
