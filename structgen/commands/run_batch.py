"""`structgen run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file through the in-process server.

Each line's body goes to the very app `structgen serve` runs (`structgen.server.build_app` over an
`AsyncEngine`), over `httpx.ASGITransport`: no socket, but the same pydantic validation, limits, structured
layer and 4xx bodies, so a line answers exactly as it would over HTTP. Lines run concurrently (the engine's
continuous batching packs them into steps); results are written in input order as soon as every line before
them is done (`batch_file.py` has the line formats). Exit 0 when every line succeeded, 1 when one failed (a
line error or a non-2xx answer), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

from structgen.commands.batch_file import (
    BATCH_URLS,
    BatchRequest,
    BatchResult,
    LineError,
    error_result,
    parse_line,
    response_result,
)
from structgen.commands.engine_args import add_engine_args, engine_config, model_name, set_threads
from structgen.commands.lora_flags import lora_modules
from structgen.commands.progress import progress_bar

EXAMPLES = f"""\
examples:
  structgen run-batch -i requests.jsonl -o results.jsonl
  cat requests.jsonl | structgen run-batch -i - -o - --model tiny > results.jsonl

input lines: {{"custom_id": "...", "method": "POST", "url": URL, "body": {{...}}}} with URL one of
{", ".join(BATCH_URLS)} (blank lines are skipped); a body's "model" may name a --lora-modules adapter.
Output: one line per input line, in input order, in OpenAI's batch output format.
"""


@dataclass(slots=True)
class Summary:
    lines: int = 0
    succeeded: int = 0
    failed: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0

    def line(self) -> str:
        wall = max(self.wall_s, 1e-9)
        return (
            f"structgen run-batch: {self.lines} lines, {self.succeeded} succeeded, {self.failed} failed in "
            f"{self.wall_s:.2f} s ({self.lines / wall:.2f} requests/s, {self.output_tokens / wall:.1f} output "
            "tok/s)"
        )


def add_parser(
    sub: argparse._SubParsersAction, *, model_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    p = sub.add_parser(
        "run-batch",
        help="run an OpenAI batch file (JSONL) through the in-process server",
        description="Send every request of an OpenAI batch file to the in-process server (the same validation "
        "and answers as `structgen serve`) and write OpenAI's batch output lines, in input order.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-i", "--input", required=True, metavar="FILE", help="batch file (JSONL), or - for stdin")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="results (JSONL), or - for stdout")
    model_args(p)
    add_engine_args(p)
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="requests in flight at once (default: twice --max-num-seqs)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from structgen.engine.async_engine import AsyncEngine
    from structgen.lora import LoRAError
    from structgen.server import ServerLimits, build_app

    if args.max_concurrency is not None and args.max_concurrency < 1:
        return _fail("--max-concurrency must be at least 1")
    try:
        lines = _read_lines(args.input)
    except OSError as error:
        return _fail(f"cannot read {args.input}: {error.strerror or error}")
    # A bounded window rather than every line at once: a batch file may hold 50,000 lines, and each line in
    # flight holds its prompt, its engine request and its grammar compile, whose time limit runs from its
    # submission (a compile queued behind thousands would time out). Twice the running sequences keeps a full
    # batch of requests waiting, prompts tokenized and grammars compiled, for every slot that frees up. The
    # admission limit is the window, so run-batch never answers its own lines 429.
    window = args.max_concurrency or 2 * args.max_num_seqs
    try:
        set_threads(args)
        config = engine_config(args)
        adapters = lora_modules(args, model_name=model_name(args))
        limits = ServerLimits(max_waiting_requests=window, max_tokens_default=args.max_tokens_default)
    except ValueError as error:
        return _fail(str(error))
    try:
        out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    except OSError as error:
        return _fail(f"cannot write {args.output}: {error.strerror or error}")
    summary = Summary(lines=len(lines))
    try:
        try:
            # Built on its step thread (one OpenMP team); a line's `model` may name a --lora-modules adapter.
            engine = AsyncEngine.from_config(config, lora_modules=adapters)
        except LoRAError as error:
            return _fail(str(error))
        try:
            app = build_app(engine, engine.engine.tokenizer, model_name=model_name(args), limits=limits)
            # A non-terminal stderr (a log, a pipe) would get the final frame only: no bar there.
            with _progress(len(lines), enabled=not args.no_progress and sys.stderr.isatty()) as advance:
                writer = _OrderedWriter(out, summary, advance)
                start = time.perf_counter()
                asyncio.run(run_lines(app, lines, window=window, emit=writer))
                summary.wall_s = time.perf_counter() - start
        finally:
            engine.shutdown()
    finally:
        if out is not sys.stdout:
            out.close()
    print(summary.line(), file=sys.stderr)
    return 1 if summary.failed else 0


async def run_lines(
    app: Any, lines: Sequence[str], *, window: int, emit: Callable[[int, BatchResult], None]
) -> None:
    """Send each line's request to `app`, at most `window` at once; `emit(index, result)` as each ends."""
    import httpx

    # The app's handlers answer every error; an exception that still escapes them must become that line's 500,
    # not end the run.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
        seen_ids: set[str] = set()
        todo = iter(enumerate(lines))

        async def worker() -> None:
            # Lines are taken and parsed in input order (no await in between), so a duplicate custom id is
            # always the later line.
            for index, line in todo:
                parsed = parse_line(line, seen_ids)
                if isinstance(parsed, LineError):
                    emit(index, error_result(parsed))
                else:
                    emit(index, await _send(client, parsed))

        await asyncio.gather(*(worker() for _ in range(min(window, len(lines)))))


async def _send(client: Any, request: BatchRequest) -> BatchResult:
    try:
        response = await client.post(request.url, json=request.body)
    except Exception as error:  # the transport itself failed: the line's own error, the run goes on
        message = f"the request could not be sent: {type(error).__name__}: {error}"
        return error_result(LineError(custom_id=request.custom_id, code="internal_error", message=message))
    try:
        body = response.json()
    except ValueError:  # every route answers JSON; anything else is kept as an OpenAI error body
        from structgen.server.errors import error_body

        body = error_body(response.status_code, response.text)
    return response_result(request.custom_id, response.status_code, body)


class _OrderedWriter:
    """Writes each result once every line before it is written: the output is in input order, and a long
    run's finished prefix is on disk while the rest still runs."""

    def __init__(self, out: IO[str], summary: Summary, advance: Callable[[BatchResult], None]) -> None:
        self.out = out
        self.summary = summary
        self.advance = advance
        self.pending: dict[int, BatchResult] = {}
        self.next_index = 0

    def __call__(self, index: int, result: BatchResult) -> None:
        if result.ok:
            self.summary.succeeded += 1
        else:
            self.summary.failed += 1
        self.summary.output_tokens += result.output_tokens
        self.advance(result)
        self.pending[index] = result
        while self.next_index in self.pending:
            record = self.pending.pop(self.next_index).record
            self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.next_index += 1
        self.out.flush()


def _read_lines(path: str) -> list[str]:
    """The non-blank lines of `path` (- is stdin). Iterating a text file splits at line ends only, never at
    the U+2028 a JSON string may hold raw."""
    if path == "-":
        return [line for line in sys.stdin if line.strip()]
    with open(path, encoding="utf-8") as file:
        return [line for line in file if line.strip()]


@contextmanager
def _progress(total: int, *, enabled: bool) -> Iterator[Callable[[BatchResult], None]]:
    """done/total, failed, output tok/s, elapsed and ETA on stderr."""
    failed = tokens = 0
    with progress_bar("run-batch", total, enabled=enabled) as bar:

        def advance(result: BatchResult) -> None:
            nonlocal failed, tokens
            failed += not result.ok
            tokens += result.output_tokens
            bar(lambda elapsed: f"{failed} failed {tokens / elapsed:.0f} tok/s")

        yield advance


def _fail(message: str) -> int:
    print(f"structgen run-batch: {message}", file=sys.stderr)
    return 2
