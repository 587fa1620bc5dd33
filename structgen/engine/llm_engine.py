"""`LLMEngine`: requests in, one batched step at a time, outputs back. `LLM` (offline batches) sits on top, in `llm.py`.

A step is: schedule (who runs, how many tokens each) → one forward over the flattened batch → sample → append
tokens and check stops → return blocks of finished sequences → outputs. Everything runs in the caller's thread;
`AsyncEngine` drives `step()` from a background thread for the server.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from structgen.config import EngineConfig
from structgen.engine.block_manager import BlockManager
from structgen.engine.inputs import PromptInput, resolve_max_model_len, resolve_max_tokens, tokenize_prompt
from structgen.engine.metrics import EngineCounters, EngineStats, engine_stats, note_scheduled
from structgen.engine.model_runner import LogitsProcessor, ModelRunner
from structgen.engine.output_processor import OutputProcessor
from structgen.engine.outputs import RequestOutput
from structgen.engine.reasoning import new_state
from structgen.engine.sampler import Sampler, fork_generator, make_generator
from structgen.engine.scheduler import Scheduler
from structgen.engine.sequence import Request, Sequence, SequenceStatus
from structgen.engine.speculative import Speculator
from structgen.engine.structured import StructuredOutputs
from structgen.sampling_params import SamplingParams
from structgen.tokenizer.reasoning import get_reasoning_parser

if TYPE_CHECKING:
    from torch import nn

    from structgen.distributed import TensorParallelGroup
    from structgen.lora.manager import LoRAManager
    from structgen.lora.request import LoRARequest
    from structgen.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        model: nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        model_dir: str | Path | None = None,
    ) -> None:
        """Load the model named by `config.model` (or use the given `model` + `tokenizer`, which must come from
        `model_dir`: tests share one loaded model between engines), size and allocate the KV cache. With
        `config.tensor_parallel_size` > 1 the engine starts its workers and loads only rank 0's shard."""
        self.tp_group: TensorParallelGroup | None = None
        try:
            self._init(config, model=model, tokenizer=tokenizer, model_dir=model_dir)
        except BaseException:
            self.shutdown()  # no worker may outlive a failed start
            raise

    def _init(
        self,
        config: EngineConfig | None,
        *,
        model: nn.Module | None,
        tokenizer: Tokenizer | None,
        model_dir: str | Path | None,
    ) -> None:
        self.config = config = config if config is not None else EngineConfig()
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if model is None or tokenizer is None:
            from structgen.engine.model_loading import load_engine_model

            model, tokenizer, model_dir = load_engine_model(
                config, self.device, on_workers=lambda group: setattr(self, "tp_group", group)
            )
        elif config.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 loads the model's shards itself: pass no model")
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.model = model
        self.tokenizer = tokenizer
        model_config = model.config  # type: ignore[attr-defined]
        self.vocab_size: int = model_config.vocab_size
        self.max_model_len = resolve_max_model_len(
            config.scheduler.max_model_len, model_limit=model_config.max_position_embeddings
        )
        sched_config = config.scheduler
        if (
            not sched_config.enable_chunked_prefill
            and sched_config.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"without chunked prefill a whole sequence must fit one step: max_num_batched_tokens "
                f"({sched_config.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model_config.eos_token_ids)
        # Refused here, before the cache is allocated, when the tokenizer lacks the parser's markers.
        self.reasoning_parser = (
            get_reasoning_parser(config.reasoning_parser, tokenizer) if config.reasoning_parser else None
        )
        dtype = next(model.parameters()).dtype
        self.lora: LoRAManager | None = None
        if config.lora is not None:
            from structgen.lora.manager import LoRAManager

            self.lora = LoRAManager(model, config.lora)  # after the kernels: it wraps them

        block_size = config.cache.block_size
        self.runner = ModelRunner(
            model,
            device=self.device,
            dtype=dtype,
            block_size=block_size,
            eos_token_ids=self.eos_token_ids,
            num_valid_tokens=min(tokenizer.vocab_size, self.vocab_size),
            sampler=Sampler(
                generator=make_generator(config.seed, self.device), logprobs_mode=config.logprobs_mode
            ),
            enforce_eager=config.enforce_eager,
        )
        self.runner.lora_step = self.lora.step if self.lora is not None else None
        if self.tp_group is not None:
            num_blocks = self.tp_group.agree_num_blocks(self.runner, config, max_model_len=self.max_model_len)
            self.runner.step_sender = self.tp_group.send_step
        else:
            num_blocks = self.runner.num_blocks_for(
                config.cache, sched_config, max_model_len=self.max_model_len
            )
        self.runner.allocate_kv_cache(num_blocks, commit=config.cache.commit_cpu_kv_at_start)
        salt = f"{self.model_dir or id(model)}:{dtype}"
        self.block_manager = BlockManager(
            num_blocks, block_size, enable_prefix_caching=config.cache.enable_prefix_caching, cache_salt=salt
        )
        self.scheduler = Scheduler(
            sched_config,
            self.block_manager,
            fork_generator=functools.partial(fork_generator, device=self.device),
            max_loras=config.lora.max_loras if config.lora is not None else None,
        )
        self.structured = StructuredOutputs(
            tokenizer, vocab_size=self.vocab_size, config=config.structured, device=self.device
        )
        self.output_processor = OutputProcessor(
            tokenizer,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            jump_forward=self.structured.jump_forward,
        )
        self.speculator = Speculator.for_engine(self) if config.speculative_config is not None else None
        # The structured-output layer installs its batched bitmask here (on the first structured request).
        self.logits_processor: LogitsProcessor | None = None
        self.counters = EngineCounters()
        self.last_step_num_tokens = 0
        self._requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        # Sequences that ended while being added (a reasoning budget of 0 forcing the end at `max_tokens`).
        self._ended_on_add: list[tuple[Sequence, SequenceStatus]] = []
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks x %d tokens, max_model_len %d, tensor parallel %d",
            self.model_dir or type(model).__name__,
            self.device,
            dtype,
            num_blocks,
            block_size,
            self.max_model_len,
            config.tensor_parallel_size,
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and the grammar threads (idempotent; the workers also
        stop at interpreter exit)."""
        if self.tp_group is not None:
            self.tp_group.shutdown()
        structured = getattr(self, "structured", None)  # absent when the start failed before it was built
        if structured is not None:
            structured.shutdown()

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence (prompt + output) the engine can ever hold: model context and whole cache."""
        return min(self.max_model_len, self.block_manager.num_blocks * self.block_manager.block_size)

    # -- requests ----------------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        stream: bool = True,
        ready: Callable[[], bool] | None = None,
        arrival_time: float | None = None,
        reasoning: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. `stream=False`: `step()` reports it only when finished. `ready`: the request waits
        (`WAITING_FOR_GRAMMAR`) until `ready()` is true, without holding up others. `reasoning=False`: no
        reasoning phase even with a reasoning parser on the engine (a raw completion: any grammar applies from the
        first token and the whole output is `text`). `lora_request`: run with that LoRA adapter (loaded from its
        path when the engine does not hold it yet; `structgen.lora.LoRAError` when it cannot be served).

        Raises ValueError for a duplicate id, an empty or out-of-vocabulary prompt, or a request that can never
        fit (prompt + max_tokens beyond the model context or the whole KV cache).
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params if params is not None else SamplingParams()
        text, token_ids = tokenize_prompt(self.tokenizer, prompt, vocab_size=self.vocab_size)
        max_tokens = resolve_max_tokens(
            len(token_ids),
            params.max_tokens,
            max_model_len=self.max_model_len,
            num_blocks=self.block_manager.num_blocks,
            block_size=self.block_manager.block_size,
        )
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs ({self.config.scheduler.max_num_seqs})")
        lora = None
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(
                    "this engine serves no LoRA adapters: start it with enable_lora / --enable-lora"
                )
            lora = self.lora.resolve(lora_request)
        request = Request(request_id, text, token_ids, params, stream=stream, arrival_time=arrival_time)
        seq = Sequence(
            next(self._seq_ids),
            token_ids,
            request_id=request_id,
            params=params,
            max_tokens=max_tokens,
            generator=make_generator(params.seed, self.device) if params.seed is not None else None,
            ready=ready,
            num_forks=params.n - 1,
        )
        seq.lora = lora
        seq.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        if self.reasoning_parser is not None and reasoning:
            seq.reasoning = new_state(
                self.reasoning_parser,
                token_ids,
                params,
                default_budget=self.config.thinking_token_budget,
                eos_token_ids=self.eos_token_ids,
            )
        if params.structured_outputs is not None:
            # Raises at once for a spec known not to compile; otherwise the compile runs in the background.
            self.structured.attach(seq, params.structured_outputs)
            if self.logits_processor is None:
                self.logits_processor = self.structured.processor
                self.logits_processor.narrow_limit = self.runner.narrow_limit  # type: ignore[union-attr]
        self.output_processor.start(seq)
        if seq.reasoning is not None and seq.structured is None:
            # (A structured request begins when its grammar is ready, `StructuredOutputs.poll`.)
            status = self.output_processor.begin(seq, incremental=stream or bool(params.stop))
            if status is not None:
                self._ended_on_add.append((seq, status))
        request.seqs.append(seq)
        self._requests[request_id] = request
        self.scheduler.add(seq)

    def abort(self, request_id: str | list[str]) -> None:
        """Stop requests now and return their blocks. Unknown (or already finished) ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            request = self._requests.pop(rid, None)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                self.structured.release(seq)
            request.metrics.finished_time = time.monotonic()
            self.counters.num_requests_aborted += 1
        self.scheduler.drop_finished()

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # -- the step ----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns the outputs of requests that progressed (streaming ones) or finished."""
        ended, self._ended_on_add = self._ended_on_add, []
        ended += self.structured.poll(self.scheduler, self.output_processor, self._requests)
        ended += self._fork_ended(ended)
        self._finish_all(ended)
        ended_seqs = [seq for seq, _ in ended]
        speculator = self.speculator
        if speculator is not None:
            speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        spec = speculator.settle(batch) if speculator is not None else {}
        self.last_step_num_tokens = batch.num_batched_tokens
        if batch.is_empty:
            return self._collect_outputs(ended_seqs)
        note_scheduled(batch, self._requests, self.counters)
        self.structured.prepare(batch.sample_seqs)
        if self.lora is not None:
            self.lora.prepare(batch.seqs, batch.num_new_tokens)
        sampled, failed = self.runner.execute(batch, logits_processor=self.logits_processor, spec=spec)
        if self.lora is not None:
            self.lora.finish_step()
        proposals = speculator.take_back(batch, spec) if spec and speculator is not None else {}
        self.scheduler.update(batch)
        self.counters.num_steps += 1
        for child in batch.forked:
            request = self._requests[child.request_id]
            incremental = request.stream or bool(request.params.stop)
            self.output_processor.start_fork(child, incremental=incremental)
            request.seqs.append(child)

        sample_seqs = batch.sample_seqs
        # Rows whose grammar raised while filling the mask: those requests fail alone, the batch goes on.
        broken = self.structured.take_failures(sample_seqs)
        if failed or broken:
            # The sampler found no possible token for these rows (e.g. a mask that allows nothing): abort them.
            for i in failed:
                logger.warning("aborting %s: no token could be sampled", sample_seqs[i])
                self.scheduler.finish(sample_seqs[i], SequenceStatus.FINISHED_ABORTED)
            for i, message in broken.items():
                if not sample_seqs[i].is_finished:
                    sample_seqs[i].error = message
                    self.scheduler.finish(sample_seqs[i], SequenceStatus.FINISHED_ERROR)
            failed_rows = set(failed) | set(broken)
            keep = [i for i in range(len(sample_seqs)) if i not in failed_rows]
            sample_seqs = [sample_seqs[i] for i in keep]
            sampled = sampled.subset(keep)
        self.counters.num_generated_tokens += len(sample_seqs)
        finished = self.output_processor.process(sample_seqs, sampled, self._requests)
        if proposals and speculator is not None:  # the picks after accepted proposals are sampled tokens too
            more, picks = speculator.verify(
                batch, proposals, self.runner.spec_logits, self._requests, finished
            )
            finished += more
            self.counters.num_generated_tokens += picks
        self._finish_all(finished)
        return self._collect_outputs(ended_seqs + batch.sample_seqs)

    def _fork_ended(
        self, ended: list[tuple[Sequence, SequenceStatus]]
    ) -> list[tuple[Sequence, SequenceStatus]]:
        """The other `n - 1` samples of requests whose grammar ended them before the prompt ever ran: they end
        the same way (the forced output is the only one possible)."""
        children = []
        for seq, status in ended:
            if seq.num_pending_forks:
                request = self._requests[seq.request_id]
                incremental = request.stream or bool(request.params.stop)
                for child in self.scheduler.fork_unscheduled(seq):
                    self.output_processor.start_fork(child, incremental=incremental)
                    child.output_text, child.stop_reason = seq.output_text, seq.stop_reason
                    child.error, child.error_code = seq.error, seq.error_code
                    request.seqs.append(child)
                    children.append((child, status))
        return children

    def _finish_all(self, ended: list[tuple[Sequence, SequenceStatus]]) -> None:
        for seq, status in ended:
            if seq.structured is not None:
                final = self.output_processor.finish_structured(seq, status)
                if final is None:  # a relaxed grammar's output failed validation: sample it again
                    self.structured.retry(seq, self.scheduler, self.output_processor, self._requests)
                    continue
                status = final
            self.scheduler.finish(seq, status)

    def _collect_outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests of `seqs` that finished, or progressed and stream."""
        outputs = []
        now = time.monotonic()
        seen: set[str] = set()
        for seq in seqs:
            request = self._requests.get(seq.request_id)
            if request is None or seq.request_id in seen:
                continue
            seen.add(seq.request_id)
            finished = request.finished
            if finished:
                request.metrics.finished_time = now
                self.counters.num_requests_finished += 1
                self.counters.finished_requests.append(request.metrics)
                del self._requests[seq.request_id]
            if finished or request.stream:
                outputs.append(self.output_processor.make_output(request))
        self.scheduler.drop_finished()
        return outputs

    # -- metrics -----------------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return engine_stats(self)
