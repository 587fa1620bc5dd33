"""Slow, loop-by-loop references for the sampler tests (float64, one token at a time)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from structgen.sampling_params import SamplingParams

NEG_INF = float("-inf")


def reference_penalties(
    logits: Sequence[float],
    prompt: Sequence[int],
    output: Sequence[int],
    rep: float,
    freq: float,
    pres: float,
) -> list[float]:
    """vLLM's penalties: repetition over prompt + output, frequency and presence over output only."""
    out = list(logits)
    for token in range(len(out)):
        count = list(output).count(token)
        if token in prompt or count > 0:
            out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
        out[token] -= freq * count + pres * (1 if count > 0 else 0)
    return out


def reference_kept(logits: Sequence[float], top_k: int, top_p: float) -> set[int]:
    """Tokens that top-k then top-p keep (ties at a cut-off are kept)."""
    vocab = len(logits)
    order = sorted(range(vocab), key=lambda t: -logits[t])
    kept = [t for t in order if logits[t] > NEG_INF]
    if 0 < top_k < vocab:
        kth = logits[order[top_k - 1]]
        kept = [t for t in kept if logits[t] >= kth]
    if top_p < 1.0:
        norm = math.fsum(math.exp(logits[t]) for t in kept)
        cutoff, mass = NEG_INF, 0.0
        for t in kept:
            if mass < top_p:
                cutoff = logits[t]
            mass += math.exp(logits[t]) / norm
        kept = [t for t in kept if logits[t] >= cutoff]
    return set(kept)


def reference_probs(
    logits: Sequence[float],
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
) -> list[float]:
    """The distribution a sampled (non-greedy) row draws from: penalties → temperature → top-k → top-p → min-p."""
    z = reference_penalties(
        logits, prompt, output, params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    )
    z = [v / params.temperature for v in z]
    kept = reference_kept(z, params.top_k, params.top_p)
    best = max(z[t] for t in kept)
    weights = [math.exp(z[t] - best) if t in kept else 0.0 for t in range(len(z))]
    if params.min_p > 0:
        top = max(weights)
        weights = [w if w >= params.min_p * top else 0.0 for w in weights]
    total = math.fsum(weights)
    return [w / total for w in weights]
