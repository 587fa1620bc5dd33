"""`structgen` command line. Each subcommand imports the engine lazily so `--help` answers instantly."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from structgen.commands import bench as bench_command
from structgen.commands import generate as generate_command
from structgen.commands import validate as validate_command
from structgen.commands.structured_flags import add_structured_flags, structured_switches
from structgen.structured.unroll import DEFAULT_RECURSION_DEPTH

# `structgen.server.limits.DEFAULT_MAX_TOKENS` (a test keeps them equal): importing the server for `--help` would
# load FastAPI.
DEFAULT_MAX_TOKENS = 4096


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="smollm2-135m (default), tiny, or a local HF checkpoint directory / .gguf file",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto | float32 | bfloat16 | float16 (default auto: bf16 on CPUs with native bf16, else fp32)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "int4", "none"],
        help="weight-only int4 for small batches on the CPU in bf16: auto (a GGUF's own 4-bit blocks, as the "
        "default model's), int4 (also quantize HF checkpoints), none",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="structgen", description="Structured-output LLM engine and server")
    sub = parser.add_subparsers(dest="command", required=True)

    generate_command.add_parser(sub, model_args=_add_model_args)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_model_args(serve)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)"
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer K' (default: $STRUCTGEN_API_KEY)"
    )
    serve.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    serve.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for the forward (default: torch's, one per core)",
    )
    serve.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the model over N processes (one GPU each; gloo on CPU); default 1",
    )
    serve.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly instead of replaying CUDA graphs (GPU only)",
    )
    serve.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV cache size in tokens (default: sized from memory)",
    )
    serve.add_argument(
        "--structured-backend",
        default="auto",
        choices=["auto", "llguidance", "xgrammar", "outlines"],
        help="grammar backend for structured outputs",
    )
    serve.add_argument(
        "--structured-recursion-depth",
        type=int,
        default=DEFAULT_RECURSION_DEPTH,
        help="levels of each $ref cycle generated for recursive schemas no backend takes as they are "
        f"(the 'restricted' path; 0 refuses them; default {DEFAULT_RECURSION_DEPTH})",
    )
    add_structured_flags(serve)
    serve.add_argument(
        "--max-tokens-default",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="output cap of a chat request that sets neither max_tokens nor max_completion_tokens, lowered to "
        f"the context the prompt leaves (default {DEFAULT_MAX_TOKENS}; text completions keep OpenAI's 16)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="largest request body accepted, larger ones get 413 (default 16 MiB)",
    )
    serve.add_argument(
        "--max-waiting-requests",
        type=int,
        default=512,
        help="requests waiting for their first token before new ones get 429 (default 512)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM before they are aborted (default 30)",
    )
    validate_command.add_parser(sub, model_args=_add_model_args)
    bench_command.add_parser(sub)
    return parser


def _run_serve(args: argparse.Namespace) -> int:
    import logging
    import os

    import uvicorn

    from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
    from structgen.engine.async_engine import AsyncEngine
    from structgen.server import build_app
    from structgen.server.lifecycle import GracefulServer
    from structgen.server.limits import ServerLimits
    from structgen.structured import StructuredOutputConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        if args.threads < 1:
            print("structgen serve: --threads must be >= 1", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)
    try:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            device=args.device,
            tensor_parallel_size=args.tensor_parallel_size,
            enforce_eager=args.enforce_eager,
            cache=CacheConfig(kv_cache_tokens=args.kv_cache_tokens),
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs),
            structured=StructuredOutputConfig(
                backend=args.structured_backend,
                recursion_depth=args.structured_recursion_depth,
                **structured_switches(args),
            ),
        )
        limits = ServerLimits(
            max_request_bytes=args.max_request_bytes,
            max_waiting_requests=args.max_waiting_requests,
            shutdown_timeout_s=args.shutdown_timeout,
            max_tokens_default=args.max_tokens_default,
        )
    except ValueError as exc:
        print(f"structgen serve: {exc}", file=sys.stderr)
        return 2
    engine = AsyncEngine.from_config(config)  # built on its step thread: one OpenMP team
    api_key = args.api_key or os.environ.get("STRUCTGEN_API_KEY") or None
    app = build_app(
        engine,
        engine.engine.tokenizer,
        model_name=args.model or "smollm2-135m",
        api_key=api_key,
        limits=limits,
    )
    # Our middleware writes the one line per request; uvicorn's access log would repeat it. SIGTERM drains
    # the in-flight requests (GracefulServer); uvicorn's own timeout is only a backstop after that.
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=int(args.shutdown_timeout) + 10,
    )
    try:
        GracefulServer(uv_config, app.state.server.lifecycle).run()
    finally:
        engine.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    from structgen.errors import StructgenError

    try:
        if args.command == "generate":
            return generate_command.run(args)
        if args.command == "serve":
            return _run_serve(args)
        if args.command == "validate":
            return validate_command.run(args)
        if args.command == "bench":
            return bench_command.run(args)
    except StructgenError as exc:
        print(f"structgen {args.command}: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
