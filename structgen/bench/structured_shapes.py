"""Part (s) of `structgen bench structured`: decode throughput under *structural* JSON Schemas (issue 22).

Part (a) measures one shape only, a long string, where the grammar sits inside one value. Real schemas are
arrays of objects with integers, booleans, enums and short strings, where every few tokens are structural
(keys, commas, braces: jump-forward territory, rejected picks, grammar accepts). For each shape in `SHAPES`:

- in process, closed loop: two engines (jump-forward on, the default config otherwise) step alternately, each
  keeping `--concurrency` requests in flight (a finished request is replaced at once by the next prompt, with
  a new seed), so both sides always decode full batches. The unconstrained side ignores EOS (it never ends
  early: the conservative baseline); the constrained side ends when its JSON completes or at `--max-tokens`.
  The unconstrained side's first wave is staggered (request i of the first `--concurrency` asks for
  `max_tokens * (i + 1) / concurrency` tokens), so that from the start one of its requests ends, and the next
  one's prompt is prefilled, every `max_tokens / concurrency` steps, as in a server's steady state. Started
  together, its requests all ended at one step, `max_tokens` steps on, and a window shorter than that (200
  steps against 256 tokens) saw none end: that side paid for no prompt while the constrained side, whose
  outputs end sooner and at their own times, paid for all of its replacements' (the measure's bias, not the
  engine's cost; until session 23 the tables carried it).
  Staggered or not, a first wave starts all at once: in the first `max_tokens` steps its requests are younger
  than a server's steady state holds (uniform ages up to `max_tokens`), and their contexts shorter. Measured
  after 5 steps, the unconstrained side's contexts averaged 93 tokens against 142 in the steady state, the
  constrained side's (its outputs written faster, with forced tokens) 131 against 132 (`tiny`,
  `optional_anyof`): the constrained side's attention read ~40% more cache than the other's, a cost of the
  window, not of structure (until session 27 the tables carried it). So the constrained side's first wave is
  staggered too (a request of it with a small budget is closed at it, as a server closes any output at its
  budget), and both sides settle for `max_tokens` steps after the warm-up (the first prefill + 5 steps; the
  schema compiled before) before each runs `--steps` counted steps (`--no-settle`: the old measure), summing
  the time of its own `engine.step()` calls. Tokens: `counters.num_generated_tokens` counts sampled tokens (one
  per sampled row per step), `output_processor.num_forced_tokens` the jump-forward ones (forced
  prefixes at the start, forced runs after a sampled token, budget-closing completions). Each finished
  constrained output is checked with `jsonschema`.
- `--breakdown`: the same loop again with the per-phase timers of `structured_phases` installed (a separate
  pass, so the timers' overhead stays out of the throughput ratios);
- `--http`: the same shapes through the OpenAI server (`structured_http`).

    structgen bench structured --parts s [--shapes items,nested] [--steps 200] [--concurrency 32]
        [--max-tokens 256] [--breakdown] [--http --http-steps 100 --passes 3] [--no-settle] [--json OUT]
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from structgen.bench.http_clients import staggered_max_tokens
from structgen.bench.structured_engine import make_engine, params
from structgen.bench.structured_phases import PhaseTimer, PhaseTotals, format_table, model_work_split
from structgen.bench.structured_shape_schemas import SHAPES, prompt, validator

SEED = 1000
WARMUP_STEPS = 5  # after the first prefill; not counted


def settle_steps(max_tokens: int, *, settle: bool = True) -> int:
    """Steps run before a window counts (after the first prefill): `max_tokens` more than the warm-up, so that
    both sides' first waves (staggered) have ended and their requests are of every age, as in a server's steady
    state; `settle` off: the warm-up alone (the measure before session 27)."""
    return WARMUP_STEPS + (max_tokens if settle else 0)


def first_wave_stagger(*, constrained: bool, concurrency: int, settle: bool = True) -> int:
    """How many requests a side's first wave spreads its budgets over (0: all `max_tokens`): the unconstrained
    side's always (it ends requests at the steady rate), the constrained side's when the loop settles before
    counting (the measure before session 27 started it all at once). In process and through HTTP alike."""
    return concurrency if settle or not constrained else 0


@dataclass(slots=True)
class Tally:
    """One side's counts over the measured window."""

    seconds: float = 0.0
    steps: int = 0
    sampled: int = 0
    forced: int = 0
    prompt_tokens: int = 0  # prefill and forced runs computed (the constrained side replaces requests sooner)
    finished: int = 0
    stop: int = 0
    length: int = 0
    errors: int = 0
    valid: int = 0  # finished "stop" and valid under jsonschema
    invalid: int = 0  # finished "stop" but not valid

    def count(self, text: str, finish_reason: str | None, check: Any | None) -> None:
        self.finished += 1
        if finish_reason == "stop":
            self.stop += 1
        elif finish_reason == "length":
            self.length += 1
        else:
            self.errors += 1
        if check is None or finish_reason != "stop":
            return  # unconstrained, or cut / failed: nothing complete to check
        try:
            ok = check.is_valid(json.loads(text))
        except ValueError:
            ok = False
        self.valid += ok
        self.invalid += not ok


@dataclass(slots=True)
class Side:
    """One engine of the closed loop: keeps `concurrency` requests in flight."""

    engine: Any
    shape: str
    schema: dict[str, Any] | None  # None: unconstrained (ignores EOS)
    max_tokens: int
    tag: str
    check: Any | None = None
    stagger: int = 0  # the first that many requests' budgets staggered (`staggered_max_tokens`)
    tally: Tally = field(default_factory=Tally)
    phases: PhaseTotals | None = None
    counting: bool = False
    in_flight: set[str] = field(default_factory=set)
    _next: int = 0
    _start: tuple[int, int, int] = (0, 0, 0)

    def add(self) -> None:
        i, self._next = self._next, self._next + 1
        rid = f"{self.shape}-{self.tag}{i}"
        max_tokens = staggered_max_tokens(self.max_tokens, i, self.stagger)
        p = params(max_tokens, seed=SEED + i, schema=self.schema, ignore_eos=self.schema is None)
        self.engine.add_request(rid, prompt(self.shape, i), p)
        self.in_flight.add(rid)

    def start_counting(self) -> None:
        self.counting = True
        self._start = self._counters()

    def step(self, timer: PhaseTimer | None = None) -> None:
        engine = self.engine
        if timer is not None:
            # Warm-up steps go to a scratch total: only measured steps enter the breakdown.
            timer.current = self.phases if self.counting and self.phases is not None else PhaseTotals()
        before = engine.counters.num_steps
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if self.counting:
            self.tally.seconds += elapsed
            self.tally.steps += engine.counters.num_steps > before
            if self.phases is not None:
                self.phases.step_s += elapsed
                self.phases.steps += engine.counters.num_steps > before
        for out in outputs:
            if out.finished:
                self.in_flight.discard(out.request_id)
                if self.counting:
                    first = out.outputs[0]
                    self.tally.count(first.text, first.finish_reason, self.check)
                self.add()

    def close(self) -> None:
        """Stop counting; abort what is still in flight (the engine is reused for the next shape)."""
        self.counting = False
        now = self._counters()
        self.tally.sampled, self.tally.forced, self.tally.prompt_tokens = (
            b - a for a, b in zip(self._start, now, strict=True)
        )
        self.engine.abort(sorted(self.in_flight))
        self.in_flight.clear()

    def _counters(self) -> tuple[int, int, int]:
        c = self.engine.counters
        return (
            c.num_generated_tokens,
            self.engine.output_processor.num_forced_tokens,
            c.num_prompt_tokens_computed,
        )


def closed_loop(
    engines: tuple[Any, Any],
    shape: str,
    *,
    concurrency: int,
    steps: int,
    max_tokens: int,
    tag: str,
    timer: PhaseTimer | None = None,
    settle: bool = True,
) -> tuple[Side, Side]:
    """(unconstrained, constrained) sides after `steps` measured steps each, alternating, counted from the
    steady state (`settle_steps`)."""
    schema = SHAPES[shape]
    engines[1].structured.ensure_manager().compile(
        params(1, seed=0, schema=schema).structured_outputs.to_spec()
    )
    sides = make_sides(engines, shape, concurrency=concurrency, max_tokens=max_tokens, tag=tag, settle=settle)
    for side in sides:
        if timer is not None:
            side.phases = PhaseTotals()
        for _ in range(concurrency):
            side.add()
    for _ in range(1 + settle_steps(max_tokens, settle=settle)):
        for side in sides:
            side.step(timer)
    for side in sides:
        side.start_counting()
    while any(side.tally.steps < steps for side in sides):
        for side in sides:
            if side.tally.steps < steps:
                side.step(timer)
    for side in sides:
        side.close()
    return sides


def make_sides(
    engines: tuple[Any, Any], shape: str, *, concurrency: int, max_tokens: int, tag: str, settle: bool = True
) -> tuple[Side, Side]:
    """(unconstrained, constrained) sides of a closed loop. Both first waves are staggered when the loop settles
    before counting (a constrained request of the first wave with a small budget is closed at it), else only
    the unconstrained side's (the measure before session 27, whose constrained side started all at once)."""
    schema = SHAPES[shape]
    return (
        Side(
            engines[0],
            shape,
            None,
            max_tokens,
            f"{tag}u",
            stagger=first_wave_stagger(constrained=False, concurrency=concurrency, settle=settle),
        ),
        Side(
            engines[1],
            shape,
            schema,
            max_tokens,
            f"{tag}c",
            check=validator(schema),
            stagger=first_wave_stagger(constrained=True, concurrency=concurrency, settle=settle),
        ),
    )


def counts(tally: Tally) -> dict[str, Any]:
    """A side's counts for the report."""
    return {
        key: round(value, 3) if isinstance(value, float) else value for key, value in asdict(tally).items()
    }


def ratios(
    plain: Tally, constrained: Tally, *, report: Callable[[Tally], dict[str, Any]] = counts
) -> dict[str, Any]:
    """A shape's result: both sides' rates and the ratios (sampled tokens only, and with forced tokens)."""
    plain_rate = plain.sampled / plain.seconds
    sampled_rate = constrained.sampled / constrained.seconds
    total = constrained.sampled + constrained.forced
    total_rate = total / constrained.seconds
    return {
        "unconstrained_tok_s": round(plain_rate, 1),
        "constrained_sampled_tok_s": round(sampled_rate, 1),
        "ratio_sampled": round(sampled_rate / plain_rate, 3),
        "constrained_total_tok_s": round(total_rate, 1),
        "ratio_total": round(total_rate / plain_rate, 3),
        "forced_share": round(constrained.forced / total, 3) if total else 0.0,
        "unconstrained": report(plain),
        "constrained": report(constrained),
    }


def run_in_process(
    model: str | None,
    shapes: list[str],
    *,
    concurrency: int,
    steps: int,
    max_tokens: int,
    breakdown: bool,
    settle: bool = True,
) -> dict[str, Any]:
    kv = max(32768, 2 * concurrency * (max_tokens + 64))  # room for every row's prompt + output, twice over
    engines = tuple(
        make_engine(model, jump_forward=True, max_num_seqs=max(64, concurrency), kv_cache_tokens=kv)
        for _ in range(2)
    )
    results: dict[str, Any] = {}
    try:
        for shape in shapes:
            plain, constrained = closed_loop(
                engines,
                shape,
                concurrency=concurrency,
                steps=steps,
                max_tokens=max_tokens,
                tag="m",
                settle=settle,
            )
            results[shape] = ratios(plain.tally, constrained.tally)
            if breakdown:
                timer = PhaseTimer()
                with timer.installed([engine.model for engine in engines]):
                    sides = closed_loop(
                        engines,
                        shape,
                        concurrency=concurrency,
                        steps=steps,
                        max_tokens=max_tokens,
                        tag="b",
                        timer=timer,
                        settle=settle,
                    )
                table = {
                    name: side.phases.ms_per_step()
                    for name, side in zip(("unconstrained", "json"), sides, strict=True)
                    if side.phases is not None
                }
                results[shape]["breakdown_ms_per_step"] = table
                results[shape]["breakdown_split"] = model_work_split(table["unconstrained"], table["json"])
                if timer.missing:
                    results[shape]["breakdown_missing"] = timer.missing
    finally:
        for engine in engines:
            engine.shutdown()
    return results


def print_table(results: dict[str, Any]) -> None:
    """One line per shape: rates, ratios, forced share, and how the constrained outputs ended."""
    steps = any("steps" in r["constrained"] for r in results.values())
    print(
        f"{'shape':15} {'plain tok/s':>11} {'json tok/s':>10} {'ratio':>6} {'+forced':>8} {'ratio':>6} "
        f"{'forced':>7} {'done':>5} {'stop':>5} {'cut':>4} {'valid':>5} {'inval':>5}"
        + (" steps" if steps else "")
    )
    for shape, r in results.items():
        c = r["constrained"]
        print(
            f"{shape:15} {r['unconstrained_tok_s']:11} {r['constrained_sampled_tok_s']:10} "
            f"{r['ratio_sampled']:6} {r['constrained_total_tok_s']:8} {r['ratio_total']:6} "
            f"{r['forced_share']:7.1%} {c['finished']:5} {c['stop']:5} {c['length']:4} {c['valid']:5} "
            f"{c['invalid']:5}" + (f" {c['steps']:5}" if steps else "")
        )
    for shape, r in results.items():
        if "breakdown_ms_per_step" in r:
            print(f"\n{shape}: per-phase time (a separate, timed pass)")
            print(format_table(r["breakdown_ms_per_step"]))
            if r.get("breakdown_missing"):
                print(f"  not found (renamed?): {', '.join(r['breakdown_missing'])}")


def run(args: Any) -> dict[str, Any]:
    """Part (s) for `structured_engine.main`: the in-process table, then (with `--http`) the server's."""
    shapes = [s for s in args.shapes.split(",") if s]  # checked against SHAPES by the argument parser
    max_tokens = args.max_tokens if args.max_tokens is not None else 256
    options = {"concurrency": args.concurrency, "max_tokens": max_tokens, "settle": args.settle}
    result: dict[str, Any] = {**options, "steps": args.steps}
    if args.steps > 0:  # 0: through HTTP only
        result["in_process"] = run_in_process(
            args.model, shapes, steps=args.steps, breakdown=args.breakdown, **options
        )
        print("in process (two engines stepping alternately, closed loop)")
        print_table(result["in_process"])
    if args.http:
        from structgen.bench.structured_http import print_window_medians, run_http

        result["http"] = run_http(args.model, shapes, steps=args.http_steps, passes=args.passes, **options)
        result["http_steps"], result["http_passes"] = args.http_steps, args.passes
        print("\nthrough HTTP (one server, one engine, the sides alternating)")
        print_table(result["http"])
        print_window_medians(result["http"])
    return result
