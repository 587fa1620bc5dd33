"""`LLM`: offline batch generation on top of `LLMEngine`, shaped like vLLM's so its users feel at home."""

from __future__ import annotations

import itertools
import sys
from typing import TYPE_CHECKING, Any

from structgen.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from structgen.engine.inputs import PromptInput
from structgen.engine.llm_engine import LLMEngine
from structgen.engine.outputs import RequestOutput
from structgen.engine.progress import progress_bar
from structgen.engine.step_thread import StepThread
from structgen.lora.request import LoRARequest
from structgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from structgen.structured import StructuredOutputConfig
    from structgen.tokenizer import Tokenizer


class LLM:
    """Offline batch generation, vLLM-style: `LLM(model="tiny").generate(prompts, SamplingParams(...))`."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        quantization: str = "auto",
        device: str | None = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        kv_cache_tokens: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        commit_cpu_kv_at_start: bool = False,
        pack_cpu_weights_at_start: bool = False,
        gpu_memory_utilization: float = 0.9,
        cpu_kv_cache_gib: float = 1.0,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_chunked_prefill: bool = True,
        structured: StructuredOutputConfig | None = None,
        reasoning_parser: str | None = None,
        thinking_token_budget: int | None = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None,
        enable_lora: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        """`reasoning_parser` ("qwen3", "deepseek_r1"): each output's `<think>` reasoning lands in `.reasoning`,
        the answer alone in `.text`, and a structured request's grammar starts after the reasoning;
        `thinking_token_budget`: the reasoning budget of requests whose SamplingParams set none.
        `speculative_config` (`{"method": "ngram", "num_speculative_tokens": 3}`, or `{"method": "draft_model",
        "model": PATH}`): speculative decoding (`structgen.engine.speculative`).
        `enable_lora`: requests may name a PEFT LoRA adapter (`lora_request=LoRARequest(name, id, path)`);
        `max_loras` of them run in one batch, each of rank <= `max_lora_rank`; `max_cpu_loras` caps how many
        are held at all (`structgen.config.LoRAConfig`).
        `commit_cpu_kv_at_start`: commit the CPU KV cache's memory before the first request, as `structgen serve`
        does, instead of as its blocks fill (`structgen.config.CacheConfig`; off here: a script's start is ~1 s
        shorter a GiB of cache on a fresh VM, for a fault a 2 MB page the first time a block lands on it).
        `pack_cpu_weights_at_start`: reorder the CPU linear layers' weights for oneDNN when the engine starts, as
        `structgen serve` does, instead of at each layer's first product on them (`EngineConfig`; off here:
        where the AVX2 GEMV takes every batch a script makes, they never are, ~0.5 s for SmolLM2).
        `logprobs_mode`: what `logprobs` hold, as vLLM's option ("raw_logprobs", "processed_logprobs",
        "raw_logits", "processed_logits"; `structgen.engine.logprobs`)."""
        config = EngineConfig(
            model=model,
            dtype=dtype,
            quantization=quantization,
            device=device,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            pack_cpu_weights_at_start=pack_cpu_weights_at_start,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_tokens=kv_cache_tokens,
                gpu_memory_utilization=gpu_memory_utilization,
                cpu_kv_cache_gib=cpu_kv_cache_gib,
                enable_prefix_caching=enable_prefix_caching,
                commit_cpu_kv_at_start=commit_cpu_kv_at_start,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=enable_chunked_prefill,
            ),
            structured=structured,
            reasoning_parser=reasoning_parser,
            thinking_token_budget=thinking_token_budget,
            speculative_config=speculative_config,
            lora=(
                LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)
                if enable_lora
                else None
            ),
            logprobs_mode=logprobs_mode,
        )
        # Built and stepped on a thread of its own, whichever thread calls (`structgen.engine.step_thread`).
        self._steps = StepThread()
        try:
            self.engine = self._steps.call(LLMEngine, config)
        except BaseException:
            self._steps.shutdown()
            raise
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (they stop at interpreter exit otherwise) and the step thread."""
        self._steps.call(self.engine.shutdown)
        self._steps.shutdown()

    def generate(
        self,
        prompts: PromptInput | list[PromptInput],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        reasoning: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished `RequestOutput` per prompt, in input order. `params` is shared or one per prompt.

        `use_tqdm` shows a progress bar (default: for 8+ prompts when stderr is a terminal). `reasoning=False`:
        no reasoning phase even with a reasoning parser (the whole output is `text` and any grammar applies from
        its first token), as the server's `/v1/completions` treats raw prompts. `lora_request`: the LoRA adapter
        of every prompt, or one per prompt (None: the base model), as vLLM takes it; needs `enable_lora`.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list: list[PromptInput] = list(prompts)  # type: ignore[arg-type]
        if isinstance(params, list):
            if len(params) != len(prompt_list):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompt_list)} prompts")
            param_list = params
        else:
            param_list = [params if params is not None else SamplingParams()] * len(prompt_list)
        loras = self._lora_requests(lora_request, len(prompt_list))
        return self._steps.call(
            self._run, prompt_list, param_list, loras, use_tqdm=use_tqdm, reasoning=reasoning
        )

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a batch of them, via the chat template.

        With `tools` (OpenAI tool definitions) the calls are grammar-enforced as `tool_choice` says (default
        "auto") and each finished output is a `ToolCompletionOutput` carrying `content` and `tool_calls`.
        `chat_template_kwargs` (vLLM's name, e.g. `{"enable_thinking": False}`) and any other keyword arguments
        are passed to the chat template; the dict wins where both name a variable. `lora_request`: as `generate`'s,
        one adapter for every conversation or one per conversation.
        """
        from structgen.tools.outputs import with_tool_calls
        from structgen.tools.plan import ToolCallPlan

        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        template_kwargs = {**template_kwargs, **(chat_template_kwargs or {})}
        tokenizer = self.engine.tokenizer
        plan = None
        if tools is not None or tool_choice is not None:
            plan = ToolCallPlan.build(
                tools,
                tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                chat_template=tokenizer.chat_template,
            )
            params = (
                [plan.sampling_params(p) for p in params]
                if isinstance(params, list)
                else plan.sampling_params(params)
            )
        prompts: list[PromptInput] = []
        for conversation in conversations:
            if plan is not None:
                conversation, tools = plan.conversation(conversation)
            text = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
            )
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        results = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        return results if plan is None else [with_tool_calls(r, plan.parse) for r in results]

    def _run(
        self,
        prompts: list[PromptInput],
        params: list[SamplingParams],
        loras: list[LoRARequest | None],
        *,
        use_tqdm: bool | None,
        reasoning: bool,
    ) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p, lora in zip(ids, prompts, params, loras, strict=True):
                engine.add_request(
                    request_id, prompt, p, stream=False, reasoning=reasoning, lora_request=lora
                )
        except Exception:
            engine.abort(ids)
            raise
        if use_tqdm is None:
            use_tqdm = len(prompts) >= 8 and sys.stderr.isatty()
        results: dict[str, RequestOutput] = {}
        with progress_bar(len(prompts), enabled=use_tqdm) as advance:
            try:
                while len(results) < len(ids):
                    if self._steps.cancelled.is_set():  # the caller was interrupted: abort below
                        raise KeyboardInterrupt
                    for out in engine.step():
                        results[out.request_id] = out
                        advance(sum(len(o.token_ids) for o in out.outputs))
                    if engine.last_step_num_tokens == 0:  # every request waits for its grammar
                        engine.structured.wait(timeout=0.05)
            except BaseException:
                engine.abort(ids)
                raise
        return [results[request_id] for request_id in ids]

    def _lora_requests(
        self, lora_request: LoRARequest | list[LoRARequest | None] | None, count: int
    ) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt; ValueError before any request is queued when they cannot run."""
        requests = lora_request if isinstance(lora_request, list) else [lora_request] * count
        if len(requests) != count:
            raise ValueError(f"got {len(requests)} LoRA requests for {count} prompts")
        for request in requests:
            if request is not None and not isinstance(request, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest or None, got {type(request).__name__}")
        if self.engine.lora is None and any(r is not None for r in requests):
            raise ValueError(
                "a lora_request needs an engine that serves LoRA adapters: create the LLM with enable_lora=True"
            )
        return requests
