"""The batched sampler: one call turns a step's logits `[B, V]` into one token per row.

Order per row, as in vLLM: min_tokens ban and penalties → greedy rows take the argmax; sampled rows go
through temperature → softmax → top-k → top-p → min-p (which zero probabilities) → a draw. Every stage is a
tensor op over all rows that need it, built from per-row parameter lists once per call, and a stage no row
needs is skipped.

The draw is inverse-CDF sampling with one uniform number per row. A seeded row takes its number from its
own generator, so its tokens do not depend on which rows share the batch or in what order; unseeded rows
share one draw (rows sharing a generator draw from it in row order). Compared with the exponential race
(`argmax(probs / q)`, `q ~ Exp(1)`), this needs one random number per row instead of one per vocabulary
entry: on two CPU cores, drawing [64, 100k] numbers alone costs 60-180 ms, several times the softmax.

The input logits may hold -inf entries (the structured-output mask is applied before the sampler). No stage
turns a -inf into something finite, and the draw never lands on a zero-probability token, so those tokens
stay impossible. A row with nothing possible (or NaN / +inf logits) raises `SamplerError` naming the row.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from structgen.engine.penalties import apply_penalties, ban_tokens
from structgen.engine.token_mask import TokenMask
from structgen.engine.truncation import apply_min_p, apply_top_k_top_p
from structgen.errors import StructgenError
from structgen.sampling_params import SamplingParams

# The CDF is searched in two levels, over block sums and then within the chosen block, both cumulated in
# float64 but on small tensors ([B, V / block] and [B, block]): a float64 cumsum of the whole [64, 100k]
# costs ~180 ms on two CPU cores. With one float32 cumsum (and a float32 uniform), tokens less likely than
# float32's 6e-8 steps near 1.0 would be drawn at quantised rates, or never where the cumsum accumulates in
# float32 (CUDA).
_CDF_BLOCK = 1024


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about the request behind one row of the batch logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # The request's own generator when params.seed is set (see make_generator), kept across steps.
    generator: torch.Generator | None = None
    # Banned while len(output_token_ids) < params.min_tokens, unless params.ignore_eos.
    eos_token_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class SamplerOutput:
    """One step's picks. `logprobs` and `top_logprobs` are None when no row asked for them.

    Logprobs are those of the raw model distribution, as vLLM returns by default: log-softmax of the logits
    the sampler was given (structured-output mask included), before penalties, temperature or truncation.
    `logprobs[b]` is the sampled token's (NaN for a row whose `params.logprobs` is None: not computed);
    `top_logprobs[b]` lists the `params.logprobs` most likely `(token_id, logprob)` pairs, best first,
    leaving out impossible (-inf) tokens, and is empty for rows that did not ask.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class SamplerError(StructgenError, ValueError):
    """Some rows have no token to sample; `rows` lists their batch indices so the engine can abort them."""

    def __init__(self, message: str, rows: list[int]) -> None:
        super().__init__(message)
        self.rows = rows


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator for `SamplingRow.generator`: create it once when the request arrives."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Samples one token per row of a batch; stateless apart from the generator of unseeded rows."""

    def __init__(self, *, generator: torch.Generator | None = None) -> None:
        # None draws unseeded rows from torch's default generator (seeded by torch.manual_seed).
        self.generator = generator

    def __call__(
        self, logits: Tensor, rows: Sequence[SamplingRow], *, mask: TokenMask | None = None
    ) -> SamplerOutput:
        """One token per row. `mask` (the structured-output mask) is applied only where it changes the pick:
        see `structgen.engine.token_mask` for why that is exact."""
        raw = self._check_inputs(logits, rows)
        batch = raw.shape[0]
        if batch == 0:
            return SamplerOutput(token_ids=[])
        lazy: list[int] = []
        if mask is not None:
            hinted = set(mask.eager)
            eager: list[int] = []
            for i in mask.rows:
                (eager if i in hinted or _needs_masked_distribution(rows[i].params) else lazy).append(i)
            mask.apply(raw, eager)
        x = _apply_history(raw, rows)
        token_ids = torch.empty(batch, dtype=torch.long, device=raw.device)
        ok = torch.empty(batch, dtype=torch.bool, device=raw.device)
        # A call that raises puts the generators back, so the engine can rerun the good rows and seeded
        # ones still get the tokens they would have got without the dead row in their batch.
        generators = [row.generator for row in rows if not row.params.greedy] + [self.generator]
        saved = [(g, g.get_state()) for g in generators if g is not None]
        # With lazy rows, x must stay unscaled for their second pick.
        self._pick(x, range(batch), rows, token_ids, ok, owned=x is not raw and not lazy)
        if lazy:
            allowed = mask.allows(lazy, token_ids[lazy])  # type: ignore[union-attr]
            rejected = [i for i, good in zip(lazy, allowed, strict=True) if not good]
            mask.rejected = rejected  # type: ignore[union-attr]
            if rejected:
                mask.apply(x, rejected)  # type: ignore[union-attr]
                if x is not raw:  # so that a row left with nothing is reported as the mask's doing
                    mask.apply(raw, rejected)  # type: ignore[union-attr]
                self._pick(x, rejected, rows, token_ids, ok, owned=False)
        ids = token_ids.tolist()
        bad = [i for i, good in enumerate(ok.tolist()) if not good]
        if bad:
            for generator, state in saved:
                generator.set_state(state)
            raise _dead_rows_error(raw, bad)
        logprobs, top_logprobs = _logprobs(raw, rows, token_ids)
        return SamplerOutput(token_ids=ids, logprobs=logprobs, top_logprobs=top_logprobs)

    def _pick(
        self,
        x: Tensor,
        indices: Iterable[int],
        rows: Sequence[SamplingRow],
        token_ids: Tensor,
        ok: Tensor,
        *,
        owned: bool,
    ) -> None:
        """Pick the tokens of rows `indices` of `x` into `token_ids` (and whether each row had any)."""
        greedy = [i for i in indices if rows[i].params.greedy]
        sampled = [i for i in indices if not rows[i].params.greedy]
        if greedy:
            part = x if len(greedy) == x.shape[0] else x[greedy]
            best = row_argmax(part)
            token_ids[greedy] = best
            ok[greedy] = torch.isfinite(part.gather(1, best.unsqueeze(1)).squeeze(1))
        if sampled:
            picks, picked_ok = self._sample(x, sampled, rows, owned=owned)
            token_ids[sampled] = picks
            ok[sampled] = picked_ok

    def _sample(
        self, x: Tensor, indices: list[int], rows: Sequence[SamplingRow], *, owned: bool
    ) -> tuple[Tensor, Tensor]:
        """Temperature, truncation and the draw for the rows `indices` of `x`; `owned`: `x` may be edited."""
        params = [rows[i].params for i in indices]
        if len(indices) == x.shape[0]:
            part = x
        else:
            part, owned = x[indices], True
        temperatures = [p.temperature for p in params]
        if any(t != 1.0 for t in temperatures):
            scale = torch.tensor(temperatures, dtype=part.dtype, device=part.device).unsqueeze(1)
            part, owned = (part.div_(scale) if owned else part / scale), True
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        truncate = any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p)
        if truncate or any(p > 0.0 for p in min_p):
            probs = part.softmax(dim=1)  # the truncations compare normalized probabilities
            if truncate:
                apply_top_k_top_p(probs, top_k, top_p)
            if any(p > 0.0 for p in min_p):
                apply_min_p(probs, min_p)
        else:
            # The draw scales by each row's total anyway: skip softmax's normalizing pass. A row that is all
            # -inf, or holds NaN / +inf, turns NaN here and is reported as dead by the draw.
            top = part.amax(dim=1, keepdim=True)
            probs = part.sub_(top).exp_() if owned else (part - top).exp_()
        uniforms = self._uniforms([rows[i] for i in indices], probs.device)
        return _inverse_cdf(probs, uniforms)

    def _uniforms(self, rows: Sequence[SamplingRow], device: torch.device) -> Tensor:
        """One U[0, 1) number per row: a seeded row's from its own generator, the others' from one draw.

        float64, so the draw resolves tokens far less likely than float32's 6e-8 steps near 1.0.
        """
        uniforms = torch.rand(len(rows), dtype=torch.float64, generator=self.generator, device=device)
        for j, row in enumerate(rows):
            if row.generator is not None:
                uniforms[j] = torch.rand((), dtype=torch.float64, generator=row.generator, device=device)
        return uniforms

    def _check_inputs(self, logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
            what = f"a {logits.dim()}-D {logits.dtype} tensor" if isinstance(logits, Tensor) else type(logits)
            raise ValueError(f"logits must be a 2-D floating-point tensor [batch, vocab], got {what}")
        if logits.shape[0] != len(rows):
            raise ValueError(f"logits have {logits.shape[0]} rows but {len(rows)} SamplingRows were given")
        if logits.shape[1] == 0:
            raise ValueError("logits have an empty vocabulary dimension")
        device_type = logits.device.type
        if self.generator is not None and self.generator.device.type != device_type:
            raise ValueError(
                f"the sampler's generator is on {self.generator.device}, the logits on {logits.device}"
            )
        for i, row in enumerate(rows):
            if row.params.seed is not None and row.generator is None:
                raise ValueError(
                    f"row {i}: params.seed is set but the row has no generator; create one per request with "
                    "make_generator(seed, device) and pass the same one every step"
                )
            if row.generator is not None and row.generator.device.type != device_type:
                raise ValueError(
                    f"row {i}: its generator is on {row.generator.device}, the logits on {logits.device}"
                )
        return logits if logits.dtype == torch.float32 else logits.float()


def row_argmax(x: Tensor) -> Tensor:
    """`x.argmax(dim=1)`, same result (first maximum; NaN counts as the maximum), faster on CPU.

    CPU argmax over a 100k vocabulary is a slow scalar loop (≈ 10 ms for [64, 100352] on one core) while amax
    is vectorized (≈ 1.6 ms): take each chunk's max, the argmax of those (the first chunk holding the row's
    maximum, or its first NaN), then the argmax inside that one chunk (≈ 1.9 ms in all).
    """
    chunk = _argmax_chunk(x.shape[1])
    if x.device.type != "cpu" or chunk == 0 or not x.is_contiguous():
        return x.argmax(dim=1)
    chunks = x.view(x.shape[0], -1, chunk)
    best_chunk = chunks.amax(dim=2).argmax(dim=1)
    within = chunks[torch.arange(x.shape[0], device=x.device), best_chunk].argmax(dim=1)
    return best_chunk * chunk + within


@functools.cache
def _argmax_chunk(vocab: int) -> int:
    """The largest power of two in 64..2048 that divides `vocab` into at least 8 chunks; 0 if none does."""
    for chunk in (2048, 1024, 512, 256, 128, 64):
        if vocab % chunk == 0 and vocab // chunk >= 8:
            return chunk
    return 0


def _apply_history(raw: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
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


def _needs_masked_distribution(params: SamplingParams) -> bool:
    """Rows whose result depends on the masked distribution as a whole, not only on which token wins."""
    if params.logprobs is not None:
        return True
    return not params.greedy and (params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0)


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


def _inverse_cdf(probs: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Token ids drawn from each row of `probs` by inverse CDF, and whether the row had any mass at all."""
    batch, vocab = probs.shape
    block = min(vocab, _CDF_BLOCK)
    num_blocks = -(-vocab // block)
    full = vocab // block
    # Block sums without padding the whole [B, V] (a copy that costs as much as the draw): the full blocks
    # are a view, the short last block is summed on its own.
    sums = probs.new_empty(batch, num_blocks)
    sums[:, :full] = probs[:, : full * block].view(batch, full, block).sum(dim=2)
    if full < num_blocks:
        sums[:, full] = probs[:, full * block :].sum(dim=1)
    block_cum = sums.double().cumsum(dim=1)
    total = block_cum[:, -1:]
    ok = (torch.isfinite(total) & (total > 0)).squeeze(1)
    target = uniforms.double().unsqueeze(1) * total
    chosen_block = _search(block_cum, target).clamp_max(num_blocks - 1)
    before = block_cum.gather(1, (chosen_block - 1).clamp_min(0)).masked_fill_(chosen_block == 0, 0.0)
    columns = chosen_block * block + torch.arange(block, device=probs.device)
    inner = probs.gather(1, columns.clamp_max(vocab - 1)).masked_fill_(columns >= vocab, 0.0)
    inner_cum = inner.double().cumsum(dim=1)
    # Where the target falls within the block, as a fraction of the block's float32-summed mass, placed on
    # the block's exact float64 cumsum: the float32 sum of a block near 1.0 is off by a few of its ulps.
    block_mass = block_cum.gather(1, chosen_block) - before
    fraction = ((target - before) / block_mass).clamp_(0.0, 1.0)
    position = _search(inner_cum, fraction * inner_cum[:, -1:]).clamp_max(block - 1)
    return (chosen_block * block + position).squeeze(1).clamp_max(vocab - 1), ok


def _search(cum: Tensor, target: Tensor) -> Tensor:
    """First index whose cumulative mass exceeds `target` (`[rows, 1]`), never past the last with mass.

    `right=True` skips zero-probability entries (their cumulative value equals the one before them); the
    clamp catches a target that rounding put at or past the row's total.
    """
    found = torch.searchsorted(cum, target, right=True)
    last = torch.searchsorted(cum, cum[:, -1:].contiguous(), right=False)
    return torch.minimum(found, last)


def _logprobs(
    raw: Tensor, rows: Sequence[SamplingRow], token_ids: Tensor
) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
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
    values, ids = part.topk(min(max(wanted), raw.shape[1]), dim=1)
    values = (values - log_norm).tolist()
    ids = ids.tolist()
    top_logprobs: list[list[tuple[int, float]]] = [[] for _ in rows]
    for j, (i, k) in enumerate(zip(asked, wanted, strict=True)):
        pairs = zip(ids[j][:k], values[j][:k], strict=True)
        top_logprobs[i] = [(t, v) for t, v in pairs if v != -math.inf]
    return logprobs, top_logprobs


def _dead_rows_error(raw: Tensor, bad: list[int]) -> SamplerError:
    reasons = []
    for i in bad[:8]:
        row = raw[i]
        if bool(torch.isnan(row).any()):
            reason = "its logits contain NaN"
        elif bool(torch.isposinf(row).any()):
            reason = "its logits contain +inf"
        elif bool(torch.isneginf(row).all()):
            reason = "every token is -inf, so nothing is allowed (check the structured-output mask)"
        else:
            reason = "penalties left no token with a finite logit"
        reasons.append(f"row {i}: {reason}")
    more = f" (and {len(bad) - 8} more rows)" if len(bad) > 8 else ""
    return SamplerError("cannot sample: " + "; ".join(reasons) + more, bad)
