"""Engine configuration: what the KV cache, the scheduler and the engine as a whole are allowed to do.

Every knob has a default that works on a laptop CPU; `LLM(...)` and `structgen serve` flags map onto these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from structgen.structured.manager import StructuredOutputConfig

# Weight quantization on the CPU (`structgen.models.cpu_linear.attach_int4`): "auto" (a GGUF's own 4-bit blocks),
# "int4" (also HF checkpoints), "w4a8" ("int4", and an fp32 model's prompt chunks with int8 activations), "none".
QUANTIZATION_CHOICES = ("auto", "int4", "w4a8", "none")
# What logprobs hold (`structgen.engine.logprobs`), vLLM's `logprobs_mode` values.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def check_logprobs_mode(mode: str) -> str:
    """`mode` if it is one of `LOGPROBS_MODES`, else ValueError."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}; got {mode!r}")
    return mode


@dataclass(slots=True, kw_only=True)
class CacheConfig:
    """The paged KV cache.

    The pool holds `kv_cache_tokens // block_size` blocks when `kv_cache_tokens` is given. Otherwise it is sized
    from memory: on CUDA, `gpu_memory_utilization` of the device minus what a profiling forward used; on CPU,
    `cpu_kv_cache_gib` GiB (capped at what `max_num_seqs` sequences of full context could ever use).

    `commit_cpu_kv_at_start`: a CPU cache's memory is committed (written) when the engine starts, so a cache that
    does not fit fails then, and serving never waits on a first touch: what `structgen serve` does. False
    commits each page as the cache first writes to it: one-shot runs (`LLM`, `structgen generate` and
    `validate`) start faster by what committing the whole cache costs (~0.6-2.9 s a GiB on a fresh VM) and
    commit only the blocks they fill.
    """

    block_size: int = 16
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    commit_cpu_kv_at_start: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens must hold at least one block of {self.block_size} tokens, "
                f"got {self.kv_cache_tokens}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")


# The most tokens one step may propose for a sequence: with the token it verifies after, at most 16 new tokens on
# a cached context, which the CPU attention runs as decode rows.
MAX_SPECULATIVE_TOKENS = 15
SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(slots=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's terms (`--speculative-config '{"method": "ngram", ...}'`).

    `ngram`: prompt lookup, proposing up to `num_speculative_tokens` tokens: what follows the output's recent
    text in the prompt's text (`structgen.engine.text_lookup`), else what followed the longest suffix n-gram
    (`prompt_lookup_min`..`prompt_lookup_max` tokens) seen earlier in the sequence (`structgen.engine.ngram`).
    `draft_model`: a smaller checkpoint `model` (a name or path, as the engine's own model; `quantization` as
    the engine's) with the target's vocabulary proposes them, greedily under the request's grammar, with its own
    paged KV cache (`structgen.engine.draft_model`); `{"model": PATH}` alone means this method, as in vLLM.
    The target model verifies every proposal: greedy outputs are those without speculation, sampled ones keep
    their distribution (`structgen.engine.speculative`).
    Speculation stays off in a step with more than `max_batch_size` sequences decoding, where the extra rows
    would cost the batch more than the saved steps give back (on 2 CPU cores: see BENCHMARKS.md).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    max_batch_size: int = 1
    model: str | None = None  # draft_model: the draft checkpoint
    quantization: str = "auto"  # draft_model: the draft's weights (auto, int4, w4a8, none), as EngineConfig's

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported; supported: {', '.join(SPECULATIVE_METHODS)}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError(
                'speculative method "draft_model" needs "model": the draft checkpoint (name or path)'
            )
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f'"model" is the draft_model method\'s draft; method {self.method!r} takes none')
        if self.quantization not in QUANTIZATION_CHOICES:
            choices = ", ".join(QUANTIZATION_CHOICES)
            raise ValueError(f"quantization must be one of {choices}; got {self.quantization!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, object] | str) -> SpeculativeConfig:
        """From a config, a dict or a JSON object's text (the CLI flag); ValueError naming what is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        if "model" in value and "method" not in value:  # vLLM: a draft model given alone is the method
            value = {**value, "method": "draft_model"}
        return cls(**value)  # type: ignore[arg-type]


@dataclass(slots=True, kw_only=True)
class LoRAConfig:
    """Serving LoRA adapters (`structgen.lora`), in vLLM's terms.

    `max_loras` adapters sit in the model's slots at once, and one step carries rows of all of them and of the
    base model; registered adapters beyond that keep a CPU copy and are swapped in (least recently used out)
    when a request needs them. `max_lora_rank` bounds every module's rank (the slots are that wide).
    `max_cpu_loras` caps how many adapters are registered at all (None: no cap).
    """

    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


@dataclass(slots=True, kw_only=True)
class SchedulerConfig:
    """Per-step limits of the continuous-batching scheduler.

    `max_num_batched_tokens` is the token budget of one forward (decodes count one token each; prefills take
    what is left, in chunks when `enable_chunked_prefill`). `max_model_len` defaults to the model's context.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    """Everything `LLMEngine` needs: which model, on what device, and the cache and scheduler settings.

    `model` is a registry name ("smollm2-135m", "tiny"), a local HF checkpoint directory or a GGUF file; None
    means the embedded default. `dtype` is a name the loader knows ("float32", "bfloat16", "float16", "auto").
    `device` None picks CUDA when available, else CPU. `seed` seeds the generator that requests without their
    own `seed` sample from. `tensor_parallel_size` N > 1 shards the model over N processes (this one and N - 1
    workers; one GPU each on CUDA, gloo on CPU), see `structgen.distributed`. `enforce_eager` turns off the
    CUDA graphs that decode steps replay on a GPU with the Triton attention backend (the default there;
    `STRUCTGEN_ATTENTION_BACKEND=torch|triton` overrides the backend).
    """

    model: str | None = None
    dtype: str = "auto"
    # Weight-only int4 for decode batches on the CPU (bf16, or fp32 on AVX2): "auto" reads a GGUF's own 4-bit
    # blocks (the default model's), "int4" also quantizes HF checkpoints, "w4a8" adds int8 activations for an fp32
    # model's prompt chunks (faster prompts; +1.5% perplexity on SmolLM2 against the exact product, where the
    # default's kernels are within 0.0004 nats a token: `structgen bench quality`), "none" turns it off. See
    # structgen.models.cpu_linear.
    quantization: str = "auto"
    device: str | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    # CPU: reorder the linear layers' weights for oneDNN's packed products at start, as `structgen serve` does, so
    # no request waits on it. False reorders each at its first product: one-shot runs (`LLM`, `structgen generate`
    # and `validate`), whose batches the AVX2 GEMV mostly takes, skip it (~0.5 s and the weights' size in memory
    # for SmolLM2 on a 2-core AVX2 host; `cpu_linear.PackedLinear`), as `CacheConfig.commit_cpu_kv_at_start`.
    pack_cpu_weights_at_start: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # The structured-output layer (backend, compile limit, workers...); None → `StructuredOutputConfig()`.
    structured: StructuredOutputConfig | None = None
    # A reasoning parser's name (`structgen.tokenizer.reasoning`: "qwen3", "deepseek_r1"): outputs are split into
    # reasoning and answer, and a structured request's grammar starts after the reasoning. None: no reasoning.
    reasoning_parser: str | None = None
    # The reasoning budget of requests that set none (`SamplingParams.thinking_token_budget`); None: unlimited.
    thinking_token_budget: int | None = None
    # Speculative decoding (`SpeculativeConfig`, or its dict / JSON text); None: off.
    speculative_config: SpeculativeConfig | dict[str, object] | str | None = None
    # LoRA adapters served beside the base model (`structgen.lora`); None: requests cannot name an adapter.
    lora: LoRAConfig | None = None
    # What logprobs hold, as vLLM's option: "raw_logprobs" (the model's, under the grammar's mask),
    # "processed_logprobs" (of the distribution sampled from: after penalties, temperature, top-k/top-p/min-p),
    # or either's "*_logits" (not normalized). See structgen.engine.logprobs.
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.thinking_token_budget is not None and (
            not isinstance(self.thinking_token_budget, int) or self.thinking_token_budget < 0
        ):
            raise ValueError(
                f"thinking_token_budget must be >= 0 or None, got {self.thinking_token_budget!r}"
            )
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
            if self.tensor_parallel_size > 1:
                raise ValueError("speculative decoding does not run with tensor_parallel_size > 1 yet")
        if self.lora is not None and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not served with tensor_parallel_size > 1 yet")
        check_logprobs_mode(self.logprobs_mode)
        if self.quantization not in QUANTIZATION_CHOICES:
            choices = ", ".join(QUANTIZATION_CHOICES)
            raise ValueError(f"quantization must be one of {choices}; got {self.quantization!r}")
