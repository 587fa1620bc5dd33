"""`structgen generate`: one prompt or conversation through the in-process engine, optionally constrained
(JSON Schema, a Pydantic model, regex, grammar, choice), streamed or not; says whether the output validates."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from structgen.commands.structured_flags import add_structured_flags, structured_switches
from structgen.config import LOGPROBS_MODES
from structgen.tokenizer.reasoning import REASONING_PARSERS, ReasoningParserError

EXAMPLES = """\
examples:
  structgen generate --prompt "Name a color." --choice red,green,blue
  structgen generate --prompt "Extract: Ann is 31." --json-schema person.schema.json --stream
  structgen generate --messages chat.json --pydantic myapp.models:Person
  structgen generate --model tiny --prompt "digits" --regex "[0-9]{4}" --max-tokens 8
  structgen generate --model tiny --lora-path ./sql-adapter --prompt "List the users."
  structgen generate --prompt "Capital of France?" --logprobs 3 --logprobs-mode processed_logprobs

--messages FILE holds a JSON list of chat messages ({"role": ..., "content": ...}). --pydantic imports
module:Class (the current directory is on the import path), constrains the output to its JSON Schema and
checks the output with Class.model_validate_json.
"""


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit 2."""


def add_parser(
    sub: argparse._SubParsersAction, *, model_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate text offline with the in-process engine",
        description="Generate one completion with the in-process engine, optionally constrained.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_args(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the user message (or raw prompt with --raw)")
    source.add_argument("--messages", metavar="FILE", type=Path, help="a JSON list of chat messages")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--system", default=None, help="optional system message (with --prompt)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    gen.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="also print (stderr) each generated token's logprob and its N most likely alternatives (0-20)",
    )
    gen.add_argument(
        "--logprobs-mode",
        default=None,
        choices=list(LOGPROBS_MODES),
        help="what --logprobs prints, as the server's option (default raw_logprobs)",
    )
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON Schema")
    shape.add_argument("--json-object", action="store_true", help="constrain the output to any JSON object")
    shape.add_argument("--pydantic", metavar="MODULE:CLASS", help="constrain the output to a Pydantic model")
    shape.add_argument("--regex", metavar="RX", help="constrain the output to fully match this regex")
    shape.add_argument("--choice", metavar="A,B,C", help="constrain the output to one of these strings")
    shape.add_argument("--grammar", metavar="FILE", help="constrain the output to a Lark or EBNF grammar")
    gen.add_argument("--strict", action="store_true", help="fail instead of returning an invalid output")
    gen.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="a reasoning model's <think> ... </think> goes to stderr, the answer (under any constraint) to stdout",
    )
    gen.add_argument(
        "--thinking-token-budget", type=int, default=None, metavar="N", help="reasoning tokens at most"
    )
    gen.add_argument("--backend", default="auto", choices=["auto", "llguidance", "xgrammar", "outlines"])
    gen.add_argument(
        "--lora-path", metavar="DIR", default=None, help="run with this LoRA adapter (a PEFT directory)"
    )
    gen.add_argument(
        "--max-lora-rank", type=int, default=None, help="the highest rank the adapter may have (default 16)"
    )
    add_structured_flags(gen)


def run(args: argparse.Namespace) -> int:
    from structgen import SamplingParams
    from structgen.sampling_params import MAX_LOGPROBS

    try:
        model_class = _pydantic_class(args.pydantic) if args.pydantic else None
        messages = _messages(args)
        if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
            raise UsageError(f"--logprobs takes 0 to {MAX_LOGPROBS} alternatives, got {args.logprobs}")
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop,
            structured_outputs=_structured_outputs(args, model_class),  # type: ignore[arg-type]
            thinking_token_budget=args.thinking_token_budget,
            logprobs=args.logprobs,
        )
        if args.thinking_token_budget is not None and args.reasoning_parser is None:
            raise UsageError("--thinking-token-budget needs --reasoning-parser")
        if args.logprobs_mode is not None and args.logprobs is None:
            raise UsageError("--logprobs-mode needs --logprobs")
        lora = _lora_config(args)
    except (UsageError, ValueError, OSError) as exc:
        print(f"structgen generate: {exc}", file=sys.stderr)
        return 2
    from structgen.config import CacheConfig, EngineConfig
    from structgen.engine.llm_engine import LLMEngine
    from structgen.lora import LoRARequest
    from structgen.structured import StructuredOutputConfig
    from structgen.validate.local import build_backends

    structured = StructuredOutputConfig(backend=args.backend, **structured_switches(args))
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        pack_cpu_weights_at_start=False,  # packed at the first batch the GEMV does not take, if any
        cache=CacheConfig(commit_cpu_kv_at_start=False),  # one request: a few blocks of a GiB (`CacheConfig`)
        structured=structured,
        reasoning_parser=args.reasoning_parser,
        lora=lora,
        logprobs_mode=args.logprobs_mode or "raw_logprobs",
    )
    lora_request = LoRARequest("adapter", 1, args.lora_path) if args.lora_path else None
    try:
        engine = LLMEngine(config)
    except ReasoningParserError as exc:  # the model has no <think> / </think> tokens
        print(f"structgen generate: {exc}", file=sys.stderr)
        return 2
    if params.structured_outputs is not None:
        build_backends(engine)
    tokenizer = engine.tokenizer
    if messages is None:
        prompt: Any = args.prompt
    else:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    try:
        engine.add_request("generate", prompt, params, stream=args.stream, lora_request=lora_request)
    # The prompt does not fit the context, an adapter it cannot serve (LoRAError)...
    except ValueError as exc:
        print(f"structgen generate: {exc}", file=sys.stderr)
        return 2
    completion = None
    while engine.has_unfinished():
        for out in engine.step():
            completion = out.outputs[0]
            if args.stream and completion.delta_reasoning:
                print(completion.delta_reasoning, end="", file=sys.stderr, flush=True)
            if args.stream and completion.delta_text:
                print(completion.delta_text, end="", flush=True)
    assert completion is not None
    if completion.reasoning is not None and not args.stream:
        print(completion.reasoning, file=sys.stderr)
    print("" if args.stream else completion.text)
    if completion.logprobs is not None:
        _print_logprobs(completion.logprobs, tokenizer, mode=config.logprobs_mode)
    return _report(completion, model_class)


def _print_logprobs(logprobs: list[Any], tokenizer: Any, *, mode: str) -> None:
    """One stderr line per generated token: its position, text, value and the alternatives asked for. A token the
    grammar forced (jump-forward) reads 0.0 with no alternatives: it was the only one possible."""

    from structgen.server.logprobs_body import token_text

    def text(token_id: int) -> str:
        return repr(token_text(tokenizer, token_id))

    print(f"[{mode}: position token value | alternatives]", file=sys.stderr)
    for i, entry in enumerate(logprobs):
        line = f"{i:>4} {text(entry.token_id)} {entry.logprob:.4f}"
        if entry.top_logprobs:
            line += " | " + ", ".join(f"{text(t)} {v:.4f}" for t, v in entry.top_logprobs)
        print(line, file=sys.stderr)


def _lora_config(args: argparse.Namespace) -> Any:
    """The engine's `LoRAConfig` for `--lora-path` (None without it); the directory checked before the model
    loads, the adapter's files when the request is added."""
    from structgen.config import LoRAConfig

    if args.lora_path is None:
        if args.max_lora_rank is not None:
            raise UsageError("--max-lora-rank needs --lora-path")
        return None
    if not Path(args.lora_path).expanduser().is_dir():
        raise UsageError(f"--lora-path: no LoRA adapter directory at {args.lora_path!r}")
    rank = args.max_lora_rank
    return LoRAConfig(max_loras=1) if rank is None else LoRAConfig(max_loras=1, max_lora_rank=rank)


def _messages(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """The conversation to send through the chat template, or None for a raw prompt."""
    if args.messages is None:
        if args.raw:
            return None
        messages = [{"role": "system", "content": args.system}] if args.system else []
        return [*messages, {"role": "user", "content": args.prompt}]
    if args.raw or args.system:
        raise UsageError("--raw and --system go with --prompt, not --messages")
    try:
        messages = json.loads(args.messages.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UsageError(f"{args.messages}: not valid JSON: {e.msg} (line {e.lineno})") from None
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise UsageError(f'{args.messages}: expected a non-empty JSON list of {{"role", "content"}} messages')
    return messages


def _pydantic_class(target: str) -> Any:
    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        raise UsageError(f"--pydantic takes module:Class, got {target!r}")
    # A model defined in the user's working directory: that directory is searched for the import only. Left on
    # sys.path it would hide installed packages from later imports in this process (a directory holding a
    # `kernels/` hid the package of that name that transformers imports).
    added = "" not in sys.path
    if added:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"--pydantic: cannot import {module_name}: {e}") from None
    finally:
        if added:
            sys.path.remove("")
    model_class = getattr(module, class_name, None)
    if model_class is None or not hasattr(model_class, "model_json_schema"):
        raise UsageError(f"--pydantic: {target} is not a Pydantic model class")
    return model_class


def _structured_outputs(args: argparse.Namespace, model_class: Any) -> object | None:
    from structgen.structured import StructuredOutputsParams

    strict = {"strict": args.strict}
    if model_class is not None:
        return StructuredOutputsParams(json=model_class.model_json_schema(), **strict)
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


def _report(completion: Any, model_class: Any) -> int:
    """Print how it finished and whether it validates (stderr); the exit code: 1 for a failed request."""
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
    if model_class is not None and completion.finish_reason != "error":
        from pydantic import ValidationError

        try:
            model_class.model_validate_json(completion.text)
            print(f"[pydantic {model_class.__name__}: valid]", file=sys.stderr)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(root)"
            print(f"[pydantic {model_class.__name__}: invalid at {where}: {first['msg']}]", file=sys.stderr)
    if completion.finish_reason == "error":
        print(f"structgen generate: {completion.error}", file=sys.stderr)
        return 1
    return 0
