"""Structured output inside the engine, measured as ratios within one run (the CPU is shared).

(a) decode throughput with a JSON Schema on every one of `--batch` concurrent requests vs the same requests
    unconstrained (sampled tokens per second of decode steps; jump-forward off so only the mask costs). The
    schema's string has a `minLength` beyond `--max-tokens` and both sides ignore EOS, so every request
    decodes exactly `--max-tokens` tokens on both sides: same batch shapes, the mask is the only difference.
    The two engines step alternately and each side sums its own step times, so CPU drift hits both alike;
(c) time to first token of a request whose schema was never seen (compile in WAITING_FOR_GRAMMAR) vs one
    whose schema is in the compile cache;
(d) share of output tokens produced by jump-forward on JSONSchemaBench schemas (a few per subset);
(s) structural shapes (arrays of small objects, nested objects, enums, optional members and anyOf, and (a)'s
    long string), JSON Schema vs unconstrained, closed loop at `--concurrency` requests per side, jump-forward
    on; ratios counting sampled tokens only and with forced ones, optionally a per-phase breakdown of the step
    and the same through the HTTP server (see `structured_shapes`; not in the default parts).

    structgen bench structured --model tiny [--repeats N] [--parts a,c,d] [--json OUT]
    structgen bench structured                  # the default SmolLM2-135M
    structgen bench structured --parts s [--shapes items,enums] [--breakdown] [--http] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from structgen.bench import shared_data

DATA = shared_data()
# Part (s)'s shapes (`structured_shape_schemas.SHAPES`; named here so that --help does not import the engine).
SHAPE_NAMES = ("items", "nested", "enums", "optional_anyof", "in_string")
# Every request decodes to max_tokens under it: the string cannot close earlier.
LONG_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 2000}},
    "required": ["text"],
}
# Free-form enough that a model keeps decoding until max_tokens: the mask changes every step.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "notes": {"type": "string"},
    },
    "required": ["title", "tags", "notes"],
    "additionalProperties": False,
}


def make_engine(
    model: str | None, *, jump_forward: bool = True, max_num_seqs: int = 64, kv_cache_tokens: int = 32768
) -> Any:
    from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
    from structgen.engine.llm_engine import LLMEngine
    from structgen.structured import StructuredOutputConfig

    config = EngineConfig(
        model=model,
        device="cpu",
        cache=CacheConfig(kv_cache_tokens=kv_cache_tokens),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096),
        structured=StructuredOutputConfig(jump_forward=jump_forward),
    )
    return LLMEngine(config)


def params(
    max_tokens: int,
    *,
    seed: int | None,
    schema: Any = None,
    ignore_eos: bool = False,
    temperature: float = 1.0,
) -> Any:
    from structgen.sampling_params import SamplingParams
    from structgen.structured import StructuredOutputsParams

    so = StructuredOutputsParams(json=schema) if schema is not None else None
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        structured_outputs=so,
    )


def drain(engine: Any) -> dict[str, Any]:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if engine.last_step_num_tokens == 0:
            time.sleep(0.001)
    return done


def throughput(model: str | None, batch: int, max_tokens: int, schema: Any) -> tuple[float, float]:
    """Sampled tokens/s of decode steps (unconstrained, constrained). The two engines step alternately, so
    drift of the shared CPU hits both sides alike; each side's time is the sum of its own steps."""
    engines = [make_engine(model, jump_forward=False) for _ in range(2)]
    engines[1].structured.ensure_manager().compile(
        params(1, seed=0, schema=schema).structured_outputs.to_spec()
    )
    for engine, constrained in zip(engines, (None, schema), strict=True):
        for i in range(batch):
            p = params(max_tokens, seed=i, schema=constrained, ignore_eos=True)
            engine.add_request(f"t{i}", f"Item {i}: describe a book as JSON.", p)
        while engine.counters.num_steps == 0:  # the prefill (all prompts fit one step)
            engine.step()
    start_tokens = [e.counters.num_generated_tokens for e in engines]
    elapsed = [0.0, 0.0]
    while any(e.has_unfinished() for e in engines):
        for side, engine in enumerate(engines):
            if engine.has_unfinished():
                t0 = time.perf_counter()
                engine.step()
                elapsed[side] += time.perf_counter() - t0
    plain, constrained = (
        (e.counters.num_generated_tokens - n) / t
        for e, n, t in zip(engines, start_tokens, elapsed, strict=True)
    )
    return plain, constrained


def ttft(engine: Any, repeats: int) -> tuple[float, float]:
    """Median TTFT (s) with a never-seen schema vs the same schema again (compile cache hit)."""
    cold, warm = [], []
    for r in range(repeats):
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"][f"field_{r}_{time.time_ns()}"] = {"type": "integer"}
        for bucket, rid in ((cold, f"cold{r}"), (warm, f"warm{r}")):
            engine.add_request(rid, "Describe a book as JSON.", params(24, seed=r, schema=schema))
            out = drain(engine)[rid]
            bucket.append(out.metrics.ttft)
    return statistics.median(cold), statistics.median(warm)


def bench_schemas(per_subset: int) -> list[tuple[str, Any]]:
    picked = []
    for path in sorted((DATA / "jsonschemabench").glob("*.jsonl")):
        with path.open() as f:
            for _, line in zip(range(per_subset), f, strict=False):
                picked.append((path.stem, json.loads(line)["schema"]))
    return picked


def jump_share(engine: Any, per_subset: int, max_tokens: int) -> dict[str, Any]:
    from structgen.structured import StructuredOutputError

    ids = []
    for i, (subset, schema) in enumerate(bench_schemas(per_subset)):
        try:
            engine.add_request(
                f"j{i}", "Reply with a JSON example.", params(max_tokens, seed=i, schema=schema)
            )
            ids.append((f"j{i}", subset))
        except StructuredOutputError:
            pass
    done = drain(engine)
    outs = [done[rid].outputs[0] for rid, _ in ids]
    total = sum(len(o.token_ids) for o in outs)
    forced = sum(o.structured.forced_tokens for o in outs if o.structured is not None)
    served = [o for o in outs if o.finish_reason != "error"]
    return {
        "requests": len(ids),
        "served": len(served),
        "finished_stop": sum(o.finish_reason == "stop" for o in outs),
        "valid_of_stopped": sum(
            bool(o.structured and o.structured.valid) for o in outs if o.finish_reason == "stop"
        ),
        "tokens": total,
        "forced": forced,
        "share": forced / total if total else 0.0,
        "steps": engine.counters.num_steps,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="registry name (tiny) or None for the default SmolLM2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--max-tokens", type=int, default=None, help="per request (default: 32 for a and d, 256 for s)"
    )
    ap.add_argument("--ttft-repeats", type=int, default=3)
    ap.add_argument("--per-subset", type=int, default=2)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's, one per core, as `structgen serve` runs)",
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="measure (a) this many times; the median is the result"
    )
    ap.add_argument("--parts", default="a,c,d", help="which of a, c, d, s to run (comma-separated)")
    s = ap.add_argument_group("part s (structural shapes)")
    s.add_argument("--shapes", default=",".join(SHAPE_NAMES), help="comma-separated, of: %(default)s")
    s.add_argument(
        "--concurrency", type=int, default=32, help="requests in flight per side (default %(default)s)"
    )
    s.add_argument(
        "--steps",
        type=int,
        default=200,
        help="measured decode steps per side, in process (default %(default)s; 0: only --http)",
    )
    s.add_argument(
        "--breakdown", action="store_true", help="also time each phase of the step (a second pass)"
    )
    s.add_argument("--http", action="store_true", help="also measure through the OpenAI server")
    s.add_argument(
        "--http-steps",
        type=int,
        default=100,
        help="HTTP: measured engine steps per side per pass, closed loop (default %(default)s)",
    )
    s.add_argument(
        "--passes", type=int, default=3, help="HTTP passes, the sides alternating (default %(default)s)"
    )
    s.add_argument(
        "--no-settle",
        dest="settle",
        action="store_false",
        help="count from 5 steps after the first prefill, the constrained side's first wave not staggered (the "
        "measure before session 27), instead of after max_tokens more steps, in the steady state",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    max_tokens = args.max_tokens if args.max_tokens is not None else 32
    unknown = set(args.shapes.split(",")) - set(SHAPE_NAMES) - {""}
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(sorted(unknown))} (one of: {', '.join(SHAPE_NAMES)})")

    from structgen.commands.engine_args import set_threads

    # Until session 21 this defaulted to 1: every ratio of this benchmark before then was measured on one
    # thread, while the server steps on one per core (BENCHMARKS.md, "(s) Session 21").
    try:
        set_threads(args)  # as serve applies it: torch's default when not given
    except ValueError as error:
        ap.error(str(error))
    result: dict[str, Any] = {"model": args.model or "smollm2-135m (default)"}
    parts = set(args.parts.split(","))
    if "a" in parts:
        runs = [throughput(args.model, args.batch, max_tokens, LONG_SCHEMA) for _ in range(args.repeats)]
        ratios = [constrained / plain for plain, constrained in runs]
        plain, constrained = runs[ratios.index(statistics.median_low(ratios))]
        result["a_throughput"] = {
            "unconstrained_tok_s": round(plain, 1),
            "json_schema_tok_s": round(constrained, 1),
            "ratio": round(constrained / plain, 3),
            "ratio_per_run": [round(r, 3) for r in ratios],
        }
    if "c" in parts:
        cold, warm = ttft(make_engine(args.model), args.ttft_repeats)
        result["c_ttft"] = {
            "never_seen_s": round(cold, 3),
            "cached_s": round(warm, 3),
            "ratio": round(cold / warm, 2),
        }
    if "d" in parts:
        result["d_jump_forward"] = jump_share(make_engine(args.model), args.per_subset, max_tokens * 2)
    if "s" in parts:
        from structgen.bench.structured_shapes import run as run_shapes

        result["s_shapes"] = run_shapes(args)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
