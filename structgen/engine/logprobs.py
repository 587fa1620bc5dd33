"""The logprobs of sampled tokens, in the engine's `logprobs_mode` (vLLM's four):

- "raw_logprobs" (the default, as vLLM's): log-softmax of the logits the sampler was given, structured-output
  mask included (vLLM applies its grammar bitmask before the sampler too), before penalties, temperature or
  truncation: the model's own view of the token.
- "processed_logprobs": log-softmax of the distribution the token was drawn from: after penalties and the
  min_tokens ban, temperature, then top-k / top-p / min-p (tokens they cut are impossible). What an RL trainer
  needs for its importance ratios. A greedy row has no temperature: its penalised logits.
- "raw_logits" / "processed_logits": the same values before normalizing.

Prompt logprobs (`structgen.engine.prompt_logprobs`) follow the logits / logprobs half: a prompt token was not
sampled, so there is nothing to process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from structgen.engine.redraw import Draws
    from structgen.engine.sampler import SamplingRow
    from structgen.sampling_params import SamplingParams


def asking_rows(rows: Sequence[SamplingRow]) -> list[int]:
    """The batch rows whose request asked for logprobs."""
    return [i for i, row in enumerate(rows) if row.params.logprobs is not None]


def processed_logits(
    logits: Tensor, rows: Sequence[SamplingRow], asked: list[int], draws: Draws | None
) -> Tensor:
    """The "processed_logits" mode's values. `logits`: rows `asked` of the sampler's logits after the mask,
    penalties and the min_tokens ban, copied before the picks (those may scale the sampler's own in place).
    Returns them as the tokens were drawn from them: the sampled rows divided by their temperature, -inf where
    top-k, top-p or min-p cut them (`_cut`: where the draw's probabilities, `draws`, which holds every sampled row
    of `asked`, are 0, less the tokens only too unlikely for float32). The truncation is the draw's own, not
    computed again (its top-p sort would double the sampler's time). Edits `logits`."""
    sampled = [j for j, i in enumerate(asked) if not rows[i].params.greedy]
    if not sampled:
        return logits
    assert draws is not None, "a sampled row of the batch was not drawn"
    device = logits.device
    scale = torch.tensor(
        [rows[asked[j]].params.temperature for j in sampled], dtype=logits.dtype, device=device
    ).unsqueeze(1)
    probs, _ = _drawn_rows(draws, [asked[j] for j in sampled])
    params = [rows[asked[j]].params for j in sampled]
    if len(sampled) == logits.shape[0]:
        values = logits.div_(scale)
        return values.masked_fill_(_cut(values, probs, params), -math.inf)
    at = torch.tensor(sampled, dtype=torch.long, device=device)
    values = logits.index_select(0, at).div_(scale)
    values.masked_fill_(_cut(values, probs, params), -math.inf)
    return logits.index_copy_(0, at, values)


# exp() of a float32 more than ~87 (normal) to ~103 (subnormal) below 0 is 0: a token that far below its row's
# best has probability 0 in a draw without having been cut. Below this many nats a zero is read as that.
UNDERFLOW_NATS = 80.0


def _cut(values: Tensor, probs: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """[rows, vocab] bool: the tokens the draw's truncation cut. `values`: the rows' logits over their
    temperature; `probs`: the probabilities they were drawn from, 0 where top-k, top-p or min-p cut a token and
    where float32 could not hold one. A zero far below the row's best is such an underflow, which vLLM's
    processed values (log-softmax of the truncated logits) give finite, unless its row truncates by mass
    (top-p and min-p cut every token of probability 0, on float32 probabilities in vLLM too) or the token is
    outside the row's top-k."""
    zero = probs == 0
    by_mass = [p.top_p < 1.0 or p.min_p > 0.0 for p in params]
    if all(by_mass):
        return zero
    device = values.device
    underflowed = (values - values.amax(dim=1, keepdim=True)) < -UNDERFLOW_NATS
    underflowed &= ~torch.tensor(by_mass, device=device).unsqueeze(1)
    ks = [p.top_k if 0 < p.top_k < values.shape[1] else 0 for p in params]
    # Top-k keeps every token at least as likely as its k-th (ties too, as the draw's cutoff does).
    if any(ks):
        best = values.topk(max(ks), dim=1).values
        kth = best.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device).unsqueeze(1))
        kth[torch.tensor([k == 0 for k in ks], device=device)] = -math.inf
        underflowed &= values >= kth
    return zero & ~underflowed


def processed_logprobs(
    x: Tensor, rows: Sequence[SamplingRow], asked: list[int], token_ids: Tensor, draws: Draws | None
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """The "processed_logprobs" mode's `(logprobs, top_logprobs)` (as `sampled_logprobs`). A sampled row's come
    from the probabilities it was drawn from (`draws`): their log over their total, which the draw summed
    already, so this costs less than the raw mode's log-softmax. A greedy row's are the log-softmax of its
    row of `x`, the logits after the mask, penalties and the min_tokens ban (the sampler's picks leave `x` as it
    was in this mode). A sampled row with fewer possible tokens in its draw than it wants alternatives lists
    them again from `x` over its temperature: tokens too unlikely for float32 but not cut (`_cut`) get their
    finite value there, as in vLLM."""
    greedy = [i for i in asked if rows[i].params.greedy]
    sampled = [i for i in asked if not rows[i].params.greedy]
    parts = []
    if greedy:
        part = x.index_select(0, torch.tensor(greedy, dtype=torch.long, device=x.device))
        parts.append((greedy, *_logit_values(part, greedy, rows, token_ids, normalize=True)))
    if sampled:
        assert draws is not None, "a sampled row of the batch was not drawn"
        probs, index = _drawn_rows(draws, sampled)
        log_total = draws.cdf.block_cum.index_select(0, index)[:, -1:].log()  # float64, [rows, 1]
        picked = probs.gather(1, token_ids[sampled].unsqueeze(1)).double().log_() - log_total
        wanted = [rows[i].params.logprobs or 0 for i in sampled]
        values, best = picked.squeeze(1).tolist(), best_logprobs(probs, log_total, wanted, of_probs=True)
        short = [j for j, pairs in enumerate(best) if len(pairs) < wanted[j]]
        if short:
            _list_underflowed(x, draws, [sampled[j] for j in short], rows, token_ids, short, values, best)
        parts.append((sampled, values, best))
    return _outputs(rows, asked, parts)


def _list_underflowed(
    x: Tensor,
    draws: Draws,
    batch_rows: list[int],
    rows: Sequence[SamplingRow],
    token_ids: Tensor,
    at: list[int],
    values: list[float],
    best: list[list[tuple[int, float]]],
) -> None:
    """`processed_logprobs` for the sampled `batch_rows` (at `at` of `values` and `best`, which are rewritten)
    from their logits in `x`, processed as the "processed_logits" mode's: a row's draw holds fewer possible
    tokens than it wants listed when the others are cut, or only too unlikely for float32."""
    logits = x.index_select(0, torch.tensor(batch_rows, dtype=torch.long, device=x.device))
    processed = processed_logits(logits, rows, batch_rows, draws)
    picked, pairs = _logit_values(processed, batch_rows, rows, token_ids, normalize=True)
    for j, value, listed in zip(at, picked, pairs, strict=True):
        values[j], best[j] = value, listed


def sampled_logprobs(
    values: Tensor,
    asked: list[int],
    rows: Sequence[SamplingRow],
    token_ids: Tensor,
    *,
    normalize: bool,
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """(the sampled token's value per row, NaN where not asked; the `params.logprobs` best (token, value) pairs
    per row, without impossible tokens, or None when no row wants any) for the raw and *_logits modes. `values`
    holds the rows `asked` (`[len(asked), vocab]`); `normalize`: their log-softmax, else the values themselves
    (the *_logits modes)."""
    return _outputs(
        rows, asked, [(asked, *_logit_values(values, asked, rows, token_ids, normalize=normalize))]
    )


def best_logprobs(
    scores: Tensor, log_norm: Tensor, wanted: Sequence[int], *, of_probs: bool = False
) -> list[list[tuple[int, float]]]:
    """The `wanted[j]` most likely (token, logprob) pairs of row j of `scores` ([rows, vocab] logits, or
    probabilities with `of_probs`; `log_norm` [rows, 1] their log-normalizers), impossible tokens left out: one
    `topk` for every row."""
    k = max(wanted, default=0)
    if k == 0:
        return [[] for _ in wanted]
    values, ids = scores.topk(min(k, scores.shape[1]), dim=1)
    if of_probs:
        values = values.double().log_()
    values = (values - log_norm).tolist()
    ids = ids.tolist()
    return [
        [(t, v) for t, v in zip(ids[j][:n], values[j][:n], strict=True) if v != -math.inf]
        for j, n in enumerate(wanted)
    ]


def _logit_values(
    values: Tensor, asked: list[int], rows: Sequence[SamplingRow], token_ids: Tensor, *, normalize: bool
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The picked tokens' values and the best pairs of the rows `asked`, held in `values`."""
    if normalize:
        # log-sum-exp by hand: amax is one fast pass, and torch.logsumexp's handling of -inf entries costs
        # several more over [B, V]. No row here is all -inf: those raised before.
        top = values.amax(dim=1, keepdim=True)
        log_norm = (values - top).exp_().sum(dim=1, keepdim=True).log_().add_(top)
    else:
        log_norm = values.new_zeros(values.shape[0], 1)
    picked = values.gather(1, token_ids[asked].unsqueeze(1)) - log_norm
    wanted = [rows[i].params.logprobs or 0 for i in asked]
    return picked.squeeze(1).tolist(), best_logprobs(values, log_norm, wanted)


def _drawn_rows(draws: Draws, batch_rows: list[int]) -> tuple[Tensor, Tensor]:
    """(the probabilities the rows `batch_rows` were drawn from, their rows in the draw as a long tensor). The
    probabilities are a view where they are the draw's rows in order: index_select of whole rows costs ~3 ms for
    [32, 49k] floats here."""
    probs = draws.cdf.probs
    positions = [draws.position[i] for i in batch_rows]
    index = torch.tensor(positions, dtype=torch.long, device=probs.device)
    if positions == list(range(probs.shape[0])):
        return probs, index
    return probs.index_select(0, index), index


def _outputs(
    rows: Sequence[SamplingRow],
    asked: list[int],
    parts: list[tuple[list[int], list[float], list[list[tuple[int, float]]]]],
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """The per-batch-row lists from `parts`, each (batch rows, their picked values, their best pairs): NaN and
    no pairs for the rows not asked, and no pair lists at all when no asked row wants any."""
    logprobs = [math.nan] * len(rows)
    top_logprobs: list[list[tuple[int, float]]] = [[] for _ in rows]
    for batch_rows, picked, best in parts:
        for i, value, pairs in zip(batch_rows, picked, best, strict=True):
            logprobs[i] = value
            top_logprobs[i] = pairs
    return logprobs, top_logprobs if any(rows[i].params.logprobs for i in asked) else None
