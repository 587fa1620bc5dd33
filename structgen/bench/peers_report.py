"""What `structgen bench peers` reports: each server's results, the table, and structgen's ratios to the best
peer in each column against the issue's targets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, kw_only=True)
class ServerResult:
    server: str
    status: str  # "ok", "skipped" (not installed / no model file), "failed" (did not start, or broke mid-run)
    reason: str = ""
    model_id: str | None = None
    start_s: float | None = None
    pid: int | None = None  # its process group, stopped before the next server starts
    log: str | None = None
    loadavg_before: list[float] = field(default_factory=list)
    phases: dict[str, Any] = field(default_factory=dict)  # phase -> asdict of its result

    def metric(self, key: str) -> float | None:
        """A table column's value, or None when that phase did not run."""
        phase, _, name = key.partition(".")
        value = self.phases.get(phase, {}).get(name)
        return float(value) if value is not None else None

    def clean(self, key: str) -> bool:
        """Whether the phase behind `key` ran without a failed request: a server that answered errors fast
        did not do the work, so its numbers must not set the bar."""
        errors = self.phases.get(key.partition(".")[0], {}).get("errors")
        return not errors


@dataclass(frozen=True, slots=True)
class Column:
    key: str  # "phase.field" in ServerResult.phases
    title: str
    higher_is_better: bool
    target: float | None = None  # structgen / best peer must be >= this (higher is better) or <= it


COLUMNS = (
    Column("single.tokens_per_s", "single tok/s", True, 1.0),
    Column("free.tokens_per_s", "free tok/s", True, 1.25),
    Column("structured.tokens_per_s", "json tok/s", True),
    Column("structured.wall_s", "json wall s", False, 0.8),
    Column("ttft.median_ms", "TTFT ms", False),
)


def ratios(results: list[ServerResult]) -> list[dict[str, Any]]:
    """For each column: structgen's value over the best peer's (the highest, or the lowest where lower is
    better), and whether the target holds; None where structgen or every peer lacks the number."""
    ours = next((r for r in results if r.server == "structgen" and r.status == "ok"), None)
    peers = [r for r in results if r.server != "structgen" and r.status == "ok"]
    rows = []
    for column in COLUMNS:
        mine = ours.metric(column.key) if ours else None
        theirs = [
            (value, r.server)
            for r in peers
            if (value := r.metric(column.key)) is not None and r.clean(column.key)
        ]
        pick = max if column.higher_is_better else min
        best = pick(theirs) if theirs else None
        ratio = mine / best[0] if mine is not None and best and best[0] > 0 else None
        met = None
        if ratio is not None and column.target is not None:
            met = ratio >= column.target if column.higher_is_better else ratio <= column.target
        rows.append(
            {
                "column": column.title,
                "structgen": mine,
                "best_peer": best[1] if best else None,
                "best_peer_value": best[0] if best else None,
                "ratio": round(ratio, 3) if ratio is not None else None,
                "target": None
                if column.target is None
                else f"{'>=' if column.higher_is_better else '<='} {column.target}x",
                "met": met,
            }
        )
    invalid = ours.metric("structured.invalid") if ours else None
    met = None if invalid is None else invalid == 0
    rows.append(
        dict.fromkeys(rows[0], None)
        | {"column": "json invalid", "structgen": invalid, "target": "== 0", "met": met}
    )
    return rows


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def format_table(results: list[ServerResult]) -> str:
    head = f"{'server':<10}" + "".join(f" {c.title:>12}" for c in COLUMNS) + f" {'finished/valid':>15}"
    lines = [head, "-" * len(head)]
    for r in results:
        if r.status != "ok":
            lines.append(f"{r.server:<10} {r.status}: {r.reason}")
            continue
        # "!": the phase had failed requests (counted in the JSON's "errors"), so its number is not comparable.
        cells = "".join(f" {_cell(r.metric(c.key)) + ('' if r.clean(c.key) else '!'):>12}" for c in COLUMNS)
        json_counts = "-"
        if "structured" in r.phases:
            s = r.phases["structured"]
            json_counts = f"{s['finished']}/{s['valid']}" + (f" ({s['invalid']} BAD)" if s["invalid"] else "")
            json_counts += f" {s['errors']} err" if s["errors"] else ""
        lines.append(f"{r.server:<10}{cells} {json_counts:>15}")
    return "\n".join(lines)


def format_ratios(rows: list[dict[str, Any]]) -> str:
    lines = ["structgen / best peer:"]
    for row in rows:
        if row["column"] == "json invalid":
            verdict = "-" if row["met"] is None else "met" if row["met"] else "MISSED"
            lines.append(
                f"  {'json invalid':<13} {_cell(row['structgen']):>8}   target {row['target']:<8} {verdict}"
            )
            continue
        if row["ratio"] is None:
            why = "structgen has no number" if row["structgen"] is None else "no peer ran"
            lines.append(f"  {row['column']:<13} {'n/a':>8}   ({why})")
            continue
        verdict = "" if row["met"] is None else "  met" if row["met"] else "  MISSED"
        target = f"target {row['target']}" if row["target"] else ""
        lines.append(
            f"  {row['column']:<13} {row['ratio']:>7.2f}x  vs {row['best_peer']} "
            f"({_cell(row['best_peer_value'])})  {target}{verdict}"
        )
    return "\n".join(lines)
