"""Truncation of the sampling distribution: top-k, top-p (nucleus) and min-p, for a whole batch at once.

These work on probabilities (the softmax the draw needs anyway), zeroing what a row drops; the draw
renormalises, so nothing here has to. Each step is one cut-off per row and one masked fill (`prob < cut-off`
→ 0), so a row keeps every token tied with its cut-off. The top-p cut-off comes from `topk` over a few
candidates rather than a sort of the whole vocabulary: the nucleus of peaked, model-like distributions fits
in the best 256 tokens, and a sort of [64, 100k] float32 costs ~0.4-1.3 s on two CPU cores against ~50 ms
for that `topk`. Rows whose nucleus does not fit retry with 8× the candidates, and sort past 1/8 of the
vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

_FIRST_CANDIDATES = 256
_GROWTH = 8


def apply_top_k_top_p(probs: Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> None:
    """Keep, in place, each row's `top_k` most likely tokens, then the smallest set of those whose
    renormalised probability reaches `top_p`; the rest become 0. `probs` rows are softmax outputs (sum 1).
    `top_k <= 0` or `>= vocab`, and `top_p >= 1`, switch that step off for the row.
    """
    batch, vocab = probs.shape
    if len(top_k) != batch or len(top_p) != batch:
        raise ValueError(f"top_k has {len(top_k)} and top_p {len(top_p)} entries for {batch} rows")
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    rows = [i for i in range(batch) if ks[i] < vocab or top_p[i] < 1.0]
    if not rows:
        return
    cutoff = torch.zeros(batch, dtype=probs.dtype, device=probs.device)
    cutoff[rows] = _cutoffs(probs, rows, [ks[i] for i in rows], [top_p[i] for i in rows])
    probs.masked_fill_(probs < cutoff.unsqueeze(1), 0.0)


def apply_min_p(probs: Tensor, min_p: Sequence[float]) -> None:
    """Zero, in place, tokens less likely than `min_p` times the row's most likely token."""
    if len(min_p) != probs.shape[0]:
        raise ValueError(f"min_p has {len(min_p)} entries for {probs.shape[0]} rows")
    scale = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)
    cutoff = probs.amax(dim=1) * scale
    probs.masked_fill_(probs < cutoff.unsqueeze(1), 0.0)


def _cutoffs(probs: Tensor, rows: list[int], ks: list[int], ps: list[float]) -> Tensor:
    """The smallest probability each of `rows` keeps under its top-k (`ks`, vocab = off) and top-p (`ps`)."""
    vocab = probs.shape[1]
    device = probs.device
    out = torch.empty(len(rows), dtype=probs.dtype, device=device)
    todo = list(range(len(rows)))
    # Enough candidates for every top-k row, and a first guess for top-p rows.
    size = max([k for k in ks if k < vocab], default=1)
    if any(p < 1.0 for p in ps):
        size = max(size, _FIRST_CANDIDATES)
    while todo:
        if size > vocab // _GROWTH:
            size = vocab  # past this, topk is no faster than a sort
        picked = [rows[j] for j in todo]
        part = probs if picked == list(range(probs.shape[0])) else probs[picked]
        # Sorted, most likely first.
        values = (part.topk(size, dim=1) if size < vocab else part.sort(dim=1, descending=True)).values
        k = torch.tensor([min(ks[j], size) for j in todo], device=device).unsqueeze(1)
        p = torch.tensor([ps[j] for j in todo], dtype=probs.dtype, device=device).unsqueeze(1)
        top_k_on = torch.tensor([ks[j] < vocab for j in todo], device=device).unsqueeze(1)
        kth = values.gather(1, k - 1)
        # Top-p renormalises over what top-k kept (softmax rows already sum to 1 when top-k is off).
        kept = values.masked_fill(values < kth, 0.0)
        cum = kept.cumsum(dim=1)
        norm = torch.where(top_k_on, cum[:, -1:], torch.ones_like(p))
        # A token is kept while the mass of the likelier tokens before it is still below p.
        last = (cum < p * norm).sum(dim=1, keepdim=True)
        # With top-k on, the mass cannot grow past the k-th candidate, so more candidates would not help.
        fits = (last < size) | (p >= 1.0) | top_k_on | (size == vocab)
        nucleus = values.gather(1, last.clamp_max(size - 1))
        cut = torch.where(p >= 1.0, kth, torch.maximum(kth, nucleus)).squeeze(1)
        fits_list = fits.squeeze(1).tolist()
        done = [i for i, ok in enumerate(fits_list) if ok]
        if done:
            out[[todo[i] for i in done]] = cut[done]
        todo = [todo[i] for i, ok in enumerate(fits_list) if not ok]
        size *= _GROWTH
    return out
