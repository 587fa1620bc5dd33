"""Runs one scheduled step: batch tensors in, one sampled token per sampling sequence out.

The step's tokens are flattened into one batch (prefill chunks and decodes mixed, see `AttentionMetadata`).
Logits are computed only for the rows that sample: the last new token of each sequence whose prompt is complete
after this step. Between logits and sampling sits `logits_processor(logits, seqs)`, called once for the whole
batch: the structured-output layer applies its token bitmask there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from structgen.attention import AttentionMetadata, KVCache, allocate_kv_cache
from structgen.distributed.step_io import StepInput
from structgen.engine.block_manager import cdiv
from structgen.engine.cuda_graphs import CUDAGraphRunner, uses_triton_attention
from structgen.engine.host_memory import keep_freed_memory
from structgen.engine.narrow_logits import NARROW_LIMIT, narrow_logits, supports_narrow_logits
from structgen.engine.prompt_logprobs import prompt_spans, score_prompts, span_rows
from structgen.engine.reasoning import ban_phase_tokens
from structgen.engine.sampler import Sampler, SamplerError, SamplerOutput, SamplingRow
from structgen.engine.scheduler import SchedulerOutput
from structgen.engine.sequence import Sequence
from structgen.engine.token_mask import TokenMask

if TYPE_CHECKING:
    from torch import nn

    from structgen.config import CacheConfig, SchedulerConfig

logger = logging.getLogger(__name__)

LogitsProcessor = Callable[[torch.Tensor, list[Sequence]], "torch.Tensor | TokenMask | None"]
"""`(logits [num_sampling_seqs, vocab] float32, sampling seqs) -> logits` (or None after editing in place, or a
`TokenMask` for the sampler to apply where it changes the pick)."""


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        eos_token_ids: frozenset[int],
        num_valid_tokens: int | None = None,
        sampler: Sampler | None = None,
        enforce_eager: bool = False,
    ) -> None:
        config = model.config  # type: ignore[attr-defined]
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = model.num_local_kv_heads  # type: ignore[attr-defined]  (this rank's share)
        self.head_dim: int = config.head_dim
        self.vocab_size: int = config.vocab_size
        # Embedding rows past the tokenizer's vocabulary are padding; the model must never sample them.
        self.num_valid_tokens = num_valid_tokens if num_valid_tokens is not None else self.vocab_size
        self.sampler = sampler if sampler is not None else Sampler()
        self.prompt_logits = self.sampler.logprobs_mode.endswith("_logits")  # the *_logits modes: logits too
        self.kv_caches: list[KVCache] = []
        self.num_blocks = 0
        self._pin = device.type == "cuda"
        if device.type == "cpu":
            keep_freed_memory()  # the step's large buffers stay mapped between steps (see `host_memory`)
        # Decode steps replay CUDA graphs (CUDA + Triton attention only) unless `enforce_eager`.
        self.enforce_eager = enforce_eager
        self.cuda_graphs: CUDAGraphRunner | None = None
        # Tensor parallelism (rank 0): hands each step to the workers before the local forward runs.
        self.step_sender: Callable[[StepInput], None] | None = None
        # The last step's logits after each proposal of its speculating sequences (`execute`'s `spec`).
        self.spec_logits: dict[int, torch.Tensor] = {}
        # With LoRA adapters (`structgen.lora.layers.LoRAStep`): a step with adapter rows runs eagerly (the CUDA
        # graphs were captured without them).
        self.lora_step: Any = None
        # Sampling rows whose structured mask allows at most this many tokens get logits for those alone
        # (`narrow_logits`, CPU and one rank); 0: never. The engine hands it to its logits processor.
        lm_head = getattr(model, "lm_head", None)
        self.narrow_limit = NARROW_LIMIT if supports_narrow_logits(lm_head) else 0

    # -- KV cache ----------------------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def num_blocks_for(self, cache: CacheConfig, scheduler: SchedulerConfig, *, max_model_len: int) -> int:
        """How many blocks the pool gets: from `kv_cache_tokens`, else from what memory allows."""
        if cache.kv_cache_tokens is not None:
            return cache.kv_cache_tokens // self.block_size
        if self.device.type == "cuda":
            budget = self._profile_cuda_budget(cache.gpu_memory_utilization, scheduler)
        else:
            # Never more than all sequences at full context could use: memory beyond that is dead weight.
            budget = int(cache.cpu_kv_cache_gib * 2**30)
            cap = scheduler.max_num_seqs * cdiv(max_model_len, self.block_size) * self.bytes_per_block
            budget = min(budget, cap)
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache ({budget / 2**20:.0f} MiB available, one block needs "
                f"{self.bytes_per_block / 2**20:.2f} MiB); raise gpu_memory_utilization or set kv_cache_tokens"
            )
        return num_blocks

    def _profile_cuda_budget(self, utilization: float, scheduler: SchedulerConfig) -> int:
        """Bytes left for the KV cache after a forward of a full token budget, as vLLM measures it."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        num_tokens = scheduler.max_num_batched_tokens
        # One block of scratch cache, never written (slot -1) nor read (nothing cached before): activations only.
        scratch = allocate_kv_cache(
            num_layers=self.num_layers,
            num_blocks=1,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        metadata = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            block_tables=torch.full((1, 1), -1, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            max_query_len=num_tokens,
            max_context_len=num_tokens,
            block_size=self.block_size,
            query_lens_cpu=[num_tokens],
            context_lens_cpu=[num_tokens],
        )
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            positions = torch.arange(num_tokens, device=self.device)
            hidden = self.model(ids, positions, scratch, metadata)
            num_rows = min(scheduler.max_num_seqs, num_tokens)
            self.model.compute_logits(hidden[:num_rows])  # type: ignore[operator]
        torch.cuda.synchronize(self.device)
        peak_activations = torch.cuda.max_memory_allocated(self.device) - baseline
        del scratch, hidden, metadata
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free  # weights, the CUDA context, other processes
        budget = int(total * utilization) - used - peak_activations
        logger.info(
            "KV cache budget %.2f GiB (total %.2f GiB x %.2f, in use %.2f GiB, activations peak %.2f GiB)",
            budget / 2**30,
            total / 2**30,
            utilization,
            used / 2**30,
            peak_activations / 2**30,
        )
        return max(budget, 0)

    def allocate_kv_cache(self, num_blocks: int, *, commit: bool = True) -> None:
        self.kv_caches = allocate_kv_cache(
            commit=commit,  # (CPU: see `CacheConfig.commit_cpu_kv_at_start`)
            num_layers=self.num_layers,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.num_blocks = num_blocks
        if self.device.type == "cuda" and not self.enforce_eager and uses_triton_attention(self.model):
            self.cuda_graphs = CUDAGraphRunner(
                self.model,
                self.kv_caches,
                block_size=self.block_size,
                max_context_len=min(
                    self.model.config.max_position_embeddings,  # type: ignore[attr-defined]
                    num_blocks * self.block_size,
                ),
                device=self.device,
            )

    # -- the step ----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self,
        batch: SchedulerOutput,
        *,
        logits_processor: LogitsProcessor | None = None,
        spec: dict[int, int] | None = None,
    ) -> tuple[SamplerOutput, list[int]]:
        """Run the batch; returns the sampled tokens (one per `batch.sample_seqs`) and the indices of sampling
        rows that had no possible token (their entries are -1; the engine aborts them). `spec`: {row: k} of
        sequences whose last `k` new tokens are proposals: their sampled token is the one after the first new
        token, and `spec_logits[row]` holds the logits after each proposal (`structgen.engine.speculative`)."""
        if batch.blocks_to_copy:
            self._copy_blocks(batch.blocks_to_copy)
        input_ids, positions, metadata = self._prepare(batch.seqs, batch.num_new_tokens)
        rows = sorted(set(batch.sample_indices))
        ends = list(accumulate(metadata.query_lens_cpu))
        spec = spec or {}
        # Each sampling row's last new token (the one before the proposals, for a speculating sequence).
        index = torch.tensor(
            [ends[i] - 1 - spec.get(i, 0) for i in rows], dtype=torch.long, device=self.device
        )
        scored = prompt_spans(batch.seqs, batch.num_new_tokens)
        if self.step_sender is not None:
            prompt_rows = self._to_device(torch.tensor(span_rows(scored), dtype=torch.long))
            self.step_sender(
                StepInput(input_ids, positions, metadata, index, batch.blocks_to_copy, prompt_rows)
            )
        hidden = self._forward(input_ids, positions, metadata)
        score_prompts(
            hidden,
            scored,
            self.model.compute_logits,  # type: ignore[arg-type]
            num_valid_tokens=self.num_valid_tokens,
            as_logits=self.prompt_logits,
        )
        if not batch.sample_seqs:
            self.spec_logits = {}
            return SamplerOutput(token_ids=[]), []
        if spec:  # one product for both kinds of rows: a GEMV reads the lm_head once for all of them
            order = sorted(spec)
            extra = [p for row in order for p in range(ends[row] - spec[row], ends[row])]
            index = torch.cat([index, torch.tensor(extra, dtype=torch.long, device=self.device)])
        narrow = self._narrow_rows(logits_processor, batch) if not spec else {}
        forked = len(rows) != len(batch.sample_indices)  # forks sample from their parent's row
        if forked:
            position = {row: j for j, row in enumerate(rows)}
            pick = torch.tensor([position[i] for i in batch.sample_indices], device=self.device)
        # With narrow rows, one row of logits per sampling sequence (a fork's parent row for each of its
        # samples), so that each is narrow or whole by its own mask alone, whatever else is in the batch.
        logits = self._logits(hidden.index_select(0, index[pick] if forked and narrow else index), narrow)
        self.spec_logits = {}
        if spec:
            start = len(rows)
            for row in order:
                self.spec_logits[row] = logits[start : start + spec[row]]
                start += spec[row]
            logits = logits[: len(rows)]
        if forked and not narrow:
            logits = logits.index_select(0, pick)
        if self.num_valid_tokens < logits.shape[1]:
            logits[:, self.num_valid_tokens :] = float("-inf")
        ban_phase_tokens(logits, batch.sample_seqs)
        mask: TokenMask | None = None
        if logits_processor is not None:
            processed = logits_processor(logits, batch.sample_seqs)
            if isinstance(processed, TokenMask):
                mask = processed
            elif processed is not None:
                logits = processed
        sampling_rows = [
            SamplingRow(
                params=seq.params,  # type: ignore[arg-type]
                prompt_token_ids=seq.prompt_token_ids,
                output_token_ids=seq.output_token_ids,
                generator=seq.generator,
                eos_token_ids=self.eos_token_ids,
            )
            for seq in batch.sample_seqs
        ]
        try:
            return self.sampler(logits, sampling_rows, mask=mask), []
        except SamplerError as error:
            failed = sorted(set(error.rows))
        good = [i for i in range(len(sampling_rows)) if i not in set(failed)]
        rest = mask.subset(good) if mask is not None else None
        out = (
            self.sampler(logits[good], [sampling_rows[i] for i in good], mask=rest)
            if good
            else SamplerOutput([])
        )
        return _spread(out, good, len(sampling_rows)), failed

    def _logits(self, hidden: torch.Tensor, narrow: dict[int, torch.Tensor]) -> torch.Tensor:
        """float32 logits of the sampling rows' hidden states; rows in `narrow` only for their allowed tokens
        (`narrow_logits`: -inf elsewhere)."""
        if narrow:
            return narrow_logits(self.model.lm_head, hidden, narrow)  # type: ignore[arg-type]
        return self.model.compute_logits(hidden)  # type: ignore[operator]

    def _narrow_rows(
        self, logits_processor: LogitsProcessor | None, batch: SchedulerOutput
    ) -> dict[int, torch.Tensor]:
        """The logits processor's narrow rows ({index in `batch.sample_seqs`: allowed ids}), where the lm_head
        supports them."""
        narrow_rows = getattr(logits_processor, "narrow_rows", None)
        if narrow_rows is None or not self.narrow_limit:
            return {}
        return narrow_rows(batch.sample_seqs, self.num_valid_tokens)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        graphs = self.cuda_graphs
        # Tensor-parallel workers run their forward eagerly; rank 0 must issue the same collectives.
        lora = self.lora_step
        if (
            graphs is not None
            and self.step_sender is None
            and (lora is None or not lora.active)
            and graphs.can_run(metadata)
        ):
            return graphs.run(input_ids, positions, metadata)
        return self.model(input_ids, positions, self.kv_caches, metadata)

    @torch.inference_mode()
    def last_token_logits(self, seqs: list[Any], num_new_tokens: list[int]) -> torch.Tensor:
        """Run `num_new_tokens[i]` new tokens of each sequence (anything with `token_ids`, `num_computed_tokens`
        and a `block_table` of this runner's cache) and return the logits after each one's last [len(seqs), vocab]:
        the draft model's forward (`structgen.engine.draft_model`), which samples nothing itself."""
        input_ids, positions, metadata = self._prepare(seqs, num_new_tokens)
        hidden = self._forward(input_ids, positions, metadata)
        ends = list(accumulate(num_new_tokens))
        index = torch.tensor([end - 1 for end in ends], dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, index))  # type: ignore[operator]

    def _prepare(
        self, seqs: list[Any], query_lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        max_blocks = 0
        for seq, n in zip(seqs, query_lens, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n == 1:  # decode: the common case, kept free of numpy overhead
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                pos = np.arange(start, end)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            context_lens.append(end)
            max_blocks = max(max_blocks, len(table))
        block_tables = np.full((len(seqs), max_blocks), -1, dtype=np.int32)
        for i, seq in enumerate(seqs):
            block_tables[i, : len(seq.block_table)] = seq.block_table
        query_start = list(accumulate(query_lens, initial=0))
        metadata = AttentionMetadata(
            slot_mapping=self._to_device(torch.tensor(slots, dtype=torch.long)),
            block_tables=self._to_device(torch.from_numpy(block_tables)),
            context_lens=self._to_device(torch.tensor(context_lens, dtype=torch.int32)),
            query_start_loc=self._to_device(torch.tensor(query_start, dtype=torch.int32)),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            block_size=bs,
            query_lens_cpu=list(query_lens),
            context_lens_cpu=context_lens,
        )
        ids = self._to_device(torch.tensor(input_ids, dtype=torch.long))
        pos_t = self._to_device(torch.tensor(positions, dtype=torch.long))
        return ids, pos_t, metadata

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return tensor
        if self._pin:
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks in every layer before anything is written into them."""
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
            value_cache.index_copy_(0, dst, value_cache.index_select(0, src))


def _spread(out: SamplerOutput, rows: list[int], size: int) -> SamplerOutput:
    """`out` sampled rows `rows` of a batch of `size`; put its entries back in place (-1 / nan elsewhere)."""
    token_ids = [-1] * size
    logprobs: list[float] | None = [float("nan")] * size if out.logprobs is not None else None
    top: list[list[tuple[int, float]]] | None = (
        [[] for _ in range(size)] if out.top_logprobs is not None else None
    )
    for j, i in enumerate(rows):
        token_ids[i] = out.token_ids[j]
        if logprobs is not None and out.logprobs is not None:
            logprobs[i] = out.logprobs[j]
        if top is not None and out.top_logprobs is not None:
            top[i] = out.top_logprobs[j]
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)
