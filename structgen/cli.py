"""`structgen` command line. Each subcommand imports the engine lazily so `--help` answers instantly."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from structgen.commands import bench as bench_command
from structgen.commands import generate as generate_command
from structgen.commands import run_batch as run_batch_command
from structgen.commands import validate as validate_command
from structgen.commands.engine_args import DEFAULT_MAX_TOKENS as DEFAULT_MAX_TOKENS
from structgen.commands.engine_args import add_engine_args, engine_config, model_name, set_threads
from structgen.commands.lora_flags import lora_modules
from structgen.config import QUANTIZATION_CHOICES

# `structgen.server.limits.DEFAULT_RESPONSES_STORE_SIZE` (a test keeps them equal): importing the server for
# `--help` would cost seconds.
DEFAULT_RESPONSES_STORE_SIZE = 1024


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="smollm2-135m (default), tiny, tiny-thinking, or a local HF checkpoint directory / .gguf file",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto | float32 | bfloat16 | float16 (default auto: bf16 on CPUs with native bf16, else fp32)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATION_CHOICES,
        help="weight-only int4 for decode batches on the CPU (bf16, or fp32 on AVX2): auto (a GGUF's own 4-bit "
        "blocks, as the default model's), int4 (also quantize HF checkpoints), w4a8 (int4, and an fp32 model's "
        "prompts with int8 activations: ~0.7x their time, +1.5%% perplexity on SmolLM2: `structgen bench quality`), "
        "none",
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
    add_engine_args(serve)
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
    serve.add_argument(
        "--responses-store-size",
        type=int,
        default=DEFAULT_RESPONSES_STORE_SIZE,
        help="responses kept in memory for GET /v1/responses/{id} and previous_response_id, least recently "
        f"used evicted first; 0 keeps none (default {DEFAULT_RESPONSES_STORE_SIZE})",
    )
    validate_command.add_parser(sub, model_args=_add_model_args)
    run_batch_command.add_parser(sub, model_args=_add_model_args)
    bench_command.add_parser(sub)
    return parser


def _run_serve(args: argparse.Namespace) -> int:
    import logging
    import os

    import uvicorn

    from structgen.engine.async_engine import AsyncEngine
    from structgen.lora import LoRAError
    from structgen.server import build_app
    from structgen.server.lifecycle import GracefulServer
    from structgen.server.limits import ServerLimits

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        set_threads(args)
        config = engine_config(args)
        adapters = lora_modules(args, model_name=model_name(args))
        limits = ServerLimits(
            max_request_bytes=args.max_request_bytes,
            max_waiting_requests=args.max_waiting_requests,
            shutdown_timeout_s=args.shutdown_timeout,
            max_tokens_default=args.max_tokens_default,
            responses_store_size=args.responses_store_size,
        )
    except ValueError as exc:
        print(f"structgen serve: {exc}", file=sys.stderr)
        return 2
    try:
        # Built on its step thread (one OpenMP team), with the --lora-modules adapters loaded there.
        engine = AsyncEngine.from_config(config, lora_modules=adapters)
    except LoRAError as exc:  # an adapter the model cannot serve: a bad flag, found once the model is loaded
        print(f"structgen serve: {exc}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("STRUCTGEN_API_KEY") or None
    app = build_app(
        engine,
        engine.engine.tokenizer,
        model_name=model_name(args),
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
        if args.command == "run-batch":
            return run_batch_command.run(args)
        if args.command == "bench":
            return bench_command.run(args)
    except StructgenError as exc:
        print(f"structgen {args.command}: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
