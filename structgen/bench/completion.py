"""Do structured outputs finish? Budget-aware closing and the loop guard, on and off, in the same run.

    structgen bench completion [--model smollm2-135m] [--extraction N] [--bfcl-per-category K]
                               [--max-tokens N] [--repeat R] [--json OUT] [--outputs OUT.jsonl]

Two workloads, each generated twice through the offline engine with the same prompts, greedy: once with the
defaults (closing and the loop guard on) and once with both switched off per request (what structgen did
before):

- extraction: N requests over three small strict schemas (a meeting with attendees, a contact, an order with
  line items), prompts made here from fixed word lists (seeded), `max_tokens` 192 by default;
- BFCL: K questions of each of the four BFCL v4 files under `../shared/data/bfcl/`, `tool_choice="required"`.

Reported per workload and mode: outputs, finished ("stop"), truncated ("length"), valid (finished outputs that
validate: `jsonschema` for extraction, every call naming a function of the question with valid arguments for
BFCL), closed at the budget, loops ended, tokens and tokens/s. Targets: no truncated output where a completion
fits the budget, 100% of finished outputs valid, and tokens/s with the features on >= 0.98x off. `--repeat R`
runs R pairs of passes, alternating which mode goes first, and reports each pass and the median ratio. A last
phase measures the cost where the features change nothing: the extraction requests whose outputs were the same
on and off, four copies each, run off and on in alternation (`--overhead-repeat` pairs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structgen.bench.extraction_workload import Extraction, extraction_requests
from structgen.bench.tools import CATEGORIES, DEFAULT_BFCL, build_requests, load_questions


class AdvanceTimer:
    """Times `StructuredRequest.advance` (the grammar's side of every sampled token: accept, jump-forward, and
    with the features the loop guard and the closing) in this process: what the features add per token,
    measured apart from the machine's noise, which on shared cores swings whole passes by 10%."""

    def __init__(self) -> None:
        from structgen.structured.request import StructuredRequest

        self.seconds = 0.0
        self.calls = 0
        original = StructuredRequest.advance
        timer = self

        def timed(request: Any, token_id: int, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(request, token_id, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - start
                timer.calls += 1

        StructuredRequest.advance = timed  # type: ignore[method-assign]

    def take(self) -> tuple[float, int]:
        seconds, calls, self.seconds, self.calls = self.seconds, self.calls, 0.0, 0
        return seconds, calls


@dataclass(slots=True)
class Tally:
    outputs: int = 0
    finished: int = 0
    truncated: int = 0
    valid: int = 0
    closed_at_budget: int = 0
    loops_ended: int = 0
    errors: int = 0
    tokens: int = 0
    seconds: float = 0.0
    advance_seconds: float = 0.0  # in `StructuredRequest.advance` (see AdvanceTimer)
    advance_calls: int = 0

    def add(self, output: Any, valid: bool) -> None:
        self.outputs += 1
        self.tokens += len(output.token_ids)
        report = output.structured
        if report is not None:
            self.closed_at_budget += bool(report.closed_at_budget)
            self.loops_ended += report.loops_ended
        if output.finish_reason == "length":
            self.truncated += 1
        elif output.finish_reason == "stop":
            self.finished += 1
            self.valid += valid
        else:
            self.errors += 1

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {
            "valid_of_finished": self.valid / self.finished if self.finished else None,
            "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else None,
            "advance_us_per_token": round(1e6 * self.advance_seconds / self.advance_calls, 2)
            if self.advance_calls
            else None,
            "advance_share": round(self.advance_seconds / self.seconds, 4) if self.seconds else None,
        }


_TIMERS: list[AdvanceTimer] = []  # installed by `main` (it patches the class: once per process)


def _take_advance_time() -> tuple[float, int]:
    return _TIMERS[0].take() if _TIMERS else (0.0, 0)


def _switched(params: Any, on: bool) -> Any:
    """`params` with closing and the loop guard as the engine's defaults (on) or both off."""
    if on:
        return params
    structured = dataclasses.replace(params.structured_outputs, close_at_budget=False, loop_guard=False)
    return dataclasses.replace(params, structured_outputs=structured)


def run_extraction(
    llm: Any, requests: Sequence[Extraction], *, max_tokens: int, on: bool, report: list
) -> Tally:
    import jsonschema

    from structgen.sampling_params import SamplingParams
    from structgen.structured import StructuredOutputsParams

    params = [
        _switched(
            SamplingParams(
                temperature=0,
                max_tokens=max_tokens,
                structured_outputs=StructuredOutputsParams(json=r.schema),
            ),
            on,
        )
        for r in requests
    ]
    tally = Tally()
    start = time.perf_counter()
    _take_advance_time()
    results = llm.chat([r.messages for r in requests], params, use_tqdm=False)
    tally.seconds = time.perf_counter() - start
    tally.advance_seconds, tally.advance_calls = _take_advance_time()
    for request, result in zip(requests, results, strict=True):
        output = result.outputs[0]
        valid = False
        if output.finish_reason == "stop":
            try:
                jsonschema.validate(json.loads(output.text), request.schema)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
        tally.add(output, valid)
        report.append(_record("extraction", request.id, on, output, valid))
    return tally


def run_bfcl(llm: Any, questions: Sequence[Any], *, max_tokens: int, on: bool, report: list) -> Tally:
    from structgen.sampling_params import SamplingParams

    base = SamplingParams(temperature=0, max_tokens=max_tokens)
    requests, refused = build_requests(questions, llm.get_tokenizer(), base, constrained=True)
    tally = Tally(errors=refused, outputs=refused)
    start = time.perf_counter()
    _take_advance_time()
    results = llm.generate(
        [r.prompt for r in requests], [_switched(r.params, on) for r in requests], use_tqdm=False
    )
    tally.seconds = time.perf_counter() - start
    tally.advance_seconds, tally.advance_calls = _take_advance_time()
    for request, result in zip(requests, results, strict=True):
        output = result.outputs[0]
        parsed = request.plan.parse(output.text)
        valid = bool(parsed.calls) and parsed.valid
        tally.add(output, valid)
        report.append(_record("bfcl", request.question.id, on, output, valid))
    return tally


def _record(workload: str, request_id: str, on: bool, output: Any, valid: bool) -> dict[str, Any]:
    report = output.structured
    return {
        "workload": workload,
        "id": request_id,
        "features": on,
        "finish_reason": output.finish_reason,
        "valid": valid,
        "closed_at_budget": bool(report and report.closed_at_budget),
        "loops_ended": report.loops_ended if report else 0,
        "tokens": len(output.token_ids),
        "text": output.text,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="structgen bench completion", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--extraction", type=int, default=64, help="extraction requests (0: none)")
    parser.add_argument("--bfcl", type=Path, default=DEFAULT_BFCL, help="the BFCL data folder")
    parser.add_argument("--bfcl-per-category", type=int, default=16, help="BFCL questions per file (0: none)")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--bfcl-max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=1, help="passes of each mode, alternating")
    parser.add_argument("--overhead-repeat", type=int, default=6, help="off/on pairs of the same-outputs run")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    parser.add_argument("--outputs", type=Path, default=None, help="write every output here (JSON lines)")
    args = parser.parse_args(argv)
    use_bfcl = args.bfcl_per_category > 0
    if use_bfcl and not (args.bfcl / "normalized_tools.jsonl").is_file():
        print(
            f"error: no BFCL data in {args.bfcl} (pass --bfcl DIR or --bfcl-per-category 0)", file=sys.stderr
        )
        return 2

    import torch

    from structgen.engine.llm import LLM
    from structgen.structured import StructuredOutputConfig

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    _TIMERS.append(AdvanceTimer())
    llm = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        kv_cache_tokens=64 * 1024,  # every prompt stays in the prefix cache: no pass is colder than another
        structured=StructuredOutputConfig(compile_nice=0),
    )
    extraction = extraction_requests(args.extraction)
    questions = load_questions(args.bfcl, per_category=args.bfcl_per_category) if use_bfcl else []
    # One unmeasured pass of each workload warms what the first measured pass would otherwise pay for alone:
    # the compile cache, llguidance's lazily built lexers, the kernels and the prefix cache.
    if extraction:
        run_extraction(llm, extraction, max_tokens=args.max_tokens, on=True, report=[])
    if questions:
        run_bfcl(llm, questions, max_tokens=args.bfcl_max_tokens, on=True, report=[])
    report: list[dict[str, Any]] = []
    passes: list[dict[str, Any]] = []
    for i in range(args.repeat):
        # Alternate which mode goes first, so drift on a shared machine does not favour one.
        for on in (False, True) if i % 2 == 0 else (True, False):
            row: dict[str, Any] = {"features": "on" if on else "off"}
            if extraction:
                row["extraction"] = run_extraction(
                    llm, extraction, max_tokens=args.max_tokens, on=on, report=report
                ).row()
            if questions:
                row["bfcl"] = run_bfcl(
                    llm, questions, max_tokens=args.bfcl_max_tokens, on=on, report=report
                ).row()
            passes.append(row)
            _print_pass(row)
    overhead = _overhead(llm, extraction, report, max_tokens=args.max_tokens, repeat=args.overhead_repeat)
    results = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "bfcl_max_tokens": args.bfcl_max_tokens,
        "extraction_requests": len(extraction),
        "bfcl_questions": len(questions),
        "bfcl_categories": list(CATEGORIES) if questions else [],
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "passes": passes,
        "throughput_on_over_off": _ratios(passes),
        "overhead": overhead,
    }
    print("tokens/s, on / off:", json.dumps(results["throughput_on_over_off"]))
    if overhead:
        print(
            f"same outputs ({overhead['requests']} requests, identical on and off: {overhead['identical']}): "
            f"tokens/s on / off {overhead['median']} (median wall times), time in the grammar's side of each "
            f"token: {overhead['advance_share_off']:.2%} off, {overhead['advance_share_on']:.2%} on"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.outputs is not None:
        args.outputs.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in report))
    return 0


def _overhead(
    llm: Any, extraction: Sequence[Extraction], report: list[dict[str, Any]], *, max_tokens: int, repeat: int
) -> dict[str, Any] | None:
    """What the features cost per token where they change nothing: the extraction requests whose outputs were
    the same on and off (they finished on their own, no loop), four copies of each so batches stay full, run
    off and on alternately. Their tokens/s ratio is the throughput cost; the outputs must match."""
    texts: dict[tuple[str, bool], str] = {}
    finished: set[str] = set()
    for record in report:
        if record["workload"] == "extraction":
            texts.setdefault((record["id"], record["features"]), record["text"])
            if record["finish_reason"] == "stop" and not record["features"]:
                finished.add(record["id"])
    same = [r for r in extraction if r.id in finished and texts.get((r.id, True)) == texts.get((r.id, False))]
    if not same:
        return None
    copies = [r for r in same for _ in range(4)]
    run_extraction(llm, copies, max_tokens=max_tokens, on=False, report=[])  # warm, as the passes before
    seconds: dict[bool, list[float]] = {False: [], True: []}
    advance: dict[bool, list[float]] = {False: [], True: []}
    identical = True
    for i in range(repeat):
        texts_by_mode = {}
        # Alternate which mode goes first, so drift on the machine does not favour one.
        for on in (False, True) if i % 2 == 0 else (True, False):
            outputs: list[dict[str, Any]] = []
            tally = run_extraction(llm, copies, max_tokens=max_tokens, on=on, report=outputs)
            seconds[on].append(tally.seconds)
            advance[on].append(tally.advance_seconds)
            texts_by_mode[on] = [o["text"] for o in outputs]
        identical &= texts_by_mode[True] == texts_by_mode[False]
    off, on = statistics.median(seconds[False]), statistics.median(seconds[True])
    return {
        "requests": len(copies),
        "identical": identical,
        "seconds_off": [round(x, 3) for x in seconds[False]],
        "seconds_on": [round(x, 3) for x in seconds[True]],
        # The same tokens either way: tokens/s on / off is the inverse ratio of the wall times.
        "median": round(off / on, 3),
        "advance_share_off": round(statistics.median(advance[False]) / off, 4),
        "advance_share_on": round(statistics.median(advance[True]) / on, 4),
    }


def _ratios(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """tokens/s on / off for each pair of passes, and their median."""
    ratios: dict[str, Any] = {}
    for first, second in zip(passes[::2], passes[1::2], strict=True):
        on, off = (first, second) if first["features"] == "on" else (second, first)
        for workload in ("extraction", "bfcl"):
            if workload in on and off[workload]["tokens_per_s"]:
                ratio = on[workload]["tokens_per_s"] / off[workload]["tokens_per_s"]
                ratios.setdefault(workload, []).append(round(ratio, 3))
    return ratios | {f"{w}_median": round(statistics.median(r), 3) for w, r in list(ratios.items())}


def _print_pass(row: dict[str, Any]) -> None:
    columns = (
        "outputs",
        "finished",
        "truncated",
        "valid",
        "closed_at_budget",
        "loops_ended",
        "tokens",
        "tokens_per_s",
    )
    print(f"{'features ' + row['features']:<18}" + "".join(f"{c:>17}" for c in columns))
    for workload in ("extraction", "bfcl"):
        if workload in row:
            print(f"  {workload:<16}" + "".join(f"{row[workload][c]!s:>17}" for c in columns))


if __name__ == "__main__":
    sys.exit(main())
