"""Decode step time of running requests while pathological schemas arrive, on the `tiny` model.

16 plain requests decode; in the measured phases, every `--every` steps a new pathological request (a fresh
variant, so the compile cache never helps) is added between steps, as the server's step thread would: a
schema nested 1,000 levels, 10,000 optional properties, an enum of 100,000 strings, 2,000 anyOf branches, a
20,000-character pattern, a catastrophic regex, 1,000 optional properties (no backend serves it), and
heavy-but-allowed ones (400 optional properties, an enum of 10,000). The metric is the interval from one step's start to the next (adds included), so time the
step thread spends refusing a request counts. Phases: `baseline` (no submissions), `limits` (the default
`StructuredOutputConfig`), and `no-limits` (limits raised out of reach, compile timeout `--timeout`): the
last shows what the limits save. Ratios are p99 against the baseline's p99.

    structgen bench reliability [--steps 300] [--every 10] [--timeout 5] [--skip-no-limits] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

NUM_RUNNING = 16


def _nested(depth: int, leaf: str) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "title": leaf}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _wide(n: int, tag: str) -> dict[str, Any]:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(n)}}


# name → maker(unique tag) of the structured_outputs kwargs; each call is a new spec.
PATHOLOGICAL: dict[str, Callable[[str], dict[str, Any]]] = {
    "deep-1000": lambda tag: {"json": _nested(1000, tag)},
    "wide-10000": lambda tag: {"json": _wide(10_000, tag)},
    "enum-100000": lambda tag: {"json": {"enum": [f"{tag}-{i}" for i in range(100_000)]}},
    "anyof-2000": lambda tag: {"json": {"anyOf": [{"const": f"{tag}{i}"} for i in range(2_000)]}},
    "pattern-20000": lambda tag: {"json": {"type": "string", "pattern": tag + "a" * 20_000}},
    "regex-(a+)+b": lambda tag: {"regex": f"{tag}(a+)+b"},
    "wide-1000": lambda tag: {"json": _wide(1_000, tag)},
    "wide-400 (allowed)": lambda tag: {"json": _wide(400, tag)},
    "enum-10000 (allowed)": lambda tag: {"json": {"enum": [f"{tag}-{i}" for i in range(10_000)]}},
}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="measured steps per phase")
    ap.add_argument("--every", type=int, default=10, help="steps between pathological submissions")
    ap.add_argument("--timeout", type=float, default=5.0, help="compile time limit of the no-limits phase")
    ap.add_argument("--skip-no-limits", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    if args.steps < 10 or args.every < 1:
        ap.error("--steps must be >= 10 and --every >= 1")

    import torch

    torch.set_num_threads(1)
    from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
    from structgen.engine.llm_engine import LLMEngine
    from structgen.models.loader import load_model
    from structgen.models.registry import resolve_model
    from structgen.structured import SchemaLimits, StructuredOutputConfig
    from structgen.tokenizer import Tokenizer

    model_dir = resolve_model("tiny")
    model = load_model(model_dir, dtype="float32", device="cpu")
    tokenizer = Tokenizer.from_dir(model_dir)
    unbounded = 10**9
    phases: list[tuple[str, StructuredOutputConfig, bool]] = [
        ("baseline", StructuredOutputConfig(), False),
        ("limits", StructuredOutputConfig(), True),
    ]
    if not args.skip_no_limits:
        no_limits = SchemaLimits(**{name: unbounded for name in SchemaLimits.__slots__})
        phases.append(
            ("no-limits", StructuredOutputConfig(limits=no_limits, compile_timeout_s=args.timeout), True)
        )

    rows = []
    for name, structured, submit in phases:
        config = EngineConfig(
            model="tiny",
            device="cpu",
            cache=CacheConfig(kv_cache_tokens=NUM_RUNNING * (args.steps + 64)),
            scheduler=SchedulerConfig(max_num_seqs=64),
            structured=structured,
        )
        engine = LLMEngine(config, model=model, tokenizer=tokenizer, model_dir=model_dir)
        engine.structured.ensure_manager()  # built before measuring: it reads the vocabulary once
        row = _run_phase(engine, name, args.steps, args.every if submit else 0)
        engine.structured.shutdown()
        rows.append(row)

    base_p99 = rows[0]["p99_ms"]
    print(f"{'phase':<10} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99/base':>9}  submissions")
    for row in rows:
        row["p99_ratio"] = row["p99_ms"] / base_p99
        counts = ", ".join(f"{k} {v}" for k, v in row["outcomes"].items()) or "-"
        print(
            f"{row['phase']:<10} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} {row['max_ms']:>8.2f} "
            f"{row['p99_ratio']:>8.2f}x  {counts}"
        )
    for row in rows[1:]:
        print(f"  {row['phase']}: slowest add {row['max_add_ms']:.1f} ms; per kind: {row['add_ms']}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def _run_phase(engine: Any, phase: str, steps: int, every: int) -> dict[str, Any]:
    from structgen.sampling_params import SamplingParams
    from structgen.structured import StructuredOutputsParams

    plain = SamplingParams(temperature=0.0, max_tokens=steps + 32, ignore_eos=True)
    for i in range(NUM_RUNNING):
        engine.add_request(f"run-{i}", [100 + i, 200, 300, 400, 500, 600, 700, 800], plain)
    for _ in range(5):  # prefill and warm-up, not measured
        engine.step()
    outcomes: dict[str, int] = {}
    # Parsed before the phase: in the server that happens in the HTTP handler, not on the step thread.
    pending: dict[int, tuple[str, Any]] = {}
    starts = range(0, steps, every) if every else range(0)
    for step, (kind, make) in zip(starts, itertools.cycle(PATHOLOGICAL.items()), strict=False):
        try:
            pending[step] = (kind, StructuredOutputsParams(**make(f"{phase}{step}".replace("-", ""))))
        except ValueError as error:  # InvalidSpecError: refused while parsing the request
            outcome = f"refused at parse ({type(error).__name__})"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    add_ms: dict[str, float] = {}
    submitted: list[str] = []
    intervals = []
    start = time.perf_counter()
    for step in range(steps):
        if step in pending:
            kind, structured = pending[step]
            t0 = time.perf_counter()
            outcome = _submit(engine, f"{phase}-{step}", structured, submitted)
            add_ms[kind] = round(max(add_ms.get(kind, 0.0), (time.perf_counter() - t0) * 1e3), 2)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        engine.step()
        now = time.perf_counter()
        intervals.append(now - start)
        start = now
    # What the submitted requests became (compiled and running, refused while compiling, still compiling).
    for output in engine.step():
        if output.request_id in submitted and output.outputs[0].finish_reason == "error":
            outcomes["failed in compile"] = outcomes.get("failed in compile", 0) + 1
    engine.abort([f"run-{i}" for i in range(NUM_RUNNING)] + submitted)
    ms = sorted(x * 1e3 for x in intervals)
    return {
        "phase": phase,
        "steps": steps,
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "max_ms": ms[-1],
        "outcomes": outcomes,
        "add_ms": add_ms,
        "max_add_ms": max(add_ms.values(), default=0.0),
    }


def _submit(engine: Any, request_id: str, structured: Any, out: list[str]) -> str:
    """Add one pathological request between steps, as the server's step thread would; returns what happened
    at once (a refusal already known is raised synchronously; the others fail while compiling)."""
    from structgen.sampling_params import SamplingParams

    try:
        engine.add_request(request_id, [1, 2, 3], SamplingParams(max_tokens=4, structured_outputs=structured))
    except Exception as error:  # UnsupportedSchemaError of a cached refusal, CompileBusyError
        return f"refused ({type(error).__name__})"
    out.append(request_id)
    return "accepted"
