"""The progress bar of `LLM.generate` for long offline batches (rich, which structgen depends on anyway)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(total: int, *, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar over finished requests, showing output tokens/s; a no-op when disabled."""
    if not enabled:
        yield lambda num_tokens: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    start = time.monotonic()
    tokens = 0
    with Progress(
        TextColumn("generating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[speed]}"),
        transient=False,
    ) as progress:
        task = progress.add_task("generate", total=total, speed="")

        def advance(num_tokens: int) -> None:
            nonlocal tokens
            tokens += num_tokens
            speed = f"{tokens / max(time.monotonic() - start, 1e-9):.1f} tok/s"
            progress.update(task, advance=1, speed=speed)

        yield advance
