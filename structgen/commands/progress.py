"""The progress bar the long-running commands (`validate`, `run-batch`) draw on stderr."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(
    label: str, total: int, *, enabled: bool
) -> Iterator[Callable[[Callable[[float], str]], None]]:
    """done/total, a status, elapsed time and ETA on stderr. Yields `advance(status)`: one item done, the bar's
    status text made by `status(elapsed_seconds)`. Disabled, `advance` does nothing (and rich is not imported)."""
    if not enabled:
        yield lambda status: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    start = time.monotonic()
    with Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    ) as progress:
        task = progress.add_task(label, total=total, status="")

        def advance(status: Callable[[float], str]) -> None:
            elapsed = max(time.monotonic() - start, 1e-9)
            progress.update(task, advance=1, status=status(elapsed))

        yield advance
