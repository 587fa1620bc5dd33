"""Logprobs of the raw model distribution, as vLLM returns by default: log-softmax of the logits the sampler was
given (structured-output mask included), before penalties, temperature or truncation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from structgen.engine.sampler import SamplingRow


def raw_logprobs(
    raw: Tensor, rows: Sequence[SamplingRow], token_ids: Tensor
) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
    """(the sampled token's logprob per row, NaN where not asked; the `params.logprobs` best (token, logprob)
    pairs per row, without impossible tokens), each None when no row asked."""
    asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not asked:
        return None, None
    part = raw if len(asked) == len(rows) else raw[asked]
    # log-sum-exp by hand: amax is one fast pass, and torch.logsumexp's handling of -inf entries costs
    # several more over [B, V]. No row here is all -inf: those raised before.
    top = part.amax(dim=1, keepdim=True)
    log_norm = (part - top).exp_().sum(dim=1, keepdim=True).log_().add_(top)
    picked = part.gather(1, token_ids[asked].unsqueeze(1)) - log_norm
    logprobs = [math.nan] * len(rows)
    for i, value in zip(asked, picked.squeeze(1).tolist(), strict=True):
        logprobs[i] = value
    wanted = [rows[i].params.logprobs or 0 for i in asked]
    if not any(wanted):
        return logprobs, None
    top_logprobs: list[list[tuple[int, float]]] = [[] for _ in rows]
    for i, pairs in zip(asked, best_logprobs(part, log_norm, wanted), strict=True):
        top_logprobs[i] = pairs
    return logprobs, top_logprobs


def best_logprobs(logits: Tensor, log_norm: Tensor, wanted: Sequence[int]) -> list[list[tuple[int, float]]]:
    """The `wanted[j]` most likely (token, logprob) pairs of row j of `logits` ([rows, vocab]; `log_norm` [rows, 1]
    its log-normalizers), impossible tokens left out: one `topk` for every row."""
    k = max(wanted, default=0)
    if k == 0:
        return [[] for _ in wanted]
    values, ids = logits.topk(min(k, logits.shape[1]), dim=1)
    values = (values - log_norm).tolist()
    ids = ids.tolist()
    return [
        [(t, v) for t, v in zip(ids[j][:n], values[j][:n], strict=True) if v != -math.inf]
        for j, n in enumerate(wanted)
    ]
