"""Per-subset summary of a validate run, rendered as an aligned table, Markdown, or JSON.

`answered` counts schemas with at least one valid output (a schema that did not compile has none);
`finished valid` is valid / (valid + invalid): truncated and failed outputs are not finished.
`tok/s` is per request (output tokens over request latency, summed over the subset's requests).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from structgen.validate.records import SampleRecord, SchemaRecord

FORMATS = ("table", "json", "markdown")


@dataclass(slots=True)
class SubsetSummary:
    subset: str
    schemas: int = 0
    compiled: int = 0
    unsupported: int = 0
    invalid_schema: int = 0
    failed: int = 0  # compile timeouts and other errors
    top_unsupported: list[tuple[str, int]] = field(default_factory=list)
    samples: int = 0
    valid: int = 0
    invalid: int = 0
    truncated: int = 0
    errors: int = 0
    answered: int = 0
    labels_agree: int = 0
    labels_total: int = 0
    compile_p50_ms: float | None = None
    compile_p99_ms: float | None = None
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    output_tokens: int = 0
    tokens_per_s: float | None = None


def summarize(schemas: Sequence[SchemaRecord], samples: Sequence[SampleRecord]) -> list[SubsetSummary]:
    """One summary per subset (sorted), then `all`."""
    subsets = sorted({s.subset for s in schemas})
    rows = [_summarize(name, [s for s in schemas if s.subset == name], samples) for name in subsets]
    if len(rows) != 1:
        rows.append(_summarize("all", list(schemas), samples))
    return rows


def _summarize(name: str, schemas: list[SchemaRecord], all_samples: Sequence[SampleRecord]) -> SubsetSummary:
    ids = {s.id for s in schemas}
    samples = [s for s in all_samples if s.id in ids]
    status = Counter(s.status for s in schemas)
    outcome = Counter(s.status for s in samples)
    keywords = Counter(s.keyword or "?" for s in schemas if s.status == "unsupported")
    compile_ms = [s.compile_s * 1e3 for s in schemas if s.compile_s is not None]
    latencies = [s.latency_s for s in samples if s.latency_s is not None]
    timed_tokens = sum(s.tokens for s in samples if s.latency_s is not None)
    return SubsetSummary(
        subset=name,
        schemas=len(schemas),
        compiled=status["compiled"],
        unsupported=status["unsupported"],
        invalid_schema=status["invalid_schema"],
        failed=status["timeout"] + status["error"],
        top_unsupported=keywords.most_common(3),
        samples=len(samples),
        valid=outcome["valid"],
        invalid=outcome["invalid"],
        truncated=outcome["truncated"],
        errors=outcome["error"],
        answered=len({s.id for s in samples if s.status == "valid"}),
        labels_agree=sum(
            s.labels["valid_accepted"] + s.labels["invalid"] - s.labels["invalid_accepted"]
            for s in schemas
            if s.labels
        ),
        labels_total=sum(s.labels["valid"] + s.labels["invalid"] for s in schemas if s.labels),
        compile_p50_ms=_quantile(compile_ms, 0.5),
        compile_p99_ms=_quantile(compile_ms, 0.99),
        latency_p50_s=_quantile(latencies, 0.5),
        latency_p99_s=_quantile(latencies, 0.99),
        output_tokens=sum(s.tokens for s in samples),
        tokens_per_s=timed_tokens / sum(latencies) if latencies and sum(latencies) > 0 else None,
    )


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- rendering ----------------------------------------------------------------------------------------------

_COLUMNS = (
    "subset",
    "schemas",
    "compiled",
    "unsupported",
    "bad schema",
    "failed",
    "valid",
    "invalid",
    "truncated",
    "errors",
    "answered",
    "finished valid",
    "labels agree",
    "compile p50/p99 ms",
    "latency p50/p99 s",
    "tok/s",
    "top unsupported",
)


def render(rows: Sequence[SubsetSummary], fmt: str, *, footer: Iterable[str] = ()) -> str:
    if fmt == "json":
        return json.dumps({"subsets": [asdict(r) for r in rows], "notes": list(footer)}, indent=2)
    cells = [_cells(r) for r in rows]
    if fmt == "markdown":
        lines = ["| " + " | ".join(_COLUMNS) + " |", "|---|" + "---:|" * (len(_COLUMNS) - 2) + "---|"]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
    else:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(_COLUMNS)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(_COLUMNS, widths, strict=True)).rstrip()]
        lines += ["  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip() for c in cells]
    return "\n".join([*lines, *footer])


def _cells(r: SubsetSummary) -> list[str]:
    finished = r.valid + r.invalid
    return [
        r.subset,
        str(r.schemas),
        _count_pct(r.compiled, r.schemas),
        str(r.unsupported),
        str(r.invalid_schema),
        str(r.failed),
        str(r.valid),
        str(r.invalid),
        str(r.truncated),
        str(r.errors),
        _count_pct(r.answered, r.schemas),
        _pct(r.valid, finished),
        _count_pct(r.labels_agree, r.labels_total) if r.labels_total else "-",
        f"{_num(r.compile_p50_ms, 1)}/{_num(r.compile_p99_ms, 0)}",
        f"{_num(r.latency_p50_s, 2)}/{_num(r.latency_p99_s, 2)}",
        _num(r.tokens_per_s, 1),
        ", ".join(f"{k} {n}" for k, n in r.top_unsupported) or "-",
    ]


def _pct(k: int, n: int) -> str:
    return f"{100 * k / n:.1f}%" if n else "-"


def _count_pct(k: int, n: int) -> str:
    return f"{k} ({_pct(k, n)})" if n else "0"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
