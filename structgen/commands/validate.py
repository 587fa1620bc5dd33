"""`structgen validate`: a schema corpus in, per-subset validity and compile numbers out (see
`structgen.validate`). Exit 0 when every finished output validates, 1 when one does not, 2 on usage errors."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING

from structgen.commands.progress import progress_bar
from structgen.commands.structured_flags import add_structured_flags, structured_switches

if TYPE_CHECKING:
    from structgen.validate.checks import GenerationOptions
    from structgen.validate.local import LocalRunner
    from structgen.validate.remote import RemoteRunner

EXAMPLES = """\
examples:
  # 15 schemas of each JSONSchemaBench subset, SmolLM2 in-process, a report per schema and sample
  structgen validate --schemas ../shared/data/jsonschemabench --per-subset 15 --max-tokens 128 \\
      --report out.jsonl
  # one subset through a running server, 8 requests in flight
  structgen validate --schemas Github_easy.jsonl --server http://127.0.0.1:8000 --concurrency 8
  # xgrammar alone, Markdown summary; a killed run continues where it stopped
  structgen validate --schemas corpus.jsonl --backend xgrammar --format markdown \\
      --report xg.jsonl --resume

input: a JSONL file ({"id", "schema", "subset"?, "tests"?} a line; "tests" are MaskBench labels
{"data", "valid"} whose verdict the compiled grammar is checked against), a directory of .json / .jsonl
files, or one schema file. Subset: the "subset" field, else the file name (a directory's loose schema
files: the directory name).
report lines: {"kind": "sample", id, index, status valid|invalid|truncated|error, text, tokens, ...}
for each output, then {"kind": "schema", id, status compiled|unsupported|invalid_schema|timeout|error,
backend, path, keyword, compile_s, labels} once the schema is done.
"""


def add_parser(
    sub: argparse._SubParsersAction, *, model_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    p = sub.add_parser(
        "validate",
        help="generate under every schema of a corpus and validate the outputs",
        description="Generate K outputs under every JSON Schema of a corpus (in-process or through a server), "
        "validate each with jsonschema (formats checked), check compiled grammars against labelled "
        "instances, and print a summary per subset.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--schemas", required=True, type=Path, metavar="PATH", help="JSONL file, directory or schema file"
    )
    model_args(p)
    p.add_argument(
        "--server", metavar="URL", help="use a running OpenAI-compatible server instead of a local model"
    )
    p.add_argument("--api-key", default=None, help="API key for --server (default: $STRUCTGEN_API_KEY)")
    p.add_argument("--samples", type=int, default=1, metavar="K", help="outputs per schema (default 1)")
    p.add_argument("--max-tokens", type=int, default=256, help="per output (default 256)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); use > 0 with --samples"
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--prompt-template", default=None, help="the user message; {schema} is replaced by the schema's JSON"
    )
    p.add_argument(
        "--max-schema-chars", type=int, default=2000, help="cut longer schemas in the prompt (default 2000)"
    )
    p.add_argument("--backend", default="auto", choices=["auto", "llguidance", "xgrammar", "outlines"])
    add_structured_flags(p)
    p.add_argument("--compile-timeout", type=float, default=30.0, help="seconds per schema (default 30)")
    p.add_argument("--concurrency", type=int, default=16, help="schemas in flight at once (default 16)")
    p.add_argument(
        "--kv-cache-tokens", type=int, default=None, help="KV cache size (default: sized from memory)"
    )
    p.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads for the in-process model (default 2)"
    )
    p.add_argument(
        "--per-subset", type=int, default=None, metavar="N", help="N evenly spaced schemas per subset"
    )
    p.add_argument("--limit", type=int, default=None, metavar="N", help="the first N schemas only")
    p.add_argument(
        "--report", type=Path, default=None, metavar="OUT.jsonl", help="per-schema and per-sample lines"
    )
    p.add_argument(
        "--resume", action="store_true", help="keep the finished schemas of --report and run only the others"
    )
    p.add_argument("--format", default="table", choices=["table", "json", "markdown"], help="summary format")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from structgen.errors import StructgenError
    from structgen.validate import (
        CorpusError,
        SampleRecord,
        SchemaRecord,
        load_corpus,
        read_report,
        render,
        stratified,
        summarize,
    )
    from structgen.validate.checks import DEFAULT_PROMPT_TEMPLATE, GenerationOptions
    from structgen.validate.remote import ServerError

    problem = _usage_problem(args)
    if problem:
        return _fail(problem)
    try:
        cases = load_corpus(args.schemas)
    except CorpusError as e:
        return _fail(str(e))
    if args.per_subset:
        cases = stratified(cases, args.per_subset)
    if args.limit:
        cases = cases[: args.limit]
    schemas, samples = [], []
    if args.resume and args.report.exists():
        try:
            schemas, samples = read_report(args.report)
        except (OSError, ValueError) as e:
            return _fail(f"cannot resume: {e}")
        done = {s.id for s in schemas}
        print(
            f"resuming: {len(done)} schemas finished in {args.report}, {len(cases) - len(done & {c.id for c in cases})} to run",
            file=sys.stderr,
        )
        cases = [c for c in cases if c.id not in done]
    options = GenerationOptions(
        samples=args.samples,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        prompt_template=args.prompt_template or DEFAULT_PROMPT_TEMPLATE,
        max_schema_chars=args.max_schema_chars,
    )
    try:
        # Nothing left to run (a finished --resume): the summary needs no model.
        runner = _runner(args, options) if cases else None
    except (OSError, ValueError, StructgenError) as e:
        return _fail(f"cannot load the model: {e}")
    report = _open_report(args)
    start = time.monotonic()
    new_tokens = 0

    # A non-terminal stderr (a log, a pipe) would get the final frame only: no bar there.
    with _progress(len(cases), enabled=not args.no_progress and sys.stderr.isatty()) as advance:

        def emit(schema: SchemaRecord, outputs: list[SampleRecord]) -> None:
            nonlocal new_tokens
            if report is not None:
                for sample in outputs:
                    report.write(sample.to_json() + "\n")
                report.write(schema.to_json() + "\n")
                report.flush()
            schemas.append(schema)
            samples.extend(outputs)
            new_tokens += sum(s.tokens for s in outputs)
            advance(sum(s.tokens for s in outputs))

        try:
            if runner is not None:
                runner.run(cases, emit)
        except KeyboardInterrupt:
            print("structgen validate: interrupted; rerun with --resume to continue", file=sys.stderr)
            return 130
        except ServerError as e:
            return _fail(str(e))
        finally:
            if report is not None:
                report.close()
    wall = time.monotonic() - start
    footer = [
        f"{len(cases)} schemas in {wall:.1f} s ({len(cases) / max(wall, 1e-9):.2f} schemas/s, "
        f"{new_tokens / max(wall, 1e-9):.1f} output tok/s overall)"
        + (f"; {len(schemas) - len(cases)} more from the resumed report" if args.resume else "")
    ]
    print(render(summarize(schemas, samples), args.format, footer=footer))
    code = 1 if any(s.status == "invalid" for s in samples) else 0
    if getattr(runner, "abandoned_compiles", 0):
        # A compile past its time limit keeps running in native code that cannot be interrupted, and the
        # interpreter would wait for it at exit (minutes, for outlines): the results are out, so leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _usage_problem(args: argparse.Namespace) -> str | None:
    if args.server and args.model:
        return "--model and --server are exclusive"
    for name in ("samples", "max_tokens", "concurrency", "threads", "max_schema_chars"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if (args.per_subset is not None and args.per_subset < 1) or (args.limit is not None and args.limit < 1):
        return "--per-subset and --limit must be at least 1"
    if args.prompt_template is not None and "{schema}" not in args.prompt_template:
        return "--prompt-template must contain {schema}"
    if args.resume and args.report is None:
        return "--resume needs --report"
    if args.server and args.backend != "auto":
        return "--backend applies to the in-process engine; start the server with --structured-backend"
    if args.server and not all(structured_switches(args).values()):
        return (
            "--no-structured-budget-closing and --no-structured-loop-guard apply to the in-process engine; "
            "start the server with them"
        )
    return None


def _runner(args: argparse.Namespace, options: GenerationOptions) -> LocalRunner | RemoteRunner:
    if args.server:
        from structgen.validate.remote import RemoteRunner

        api_key = args.api_key or os.environ.get("STRUCTGEN_API_KEY") or None
        return RemoteRunner(args.server, options, concurrency=args.concurrency, api_key=api_key)
    import torch

    from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
    from structgen.engine.llm_engine import LLMEngine
    from structgen.structured import StructuredOutputConfig
    from structgen.validate.local import LocalRunner

    # Both cores by default; torch's own default may pick more threads than the machine gives us.
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        # One run, one batch: its pages are committed as its blocks fill (`CacheConfig`), and its weights packed
        # at the first batch the GEMV does not take (`EngineConfig`).
        pack_cpu_weights_at_start=False,
        cache=CacheConfig(kv_cache_tokens=args.kv_cache_tokens, commit_cpu_kv_at_start=False),
        scheduler=SchedulerConfig(max_num_seqs=args.concurrency * args.samples),
        structured=StructuredOutputConfig(
            backend=args.backend, compile_timeout_s=args.compile_timeout, **structured_switches(args)
        ),
    )
    return LocalRunner(LLMEngine(config), options, concurrency=args.concurrency)


def _open_report(args: argparse.Namespace) -> IO[str] | None:
    if args.report is None:
        return None
    return args.report.open("a" if args.resume else "w", encoding="utf-8")


@contextmanager
def _progress(total: int, *, enabled: bool) -> Iterator[Callable[[int], None]]:
    """done/total, schemas/s, output tok/s and ETA on stderr."""
    done = tokens = 0
    with progress_bar("validate", total, enabled=enabled) as bar:

        def advance(new_tokens: int) -> None:
            nonlocal done, tokens
            done += 1
            tokens += new_tokens
            bar(lambda elapsed: f"{done / elapsed:.2f} schemas/s {tokens / elapsed:.0f} tok/s")

        yield advance


def _fail(message: str) -> int:
    print(f"structgen validate: {message}", file=sys.stderr)
    return 2
