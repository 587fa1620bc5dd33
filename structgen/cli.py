"""`structgen` command line. Each subcommand imports the engine lazily so `--help` answers instantly."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="smollm2-135m (default), tiny, or a local HF checkpoint directory / .gguf file",
    )
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="structgen", description="Structured-output LLM engine and server")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline with the in-process engine")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="the user message (or raw prompt with --raw)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--system", default=None, help="optional system message")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON Schema")
    shape.add_argument("--json-object", action="store_true", help="constrain the output to any JSON object")
    shape.add_argument("--regex", metavar="RX", help="constrain the output to fully match this regex")
    shape.add_argument("--choice", metavar="A,B,C", help="constrain the output to one of these strings")
    shape.add_argument("--grammar", metavar="FILE", help="constrain the output to a Lark or EBNF grammar")
    gen.add_argument("--strict", action="store_true", help="fail instead of returning an invalid output")

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
    return parser


def _structured_outputs(args: argparse.Namespace) -> object | None:
    from pathlib import Path

    from structgen.structured import StructuredOutputsParams

    strict = {"strict": args.strict}
    if args.json_schema:
        return StructuredOutputsParams(json=Path(args.json_schema).read_text(), **strict)
    if args.json_object:
        return StructuredOutputsParams(json_object=True, **strict)
    if args.regex:
        return StructuredOutputsParams(regex=args.regex, **strict)
    if args.choice:
        return StructuredOutputsParams(choice=[c for c in args.choice.split(",") if c], **strict)
    if args.grammar:
        return StructuredOutputsParams(grammar=Path(args.grammar).read_text(), **strict)
    return None


def _run_generate(args: argparse.Namespace) -> int:
    from structgen import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop,
            structured_outputs=_structured_outputs(args),  # type: ignore[arg-type]
        )
    except (ValueError, OSError) as exc:
        print(f"structgen generate: {exc}", file=sys.stderr)
        return 2
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device)
    if args.raw:
        outputs = llm.generate([args.prompt], params, use_tqdm=False)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        outputs = llm.chat(messages, params, use_tqdm=False)
    completion = outputs[0].outputs[0]
    print(completion.text)
    print(f"[finish_reason={completion.finish_reason} tokens={len(completion.token_ids)}]", file=sys.stderr)
    report = completion.structured
    if report is not None:
        print(
            f"[structured backend={report.backend} path={report.path} valid={report.valid} "
            f"retries={report.retries} forced_tokens={report.forced_tokens}"
            + (f" error={report.error}" if report.error else "")
            + "]",
            file=sys.stderr,
        )
    if completion.finish_reason == "error":
        print(f"structgen generate: {completion.error}", file=sys.stderr)
        return 1
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    import logging
    import os

    import uvicorn

    from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
    from structgen.engine.async_engine import AsyncEngine
    from structgen.engine.llm_engine import LLMEngine
    from structgen.server import build_app
    from structgen.structured import StructuredOutputConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            cache=CacheConfig(kv_cache_tokens=args.kv_cache_tokens),
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs),
            structured=StructuredOutputConfig(backend=args.structured_backend),
        )
    except ValueError as exc:
        print(f"structgen serve: {exc}", file=sys.stderr)
        return 2
    engine = AsyncEngine(LLMEngine(config))
    api_key = args.api_key or os.environ.get("STRUCTGEN_API_KEY") or None
    app = build_app(engine, engine.engine.tokenizer, model_name=args.model or "smollm2-135m", api_key=api_key)
    try:
        # Our middleware writes the one line per request; uvicorn's access log would repeat it.
        uvicorn.run(app, host=args.host, port=args.port, access_log=False, log_config=None)
    finally:
        engine.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    from structgen.errors import StructgenError

    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            return _run_serve(args)
    except StructgenError as exc:
        print(f"structgen {args.command}: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
