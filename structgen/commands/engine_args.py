"""The engine options `serve` and `run-batch` share, and what they build: both run the same app over the same
engine, so a batch file answers exactly as the server would with the same flags."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from structgen.commands.lora_flags import add_lora_flags, lora_config
from structgen.commands.structured_flags import add_structured_flags, structured_switches
from structgen.config import LOGPROBS_MODES
from structgen.structured.unroll import DEFAULT_RECURSION_DEPTH
from structgen.tokenizer.reasoning import REASONING_PARSERS

if TYPE_CHECKING:
    from structgen.config import EngineConfig

# `structgen.server.limits.DEFAULT_MAX_TOKENS` (a test keeps them equal): importing the server for `--help` would
# load FastAPI.
DEFAULT_MAX_TOKENS = 4096
DEFAULT_MODEL_NAME = "smollm2-135m"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's size, threads, parallelism, KV cache, structured-output, reasoning and LoRA options, and the
    default cap of a chat request's output (besides `--model` and its siblings, which every model command
    takes)."""
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for the forward (default: torch's, one per core)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the model over N processes (one GPU each; gloo on CPU); default 1",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly instead of replaying CUDA graphs (GPU only)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV cache size in tokens (default: sized from memory)",
    )
    parser.add_argument(
        "--cpu-kv-cache-gib",
        type=float,
        default=1.0,
        help="CPU KV cache size in GiB when --kv-cache-tokens is not given, capped at what --max-num-seqs "
        "sequences of full context can use (vLLM's VLLM_CPU_KVCACHE_SPACE); default 1",
    )
    parser.add_argument(
        "--structured-backend",
        default="auto",
        choices=["auto", "llguidance", "xgrammar", "outlines"],
        help="grammar backend for structured outputs",
    )
    parser.add_argument(
        "--structured-recursion-depth",
        type=int,
        default=DEFAULT_RECURSION_DEPTH,
        help="levels of each $ref cycle generated for recursive schemas no backend takes as they are "
        f"(the 'restricted' path; 0 refuses them; default {DEFAULT_RECURSION_DEPTH})",
    )
    add_structured_flags(parser)
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split a reasoning model's <think> ... </think> from its answer: chat reports it as "
        "message.reasoning / reasoning_content, the Responses API as a reasoning item, and a structured "
        "request's grammar applies to the answer only (the model must have the markers as tokens)",
    )
    parser.add_argument(
        "--thinking-token-budget",
        type=int,
        default=None,
        metavar="N",
        help="reasoning tokens a request may spend before </think> is forced, for requests that set no "
        "thinking_token_budget (default: unlimited; needs --reasoning-parser)",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 5, '
        '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' '
        "(greedy outputs unchanged, sampled ones keep their distribution; default: off)",
    )
    add_lora_flags(parser)
    parser.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=list(LOGPROBS_MODES),
        help="what logprobs hold, as vLLM's option: the model's own (raw_logprobs, the default; under the "
        "grammar's mask), those of the distribution sampled from after penalties, temperature and top-k/top-p/"
        "min-p (processed_logprobs), or either's logits (raw_logits, processed_logits)",
    )
    parser.add_argument(
        "--max-tokens-default",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="output cap of a chat request that sets neither max_tokens nor max_completion_tokens, lowered to "
        f"the context the prompt leaves (default {DEFAULT_MAX_TOKENS}; text completions keep OpenAI's 16)",
    )


def set_threads(args: argparse.Namespace) -> None:
    """Apply `--threads` (ValueError below 1) before the engine is built."""
    if args.threads is None:
        return
    if args.threads < 1:
        raise ValueError("--threads must be >= 1")
    import torch

    torch.set_num_threads(args.threads)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` the options describe (ValueError for a bad value)."""
    from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
    from structgen.structured import StructuredOutputConfig

    budget = args.thinking_token_budget
    if budget is not None and budget < 0:
        raise ValueError(f"--thinking-token-budget must be >= 0, got {budget}")
    if budget is not None and args.reasoning_parser is None:
        # Without a parser nothing reads the markers, so the budget would be silently ignored.
        raise ValueError(
            "--thinking-token-budget needs --reasoning-parser (it limits the reasoning it splits off)"
        )
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
        cache=CacheConfig(kv_cache_tokens=args.kv_cache_tokens, cpu_kv_cache_gib=args.cpu_kv_cache_gib),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs),
        structured=StructuredOutputConfig(
            backend=args.structured_backend,
            recursion_depth=args.structured_recursion_depth,
            **structured_switches(args),
        ),
        reasoning_parser=args.reasoning_parser,
        thinking_token_budget=budget,
        speculative_config=getattr(args, "speculative_config", None),
        lora=lora_config(args),
        logprobs_mode=args.logprobs_mode,
    )


def model_name(args: argparse.Namespace) -> str:
    """The name the app serves the model under (requests naming another get 404)."""
    return args.model or DEFAULT_MODEL_NAME
