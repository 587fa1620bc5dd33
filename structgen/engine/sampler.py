"""The batched sampler: one call turns a step's logits `[B, V]` into one token per row.

Order per row, as in vLLM: min_tokens ban and penalties → greedy rows take the argmax; sampled rows go
through temperature → softmax → top-k → top-p → min-p (which zero probabilities) → a draw. Every stage is a
tensor op over all rows that need it, built from per-row parameter lists once per call, and a stage no row
needs is skipped.

The draw is inverse-CDF sampling (`inverse_cdf.py`) with one uniform number per row, and one more per draw
again for a row whose pick the structured-output mask rejected (see `token_mask.py` and `redraw.py`). A seeded
row takes its numbers from its own generator, so its tokens do not depend on which rows share the batch or in what order;
unseeded rows share one draw (rows sharing a generator draw from it in row order). Compared with the exponential race
(`argmax(probs / q)`, `q ~ Exp(1)`), this needs one random number per row instead of one per vocabulary
entry: on two CPU cores, drawing [64, 100k] numbers alone costs 60-180 ms, several times the softmax.

The input logits may hold -inf entries (the structured-output mask is applied before the sampler). No stage
turns a -inf into something finite, and the draw never lands on a zero-probability token, so those tokens
stay impossible. A row with nothing possible (or NaN / +inf logits) raises `SamplerError` naming the row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from structgen.config import check_logprobs_mode
from structgen.engine.fast_picks import list_allowed_rows, pick_among_allowed, row_argmax
from structgen.engine.inverse_cdf import InverseCdf
from structgen.engine.logprobs import asking_rows, processed_logits, processed_logprobs, sampled_logprobs
from structgen.engine.penalties import apply_history
from structgen.engine.redraw import Draws
from structgen.engine.token_mask import TokenMask, needs_masked_distribution
from structgen.engine.truncation import apply_min_p, apply_top_k_top_p
from structgen.errors import StructgenError
from structgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from structgen.engine.sequence import Sequence as EngineSequence


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

    def subset(self, keep: list[int]) -> SamplerOutput:
        """The picks of rows `keep`, in that order."""
        return SamplerOutput(
            token_ids=[self.token_ids[i] for i in keep],
            logprobs=[self.logprobs[i] for i in keep] if self.logprobs is not None else None,
            top_logprobs=[self.top_logprobs[i] for i in keep] if self.top_logprobs is not None else None,
        )


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


def fork_generator(
    seq: EngineSequence, index: int, *, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The generator of sample `index` of a request forked into `n` samples (the scheduler's `fork_generator`):
    sample i of a seeded request draws from seed + i, as vLLM derives it; unseeded samples share the engine's."""
    seed = seq.params.seed if seq.params is not None else None
    return make_generator(seed + index, device) if seed is not None else None


class Sampler:
    """Samples one token per row of a batch; stateless apart from the generator of unseeded rows."""

    def __init__(
        self, *, generator: torch.Generator | None = None, logprobs_mode: str = "raw_logprobs"
    ) -> None:
        # None draws unseeded rows from torch's default generator (seeded by torch.manual_seed).
        self.generator = generator
        # What `SamplerOutput.logprobs` hold (`structgen.engine.logprobs`).
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)

    def __call__(
        self, logits: Tensor, rows: Sequence[SamplingRow], *, mask: TokenMask | None = None
    ) -> SamplerOutput:
        """One token per row. `mask` (the structured-output mask) is applied only where it changes the pick:
        see `structgen.engine.token_mask` for why that is exact."""
        raw = self._check_inputs(logits, rows)
        batch = raw.shape[0]
        if batch == 0:
            return SamplerOutput(token_ids=[])
        lazy: list[int] = []  # picked unmasked first; masked only if the pick is not allowed
        hinted: list[int] = []  # expected to be rejected: picked with the mask straight away
        if mask is not None:
            masked_first, hint = [], set(mask.eager)
            for i in mask.rows:
                if needs_masked_distribution(rows[i].params):
                    masked_first.append(i)
                else:
                    (hinted if i in hint else lazy).append(i)
            mask.apply(raw, masked_first)
        x = apply_history(raw, rows)
        asked = asking_rows(rows)  # masked first (`needs_masked_distribution`): x holds their whole mask
        # The processed_logits mode's logits, kept before the picks (which may scale x in place).
        kept = None
        if asked and self.logprobs_mode == "processed_logits":
            kept = x.clone() if len(asked) == batch else x.index_select(0, _index(asked, x.device))
        token_ids = torch.empty(batch, dtype=torch.long, device=raw.device)
        ok = torch.empty(batch, dtype=torch.bool, device=raw.device)
        # A call that raises puts the generators back, so the engine can rerun the good rows and seeded
        # ones still get the tokens they would have got without the dead row in their batch.
        generators = [row.generator for row in rows if not row.params.greedy] + [self.generator]
        saved = [(g, g.get_state()) for g in generators if g is not None]
        # Hinted rows whose mask allows few tokens are picked among those alone; the others go the lazy way.
        hinted_dense, hinted_sparse = self._split_sparse(x, hinted, mask) if hinted else ([], [])
        lazy = sorted(lazy + hinted_dense)
        skip = {i for i, _ in hinted_sparse}
        first = [i for i in range(batch) if i not in skip] if skip else range(batch)
        # With lazy rows, x must stay unscaled for their masked pick; so must asked rows' in the
        # processed_logprobs mode, which may list alternatives from it (`processed_logprobs`).
        keep_x = lazy or skip or (asked and self.logprobs_mode == "processed_logprobs")
        draws = self._pick(x, first, rows, token_ids, ok, owned=x is not raw and not keep_x)
        dead = self._pick_among_allowed(x, hinted_sparse, rows, token_ids, ok)
        rejected: list[int] = []
        dense: list[int] = []
        if lazy:
            rejected = self._redraw(lazy, rows, token_ids, mask, draws)  # type: ignore[arg-type]
            dense, sparse = self._split_sparse(x, rejected, mask)  # type: ignore[arg-type]
            dead += self._pick_among_allowed(x, sparse, rows, token_ids, ok)
            if dense and draws is not None:  # from the kept probabilities; the rest masked and picked below
                uniforms = self._row_uniforms(rows, x.device)
                dense = draws.under_mask(dense, token_ids, ok, mask, uniforms)  # type: ignore[arg-type]
        if mask is not None:
            # Next step's hint: rows rejected now, and hinted rows still at a structural point.
            mask.rejected = sorted(rejected + list(skip))
            mask.apply(x, dense + dead)
            if x is not raw:  # so that a row left with nothing is reported as the mask's doing
                mask.apply(raw, dense + dead)
            if dense:
                self._pick(x, dense, rows, token_ids, ok, owned=False)
        ids = token_ids.tolist()
        bad = [i for i, good in enumerate(ok.tolist()) if not good]
        if bad:
            for generator, state in saved:
                generator.set_state(state)
            raise _dead_rows_error(raw, bad)
        if not asked:
            return SamplerOutput(token_ids=ids)
        if self.logprobs_mode == "processed_logprobs":
            logprobs, top_logprobs = processed_logprobs(x, rows, asked, token_ids, draws)
        else:
            if kept is not None:
                values = processed_logits(kept, rows, asked, draws)
            else:
                values = raw if len(asked) == batch else raw.index_select(0, _index(asked, raw.device))
            normalize = self.logprobs_mode == "raw_logprobs"
            logprobs, top_logprobs = sampled_logprobs(values, asked, rows, token_ids, normalize=normalize)
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
    ) -> Draws | None:
        """Pick the tokens of rows `indices` of `x` into `token_ids` (and whether each row had any). Returns
        the sampled rows' CDFs, for `_redraw`."""
        greedy = [i for i in indices if rows[i].params.greedy]
        sampled = [i for i in indices if not rows[i].params.greedy]
        if greedy:
            part = x if len(greedy) == x.shape[0] else x.index_select(0, _index(greedy, x.device))
            best = row_argmax(part)
            token_ids[greedy] = best
            ok[greedy] = torch.isfinite(part.gather(1, best.unsqueeze(1)).squeeze(1))
        if not sampled:
            return None
        cdf = self._sample(x, sampled, rows, owned=owned)
        token_ids[sampled] = cdf.draw(self._uniforms([rows[i] for i in sampled], x.device))
        ok[sampled] = cdf.ok
        return Draws(cdf, {row: j for j, row in enumerate(sampled)})

    def _redraw(
        self,
        lazy: list[int],
        rows: Sequence[SamplingRow],
        token_ids: Tensor,
        mask: TokenMask,
        draws: Draws | None,
    ) -> list[int]:
        """The lazy rows whose pick the mask rejects, after the sampled ones drew again from their unmasked
        distribution (`Draws.again`). The rows returned (greedy ones, and sampled ones still rejected) are
        for the caller to draw under the mask."""
        allowed = mask.allows(lazy, token_ids[lazy])
        pending = [i for i, good in zip(lazy, allowed, strict=True) if not good]
        if draws is None or not pending:
            return pending
        return draws.again(pending, token_ids, mask, self._row_uniforms(rows, token_ids.device))

    def _row_uniforms(
        self, rows: Sequence[SamplingRow], device: torch.device
    ) -> Callable[[list[int], int], Tensor]:
        """`_uniforms` for batch rows given by index (`per_row` numbers each, row after row)."""
        return lambda indices, per_row=1: self._uniforms([rows[i] for i in indices], device, per_row=per_row)

    def _split_sparse(
        self, x: Tensor, indices: list[int], mask: TokenMask
    ) -> tuple[list[int], list[tuple[int, Tensor]]]:
        """Rows of `indices` whose mask allows many tokens, and (row, allowed ids) for those allowing few."""
        if not indices or x.device.type != "cpu" or mask.bitmask.device.type != "cpu":
            return indices, []
        listed = mask.allowed
        sparse = [(i, listed[i]) for i in indices if i in listed]
        rest = [i for i in indices if i not in listed] if sparse else indices
        dense = []
        if rest:
            mask.ensure_filled(rest)
            for i, ids in zip(rest, list_allowed_rows(mask.bitmask, rest, x.shape[1]), strict=True):
                (dense.append(i) if ids is None else sparse.append((i, ids)))
        return dense, sparse

    def _pick_among_allowed(
        self,
        x: Tensor,
        sparse: list[tuple[int, Tensor]],
        rows: Sequence[SamplingRow],
        token_ids: Tensor,
        ok: Tensor,
    ) -> list[int]:
        """Pick each (row, allowed ids) among those tokens alone (see `fast_picks`); returns the rows with no
        possible token (marked not ok), which the caller masks so that the error names the mask."""
        if not sparse:
            return []
        draws = [j for j, (i, _) in enumerate(sparse) if not rows[i].params.greedy]
        uniforms = torch.full((len(sparse),), float("nan"), dtype=torch.float64)
        if draws:  # NaN for the greedy rows; drawn in the order `pick_among` row by row would draw them
            uniforms[draws] = self._uniforms([rows[sparse[j][0]] for j in draws], x.device).cpu()
        drawn = set(draws)
        batch_rows = [i for i, _ in sparse]
        temperatures = [rows[i].params.temperature if j in drawn else 1.0 for j, i in enumerate(batch_rows)]
        pick_among_allowed(x, batch_rows, [ids for _, ids in sparse], temperatures, uniforms, token_ids, ok)
        possible = ok[batch_rows].tolist()
        return [i for i, good in zip(batch_rows, possible, strict=True) if not good]

    def _sample(
        self, x: Tensor, indices: list[int], rows: Sequence[SamplingRow], *, owned: bool
    ) -> InverseCdf:
        """Temperature and truncation for the rows `indices` of `x` (`owned`: `x` may be edited): the CDF
        of each row's distribution, ready to draw from."""
        params = [rows[i].params for i in indices]
        if len(indices) == x.shape[0]:
            part = x
        else:  # (index_select copies whole rows; `x[indices]` goes element by element, ~5x slower on a CPU)
            part, owned = x.index_select(0, _index(indices, x.device)), True
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
        return InverseCdf(probs)

    def _uniforms(self, rows: Sequence[SamplingRow], device: torch.device, *, per_row: int = 1) -> Tensor:
        """`per_row` U[0, 1) numbers per row, row after row: a seeded row's from its own generator, the others'
        from one draw.

        float64, so the draw resolves tokens far less likely than float32's 6e-8 steps near 1.0.
        """
        uniforms = torch.rand(
            len(rows) * per_row, dtype=torch.float64, generator=self.generator, device=device
        )
        seeded = [j for j, row in enumerate(rows) if row.generator is not None]
        if per_row > 1:
            for j in seeded:
                uniforms[j * per_row : (j + 1) * per_row] = torch.rand(
                    per_row, dtype=torch.float64, generator=rows[j].generator, device=device
                )
        elif seeded and device.type == "cpu":  # one write for all (a write per row costs as much as its draw)
            values = [torch.rand((), dtype=torch.float64, generator=rows[j].generator).item() for j in seeded]
            uniforms[seeded] = torch.tensor(values, dtype=torch.float64)
        else:
            for j in seeded:
                uniforms[j] = torch.rand((), dtype=torch.float64, generator=rows[j].generator, device=device)
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


def _index(rows: list[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


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
