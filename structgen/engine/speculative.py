"""Speculative decoding in the step: propose, verify in one forward, keep what the target model agrees with.

Before a step is scheduled, each eligible decoding sequence gets up to `k` proposed tokens from the configured
proposer (n-gram prompt lookup, `ngram.py`, or a draft model, `draft_model.py`), cut at the first token its
grammar would reject (`validate_tokens` checks without moving the matcher) or its phase bans. The proposals sit at the end of `seq.token_ids` only (never in its output), so
the scheduler runs `[last, d1 .. dk]` as `k + 1` new tokens of one sequence: one forward gives the logits after
each of them. `settle` keeps the proposals of sequences scheduled whole and takes back the others (preempted, or
cut by the step's token budget). After the forward, `take_back` removes them again before the scheduler records
the step, so the KV counted and the blocks offered to the prefix cache hold accepted tokens only.

The token after `last` is sampled as any other (the same mask, the same sampler); while the token just appended
equals the next proposal, that proposal's KV is valid and the logits after it pick the next token the same way
(reasoning bans, the grammar's mask, the request's own sampling: its generator, penalties, logprobs), through
the same output processor (stop rules, jump-forward, reasoning, closing). Verification stops at the first
difference, or where the output processor appended more than the token (the grammar forced tokens:
jump-forward first, speculation for the rest). A greedy pick is the argmax either way, so greedy outputs are
exactly those without speculation (up to the float rounding of a step of several rows); a sampled pick is a
draw from the request's distribution that keeps the proposal only when it equals it, which for a proposal that
is one token for sure is rejection sampling: the outputs are distributed as without speculation (a seeded
request's differ, its draws coming in another order).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from structgen.engine.ngram import NgramProposer
from structgen.engine.reasoning import ban_phase_tokens
from structgen.engine.sampler import SamplingRow
from structgen.engine.sequence import Sequence, SequenceStatus
from structgen.engine.token_mask import TokenMask
from structgen.structured.bitmask import unpack_bitmask

if TYPE_CHECKING:
    from structgen.config import SpeculativeConfig
    from structgen.engine.block_manager import BlockManager
    from structgen.engine.draft_model import DraftModelProposer
    from structgen.engine.llm_engine import LLMEngine
    from structgen.engine.output_processor import OutputProcessor
    from structgen.engine.scheduler import SchedulerOutput
    from structgen.engine.sequence import Request
    from structgen.engine.structured import StructuredOutputs


@dataclass(slots=True)
class SpeculationCounters:
    num_proposed: int = 0  # proposals the target model verified
    num_accepted: int = 0  # of those, the ones it agreed with
    num_steps: int = 0  # steps in which some sequence speculated
    num_picks: int = 0  # tokens picked from the logits after an accepted proposal (sampled tokens, in effect)


class Speculator:
    @classmethod
    def for_engine(cls, engine: LLMEngine) -> Speculator:
        return cls(
            engine.config.speculative_config,  # type: ignore[arg-type]  (parsed in EngineConfig)
            structured=engine.structured,
            output_processor=engine.output_processor,
            block_manager=engine.block_manager,
            num_valid_tokens=engine.runner.num_valid_tokens,
            # (late-bound: tests wrap the runner's sampler)
            sample=lambda logits, rows, mask: engine.runner.sampler(logits, rows, mask=mask),
            eos_token_ids=engine.eos_token_ids,
            proposer=_proposer(engine),
        )

    def __init__(
        self,
        config: SpeculativeConfig,
        *,
        structured: StructuredOutputs,
        output_processor: OutputProcessor,
        block_manager: BlockManager,
        num_valid_tokens: int,
        sample: Callable[[torch.Tensor, list[SamplingRow], TokenMask | None], Any],
        eos_token_ids: frozenset[int] = frozenset(),
        proposer: NgramProposer | DraftModelProposer | None = None,
    ) -> None:
        self.config = config
        self.sample = sample  # the engine's sampler: (logits [rows, vocab], rows, mask) -> SamplerOutput
        # One row for a grammar's mask: at a proposal (verify) and for a proposer's fallback (propose), never both
        # at once.
        self._bitmask: torch.Tensor | None = None
        self.eos_token_ids = eos_token_ids
        self.proposer = (
            proposer
            if proposer is not None
            else NgramProposer(max_n=config.prompt_lookup_max, min_n=config.prompt_lookup_min)
        )
        self.structured = structured
        self.output_processor = output_processor
        self.block_manager = block_manager
        self.num_valid_tokens = num_valid_tokens
        self.counters = SpeculationCounters()
        # seq_id -> (the sequence, the tokens appended to its token_ids)
        self._proposals: dict[int, tuple[Sequence, list[int]]] = {}

    # -- before the forward ------------------------------------------------------------------------------------

    def propose(self, running: list[Sequence]) -> None:
        """Append proposals to the eligible sequences' token ids (at most `max_batch_size` decoding)."""
        config, proposer = self.config, self.proposer
        if (
            proposer.num_held and len(running) <= config.max_batch_size
        ):  # forget the sequences no longer running
            proposer.retain({seq.seq_id for seq in running})
        if not running or len(running) > config.max_batch_size:
            return
        wanted = []
        for seq in running:
            if not _eligible(seq):
                continue
            # Tokens already waiting for their KV (a grammar's forced run) ride in the same rows: the sequence
            # runs at most `1 + num_speculative_tokens` new tokens a step (more rows cost more than they gave:
            # BENCHMARKS.md).
            pending = len(seq.token_ids) - seq.num_computed_tokens
            k = min(config.num_speculative_tokens + 1 - pending, self.output_processor.tokens_left(seq) - 1)
            if k > 0:
                wanted.append((seq, k))
        if not wanted:
            return
        by_id = {seq.seq_id: seq for seq, _ in wanted}
        for seq_id, tokens in proposer.propose(wanted, self._allowed_prefix, self._grammar_pick).items():
            seq = by_id[seq_id]
            seq.token_ids.extend(tokens)
            self._proposals[seq_id] = (seq, tokens)

    def settle(self, batch: SchedulerOutput) -> dict[int, int]:
        """{batch row: proposals} of the sequences scheduled whole; the others' proposals are taken back (a
        sequence cut short by the token budget runs what it had before them, as without speculation)."""
        if not self._proposals:
            return {}
        spec: dict[int, int] = {}
        rows = {seq.seq_id: row for row, seq in enumerate(batch.seqs)}
        for seq_id, (seq, tokens) in list(self._proposals.items()):
            row = rows.get(seq_id)
            k = len(tokens)
            whole = len(seq.token_ids) - seq.num_computed_tokens
            if (
                row is not None
                and batch.num_new_tokens[row] == whole
                and seq.status is SequenceStatus.RUNNING
            ):
                spec[row] = k
                continue
            del seq.token_ids[-k:]  # not run (preempted, no budget left) or cut short
            del self._proposals[seq_id]
            if row is not None:
                num_new = min(batch.num_new_tokens[row], len(seq.token_ids) - seq.num_computed_tokens)
                batch.num_new_tokens[row] = num_new
                if seq.num_computed_tokens + num_new == len(seq.token_ids) and seq not in batch.sample_seqs:
                    # Sampling rows stay in batch order: the runner's logits follow it.
                    at = bisect.bisect(batch.sample_indices, row)
                    batch.sample_seqs.insert(at, seq)
                    batch.sample_indices.insert(at, row)
        return spec

    # -- after the forward -------------------------------------------------------------------------------------

    def take_back(self, batch: SchedulerOutput, spec: dict[int, int]) -> dict[int, list[int]]:
        """Remove the proposals from the token ids before the step is recorded; {row: proposals}."""
        taken = {}
        for row, k in spec.items():
            seq = batch.seqs[row]
            taken[row] = self._proposals.pop(seq.seq_id)[1]
            del seq.token_ids[-k:]
            batch.num_new_tokens[row] -= k
        return taken

    def verify(
        self,
        batch: SchedulerOutput,
        proposals: dict[int, list[int]],
        logits: dict[int, torch.Tensor],
        requests: dict[str, Request],
        ended: list[tuple[Sequence, SequenceStatus]],
    ) -> tuple[list[tuple[Sequence, SequenceStatus]], int]:
        """Accept proposals while the target model's picks agree; returns the sequences that finished and how
        many tokens were picked after accepted proposals."""
        output_processor, block_manager = self.output_processor, self.block_manager
        picks_before = self.counters.num_picks
        finished: list[tuple[Sequence, SequenceStatus]] = []
        done = {id(seq) for seq, _ in ended}
        if proposals:
            self.counters.num_steps += 1
        for row, tokens in proposals.items():
            seq = batch.seqs[row]
            self.counters.num_proposed += len(tokens)
            if id(seq) in done or seq.is_finished:
                continue
            rows = logits[row]
            length = len(seq.output_token_ids)  # after the first pick, which the sampler made
            for j, token in enumerate(tokens):
                if seq.output_token_ids[-1] != token or len(seq.token_ids) != seq.num_computed_tokens + 1:
                    break
                try:
                    picked = self._pick(seq, rows[j])
                except Exception:  # no token possible, or the grammar's fill failed: the next step samples it
                    break  # from its own row, where the batch's mask and sampler handle both
                # The pick before was the proposal: its KV, written by this step's forward, stands.
                self.counters.num_accepted += 1
                seq.num_computed_tokens += 1
                block_manager.commit(seq)
                self.counters.num_picks += 1
                ended_now = output_processor.process([seq], picked, requests)
                if ended_now:
                    finished += ended_now
                    break
                if len(seq.output_token_ids) != length + j + 1:
                    break  # forced tokens followed (or the closer replaced the pick): they have no KV yet
        return finished, self.counters.num_picks - picks_before

    # -- helpers -----------------------------------------------------------------------------------------------

    def _allowed_prefix(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """The proposals up to the first one the sequence may not produce now."""
        reasoning = seq.reasoning
        if reasoning is not None:
            banned = set(reasoning.banned_token_ids) | {reasoning.markers.start_token_id}
            if reasoning.markers.end_token_id in tokens and reasoning.thinking:
                return []  # the phase switches there: verified one token at a time
            for i, token in enumerate(tokens):
                if token in banned:
                    tokens = tokens[:i]
                    break
        grammar = _active_grammar(seq)
        if grammar is not None and tokens:
            tokens = tokens[: grammar.validate_tokens(tokens)]
        return tokens

    def _grammar_pick(self, seq: Sequence, tokens: list[int], logits: torch.Tensor) -> int | None:
        """The highest of `logits` [vocab] among the tokens the sequence's grammar allows after `tokens`: its
        mask, from a copy of the grammar (a proposer's fallback when none of its first choices is allowed)."""
        grammar = _active_grammar(seq)
        if grammar is None:
            return None
        probe = grammar.clone()
        if (tokens and not probe.accept_tokens(tokens)) or probe.is_terminated():
            return None
        bitmask = self._one_row_bitmask()
        if self.structured.ensure_manager().fill_bitmask([(probe, 0)], bitmask):
            return None
        allowed = unpack_bitmask(bitmask[0], logits.shape[-1])
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        if not allowed[token] or len(self._allowed_prefix(seq, [*tokens, token])) != len(tokens) + 1:
            return None
        return token

    def _pick(self, seq: Sequence, row: torch.Tensor) -> Any:
        """The sampler's pick from one row of logits, as the step's own row is picked: the reasoning bans, then the
        request's own sampling (generator, penalties, logprobs) under its grammar's mask, handed to the sampler as
        the step's mask is (a lazy row: filled only when the pick needs it)."""
        x = row.float().unsqueeze(0).clone()
        if self.num_valid_tokens < x.shape[1]:
            x[0, self.num_valid_tokens :] = float("-inf")
        ban_phase_tokens(x, [seq])
        grammar = _active_grammar(seq)
        sampling_row = SamplingRow(
            params=seq.params,  # type: ignore[arg-type]
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=seq.generator,
            eos_token_ids=self.eos_token_ids,
        )
        return self.sample(x, [sampling_row], self._mask(grammar) if grammar is not None else None)

    def _one_row_bitmask(self) -> torch.Tensor:
        if self._bitmask is None:
            self._bitmask = self.structured.ensure_manager().allocate_bitmask(1)
        return self._bitmask

    def _mask(self, grammar: Any) -> TokenMask:
        bitmask = self._one_row_bitmask()

        def fill(rows: list[int]) -> None:
            failures = self.structured.ensure_manager().fill_bitmask([(grammar, 0)], bitmask)
            if failures:
                raise failures[0][1]

        check = {0: lambda token: grammar.validate_tokens((token,)) == 1}
        return TokenMask(bitmask=bitmask, rows=[0], unfilled=check, fill=fill)


def _proposer(engine: LLMEngine) -> NgramProposer | DraftModelProposer:
    config: SpeculativeConfig = engine.config.speculative_config  # type: ignore[assignment]
    if config.method == "draft_model":
        from structgen.engine.draft_model import DraftModelProposer

        return DraftModelProposer.load(
            config,
            target=engine.model,
            target_dir=engine.model_dir,
            target_tokenizer=engine.tokenizer,
            device=engine.device,
            block_size=engine.config.cache.block_size,
            max_model_len=engine.max_model_len,
            num_valid_tokens=engine.runner.num_valid_tokens,
            commit_kv=engine.config.cache.commit_cpu_kv_at_start,
            pack_weights=engine.config.pack_cpu_weights_at_start,
        )
    return NgramProposer(
        max_n=config.prompt_lookup_max, min_n=config.prompt_lookup_min, tokenizer=engine.tokenizer
    )


def _eligible(seq: Sequence) -> bool:
    """Decoding sequences (greedy or sampled) whose first token is not a reasoning model's choice to reason."""
    if seq.params is None or seq.status is not SequenceStatus.RUNNING:
        return False
    if not seq.output_token_ids or seq.num_computed_tokens < seq.num_prompt_tokens:
        return False  # not decoding yet (its prompt, or part of it, still to compute)
    return not (seq.reasoning is not None and seq.reasoning.pending)


def _active_grammar(seq: Sequence) -> Any:
    request = seq.structured
    if request is None or (seq.reasoning is not None and seq.reasoning.thinking):
        return None
    return request.grammar
