"""The draft-model proposer: a smaller checkpoint with the target's vocabulary proposes the next tokens.

Each speculating sequence has a shadow in the draft's own paged KV cache (its own pool of the engine's block
size, no prefix caching): the tokens whose keys and values the draft holds. Before a step the shadow catches up
with its sequence in one chunk (the whole prompt the first time; afterwards the tokens accepted, picked or
forced since), which gives the draft's logits after the sequence's last token; then the draft proposes greedily,
one forward a token for all speculating sequences at once. Each proposal is the draft's best token that the
sequence's grammar and reasoning phase allow after the proposals before it (its top candidates checked in order,
then, when none passes, the grammar's mask from a copy of the grammar), so a structured request never has a proposal cut for a token the draft ranked second. The KV of proposals the
target model rejects is left where it is: the next catch-up starts where the shadow and its sequence first
differ, and overwrites it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from structgen.engine.block_manager import cdiv
from structgen.engine.model_runner import ModelRunner
from structgen.engine.ngram import Allowed
from structgen.errors import StructgenError

if TYPE_CHECKING:
    from structgen.config import SpeculativeConfig
    from structgen.engine.sequence import Sequence
    from structgen.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The draft's ranked tokens tried per proposal until one passes the sequence's grammar.
CANDIDATES = 4

GrammarPick = Callable[["Sequence", list[int], torch.Tensor], "int | None"]
"""`(sequence, tokens, logits [vocab]) -> the best token its grammar allows after tokens` (None: none, or no
grammar): the fallback when none of the draft's first choices is allowed."""


class DraftModelError(StructgenError, ValueError):
    """The draft model cannot propose for this target (another vocabulary); the CLI's one-line error."""


@dataclass(slots=True)
class _Shadow:
    """A sequence as the draft's cache holds it: `token_ids[:num_computed_tokens]` have KV in `block_table`."""

    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)


class DraftModelProposer:
    @classmethod
    def load(
        cls,
        config: SpeculativeConfig,
        *,
        target: torch.nn.Module,
        target_dir: object,
        target_tokenizer: Tokenizer,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        num_valid_tokens: int,
        commit_kv: bool = True,
        pack_weights: bool = True,
    ) -> DraftModelProposer:
        """Load `config.model` (the target's own model object when it names the same checkpoint) with the
        target's dtype and check that it shares the target's vocabulary. `commit_kv` and `pack_weights`: as the
        target's (`CacheConfig.commit_cpu_kv_at_start`, `EngineConfig.pack_cpu_weights_at_start`)."""
        from structgen.engine.model_loading import load_draft_model
        from structgen.models.registry import resolve_model

        assert config.model is not None  # SpeculativeConfig checks it
        dtype = next(target.parameters()).dtype
        if (
            target_dir is not None
            and resolve_model(config.model) == target_dir
            and config.quantization == "auto"
        ):
            model, tokenizer = target, target_tokenizer  # the target drafts for itself: no second copy
        else:
            model, tokenizer, _ = load_draft_model(
                config.model,
                dtype=dtype,
                device=device,
                quantization=config.quantization,
                pack_weights=pack_weights,
            )
        _check_vocabulary(tokenizer, target_tokenizer, draft_name=config.model)
        # Room for `max_batch_size` sequences at full length, plus the proposals of a step.
        per_seq = cdiv(max_model_len + config.num_speculative_tokens + 1, block_size)
        return cls(
            model,
            device=device,
            dtype=dtype,
            block_size=block_size,
            num_blocks=config.max_batch_size * per_seq,
            num_valid_tokens=num_valid_tokens,
            commit_kv=commit_kv,
        )

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
        num_valid_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        commit_kv: bool = True,
    ) -> None:
        draft_vocab = model.config.vocab_size  # type: ignore[attr-defined]
        self.runner = ModelRunner(
            model,
            device=device,
            dtype=dtype,
            block_size=block_size,
            eos_token_ids=eos_token_ids,
            num_valid_tokens=min(num_valid_tokens, draft_vocab),
            enforce_eager=True,
        )
        self.runner.allocate_kv_cache(num_blocks, commit=commit_kv)  # as the target's (`CacheConfig`)
        self.num_valid_tokens = min(num_valid_tokens, draft_vocab)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._shadows: dict[int, _Shadow] = {}
        self.num_forwards = 0  # the draft's forward passes (catch-ups and proposals)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return len(self._shadows)

    def retain(self, live_seq_ids: set[int]) -> None:
        """Return the blocks of shadows whose sequences no longer run."""
        for seq_id in [i for i in self._shadows if i not in live_seq_ids]:
            self._release(seq_id)

    def propose(
        self, wanted: list[tuple[Sequence, int]], allowed: Allowed, grammar_pick: GrammarPick
    ) -> dict[int, list[int]]:
        """{seq_id: up to k proposals} for each `(sequence, k)`; sequences the pool has no room for get none."""
        shadows: list[_Shadow] = []
        seqs: list[Sequence] = []
        num_new: list[int] = []
        for seq, k in wanted:
            shadow = self._catch_up(seq, k)
            if shadow is not None:
                shadows.append(shadow)
                seqs.append(seq)
                num_new.append(len(shadow.token_ids) - shadow.num_computed_tokens)
        if not shadows:
            return {}
        logits = self._forward(shadows, num_new)
        budgets = {seq.seq_id: k for seq, k in wanted}
        proposals: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
        active = list(range(len(seqs)))
        while active:
            ranked = torch.topk(logits[:, : self.num_valid_tokens], CANDIDATES, dim=-1).indices.tolist()
            going: list[int] = []
            for j, i in enumerate(active):
                seq, tokens = seqs[i], proposals[seqs[i].seq_id]
                token = _best_allowed(seq, tokens, ranked[j], allowed)
                if token is None:  # none of its first choices: its best under the grammar's mask
                    token = grammar_pick(seq, tokens, logits[j, : self.num_valid_tokens])
                if token is None:
                    continue
                tokens.append(token)
                if len(tokens) < budgets[seq.seq_id]:
                    going.append(i)
            active = going
            if active:  # the proposals just made, through the draft, for the logits after them
                for i in active:
                    shadows[i].token_ids.append(proposals[seqs[i].seq_id][-1])
                logits = self._forward([shadows[i] for i in active], [1] * len(active))
        return {seq_id: tokens for seq_id, tokens in proposals.items() if tokens}

    # -- helpers -----------------------------------------------------------------------------------------------

    def _catch_up(self, seq: Sequence, k: int) -> _Shadow | None:
        """The sequence's shadow with its tokens set to the sequence's and KV kept up to where they first differ,
        blocks for them and `k - 1` proposals; None (and nothing held) when the pool has no room."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self._shadows[seq.seq_id] = _Shadow()
        tokens = seq.token_ids
        # Never the whole sequence: the last token goes through the draft for the logits after it.
        kept = _common_prefix(shadow.token_ids, shadow.num_computed_tokens, tokens, limit=len(tokens) - 1)
        del shadow.token_ids[kept:]  # (the usual case: the rejected proposals' tail) then what is new since
        shadow.token_ids.extend(tokens[kept:])
        shadow.num_computed_tokens = kept
        needed = cdiv(len(tokens) + k - 1, self.runner.block_size) - len(shadow.block_table)
        if needed > len(self._free):
            self._release(seq.seq_id)
            return None
        for _ in range(needed):
            shadow.block_table.append(self._free.pop())
        return shadow

    def _forward(self, shadows: list[_Shadow], num_new: list[int]) -> torch.Tensor:
        logits = self.runner.last_token_logits(shadows, num_new)
        self.num_forwards += 1
        for shadow in shadows:
            shadow.num_computed_tokens = len(shadow.token_ids)
        return logits

    def _release(self, seq_id: int) -> None:
        shadow = self._shadows.pop(seq_id)
        self._free.extend(reversed(shadow.block_table))


def _common_prefix(held: list[int], num_held: int, tokens: list[int], *, limit: int) -> int:
    """How many leading tokens of `tokens` equal the first `num_held` of `held` (at most `limit`)."""
    n = min(num_held, limit)
    if held[:n] == tokens[:n]:  # the usual case: only proposals past the shadow's tokens were rejected
        return n
    lo, hi = 0, n  # held[:lo] == tokens[:lo], held[:hi] != tokens[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if held[:mid] == tokens[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _best_allowed(seq: Sequence, tokens: list[int], ranked: list[int], allowed: Allowed) -> int | None:
    for token in ranked:
        if len(allowed(seq, [*tokens, token])) == len(tokens) + 1:
            return token
    return None


def _check_vocabulary(draft: Tokenizer, target: Tokenizer, *, draft_name: str) -> None:
    """A draft proposes token ids: they must mean the same text to the target."""
    if draft is target:
        return
    if draft.vocab_size != target.vocab_size or draft.backend.get_vocab() != target.backend.get_vocab():
        raise DraftModelError(
            f"draft model {draft_name!r} has another vocabulary than the target model ({draft.vocab_size} vs "
            f"{target.vocab_size} tokens, or other tokens under the same ids): a draft must share the target's "
            "tokenizer"
        )
