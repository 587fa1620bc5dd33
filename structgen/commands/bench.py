"""`structgen bench NAME [ARGS...]`: run the benchmark module `structgen.bench.<name>` (its own `--help` lists
its options). Each measures its baseline in the same run, prints a table and the ratio, and takes `--json OUT`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

# name on the command line -> module in structgen.bench, and what it measures
BENCHMARKS = {
    "engine": ("engine", "engine throughput vs HF generate, KV waste, prefix caching, decode scaling"),
    "structured": (
        "structured_engine",
        "JSON Schema vs unconstrained decode, compile-cache TTFT, jump-forward; --parts s: structural shapes",
    ),
    "mask-fill": ("mask_fill", "bitmask fill per request-step vs the backend library's own call"),
    "coverage": ("structured_coverage", "JSONSchemaBench coverage of auto vs llguidance alone (minutes)"),
    "sampler": ("sampler", "the batched sampler vs torch.argmax"),
    "server": ("server", "the HTTP server under concurrent load"),
    "run-batch": ("run_batch", "structgen run-batch vs the HTTP server on the same structured requests"),
    "kernels": ("kernels", "Triton kernels vs their torch references"),
    "decode-attention": (
        "decode_attention",
        "the CPU decode-attention kernel a layer: scattered blocks vs sequential vs cache-resident",
    ),
    "prefill-attention": (
        "prefill_attention",
        "the CPU prefill-attention kernel a layer vs SDPA: prompts and chunks on cached prefixes",
    ),
    "shared-prefixes": (
        "shared_prefixes",
        "prompts sharing a prefix (lm-eval scoring, a burst with one system prompt): the prefix cache vs before",
    ),
    "startup": (
        "startup",
        "seconds to start: --help, imports, the engine, structgen serve until it answers (fresh processes)",
    ),
    "llm-thread": (
        "llm_thread",
        "an offline LLM called from a worker thread: its own step thread vs the engine stepped there (before)",
    ),
    "cpu-linears": (
        "cpu_linears",
        "a model's linear products by batch rows: each CPU kernel (int8-x, int16-x GEMV, ...) vs the dense one",
    ),
    "quality": (
        "quality",
        "teacher-forced scoring of BFCL text: each --quantization's perplexity and agreement vs the exact product",
    ),
    "gpu-engine": ("gpu_engine", "the whole engine on a GPU: backends agree, structured vs free tokens/s"),
    "tools": ("tools", "tool calling"),
    "completion": (
        "completion",
        "structured outputs that finish: budget closing and the loop guard on vs off (extraction, BFCL)",
    ),
    "peers": ("peers", "structgen vs vLLM and llama.cpp servers over HTTP, same model, one at a time"),
    "load": (
        "load",
        "200 concurrent HTTP clients with faults (disconnects, bad input): nothing lost or leaked",
    ),
    "reliability": ("reliability", "decode step time while pathological schemas arrive"),
    "tp-scaling": ("tp_scaling", "tensor-parallel throughput and communication"),
    "speculative": (
        "speculative",
        "n-gram speculative decoding off vs on: structured extraction, single stream, 8 and 32 in flight",
    ),
    "reasoning": (
        "reasoning",
        "a JSON schema after a <think> budget vs from the first token (tiny-thinking; SmolLM2 has no markers)",
    ),
    "lora": ("lora", "32 requests over 4 random LoRA adapters (rank 16, every projection) vs the base model"),
}

EPILOG = "benchmarks:\n" + "\n".join(f"  {name:<11} {what}" for name, (_, what) in BENCHMARKS.items())
EPILOG += """

examples:
  structgen bench engine throughput --model tiny --threads 2 --json engine.json
  structgen bench structured --model tiny --batch 8 --max-tokens 16
  structgen bench mask-fill --backends llguidance --repeat 5
  structgen bench engine --help      # a benchmark's own options
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help=f"run a benchmark ({', '.join(BENCHMARKS)})",
        description="Run one of the benchmarks shipped in structgen.bench; arguments after NAME go to it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", metavar="NAME", help="a benchmark name (listed below)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")


def run(args: argparse.Namespace) -> int:
    main = _load(args.name)
    if isinstance(main, str):
        print(f"structgen bench: {main}", file=sys.stderr)
        return 2
    code = main(args.args)
    return int(code or 0)


def _load(name: str) -> Callable[[list[str]], int | None] | str:
    """The benchmark's `main`, or why there is none."""
    module_name = BENCHMARKS.get(name, (name.replace("-", "_"), ""))[0]
    if not module_name.isidentifier():
        return f"unknown benchmark {name!r} (one of: {', '.join(BENCHMARKS)})"
    qualified = f"structgen.bench.{module_name}"
    try:
        module = importlib.import_module(qualified)
    except ModuleNotFoundError as e:
        if e.name != qualified:
            raise  # the benchmark exists but needs something that is not installed: show what
        if name in BENCHMARKS:
            return f"the {name!r} benchmark is not available in this build ({qualified} is missing)"
        return f"unknown benchmark {name!r} (one of: {', '.join(BENCHMARKS)})"
    main = getattr(module, "main", None)
    if not callable(main):
        return f"{qualified} has no main(argv)"
    return main
