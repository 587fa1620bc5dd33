"""`structgen bench speculative`: speculative decoding on structured extraction, off vs n-gram (vs a draft model).

One loaded model, an engine per side sharing it: one without speculation, one with `--speculative-config` (n-gram
prompt lookup), and with `--draft MODEL` or `--draft-layers N` (the target's first N layers, written to a
temporary checkpoint: `structgen.models.truncate`) one more with a draft model. Two workloads, under each
request's JSON schema, greedy, `--max-tokens`: the extraction set of `bench completion` (meetings, contacts,
orders: short values copied from the prompt) and support tickets (`ticket_workload.py`: order numbers,
addresses, product names and sentences copied whole). Loads, each run on every side in rotating order: single
stream (the requests one after another), `--concurrency` in flight, and 32 in flight (where speculation must
switch itself off, or at least never slow the batch). Reported per load and side: output tokens/s, the speed-up
over "off", the acceptance rate (accepted / proposed), and whether every output is token for token the same.

    structgen bench speculative [--model smollm2-135m] [--requests 12] [--max-tokens 128] [-k 5]
        [--concurrency 8] [--passes 2] [--draft MODEL | --draft-layers N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from structgen.bench.extraction_workload import extraction_requests
from structgen.bench.ticket_workload import ticket_requests


@dataclass(slots=True)
class Side:
    seconds: float = 0.0
    tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def make_engines(model: str, specs: dict[str, dict[str, Any] | None], *, max_num_seqs: int) -> dict[str, Any]:
    """{side: engine}, all on the first side's loaded model."""
    from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
    from structgen.engine.llm_engine import LLMEngine

    engines: dict[str, Any] = {}
    for side, speculative in specs.items():
        config = EngineConfig(
            model=model,
            cache=CacheConfig(kv_cache_tokens=32768),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
            speculative_config=speculative,
        )
        first = next(iter(engines.values()), None)
        if first is None:
            engines[side] = LLMEngine(config)
        else:
            shared = {"model": first.model, "tokenizer": first.tokenizer, "model_dir": first.model_dir}
            engines[side] = LLMEngine(config, **shared)
    return engines


def run_load(
    engine: Any, requests: list[Any], side: Side, *, concurrency: int, max_tokens: int, tag: str
) -> None:
    """All `requests`, at most `concurrency` in flight, timed by `engine.step()` calls."""
    from structgen.sampling_params import SamplingParams
    from structgen.structured import StructuredOutputsParams

    counters = engine.speculator.counters if engine.speculator is not None else None
    before = (counters.num_proposed, counters.num_accepted) if counters is not None else (0, 0)
    pending = list(requests)
    in_flight = 0
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            item = pending.pop(0)
            prompt = engine.tokenizer.apply_chat_template(item.messages, add_generation_prompt=True)
            params = SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                structured_outputs=StructuredOutputsParams(json=item.schema),
            )
            engine.add_request(f"{tag}-{item.id}", prompt, params, stream=False)
            in_flight += 1
        start = time.perf_counter()
        outputs = engine.step()
        side.seconds += time.perf_counter() - start
        for out in outputs:
            if out.finished:
                in_flight -= 1
                tokens = out.outputs[0].token_ids
                side.tokens += len(tokens)
                side.outputs[out.request_id.split("-", 1)[1]] = list(tokens)
        if engine.last_step_num_tokens == 0:
            engine.structured.wait(timeout=0.05)
    if counters is not None:
        side.proposed += counters.num_proposed - before[0]
        side.accepted += counters.num_accepted - before[1]


def measure(args: argparse.Namespace, *, draft: str | None = None) -> dict[str, Any]:
    common = {"num_speculative_tokens": args.k, "max_batch_size": args.max_batch_size}
    specs: dict[str, dict[str, Any] | None] = {
        "off": None,
        "ngram": {"method": "ngram", "prompt_lookup_max": args.lookup_max, **common},
    }
    if draft is not None:
        specs["draft"] = {"method": "draft_model", "model": draft, **common}
    engines = make_engines(args.model, specs, max_num_seqs=max(32, args.concurrency))
    sides = list(engines)
    requests = extraction_requests(args.requests, seed=7)
    tickets = ticket_requests(args.requests, seed=7)
    wide = (requests * (-(-args.wide_requests // len(requests))))[: args.wide_requests]
    wide = [type(r)(f"{r.id}-{i}", r.schema, r.messages) for i, r in enumerate(wide)]
    loads = {  # name: (requests, in flight)
        "extraction single": (requests[: args.single_requests], 1),
        "tickets single": (tickets[: args.single_requests], 1),
        f"extraction concurrent-{args.concurrency}": (requests, args.concurrency),
        f"tickets concurrent-{args.concurrency}": (tickets, args.concurrency),
        "extraction concurrent-32": (wide, 32),
    }
    results: dict[str, Any] = {}
    try:
        for engine in engines.values():  # warm-up: compiles, allocator
            for warm in (requests[:3], tickets[:1]):
                run_load(engine, warm, Side(), concurrency=3, max_tokens=args.max_tokens, tag="warm")
        for load, (batch, concurrency) in loads.items():
            measured = {side: Side() for side in sides}
            for p in range(args.passes):
                for side in sides[p % len(sides) :] + sides[: p % len(sides)]:  # each side first in turn
                    run_load(
                        engines[side],
                        batch,
                        measured[side],
                        concurrency=concurrency,
                        max_tokens=args.max_tokens,
                        tag=f"{load.replace(' ', '_')}{p}",
                    )
            off = measured["off"]
            row: dict[str, Any] = {"off_tok_s": round(off.rate(), 1)}
            for side in sides[1:]:
                on = measured[side]
                same = sum(off.outputs[key] == on.outputs.get(key) for key in off.outputs)
                row[side] = {
                    "tok_s": round(on.rate(), 1),
                    "speedup": round(on.rate() / off.rate(), 3) if off.rate() else 0.0,
                    "acceptance": round(on.accepted / on.proposed, 3) if on.proposed else 0.0,
                    "proposed": on.proposed,
                    "accepted": on.accepted,
                    "identical": f"{same}/{len(off.outputs)}",
                }
            results[load] = row
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {"model": args.model, "k": args.k, "max_tokens": args.max_tokens, "draft": draft, "loads": results}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=12, help="extraction requests per concurrent load")
    ap.add_argument("--single-requests", type=int, default=6, help="of those, run single stream")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=5, help="num_speculative_tokens (default %(default)s)")
    ap.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max (default %(default)s)")
    ap.add_argument("--max-batch-size", type=int, default=1, help="speculate up to this many decoding")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--wide-requests", type=int, default=64, help="requests of the 32-in-flight load")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--draft", default=None, help="also a draft-model side with this draft (a name or path)")
    ap.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        help="also a draft-model side whose draft is the target's first N layers (a temporary checkpoint)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.draft is not None and args.draft_layers is not None:
        ap.error("--draft and --draft-layers are alternatives")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="structgen-draft-") as scratch:
        draft = args.draft
        if args.draft_layers is not None:
            from structgen.models.registry import resolve_model
            from structgen.models.truncate import write_truncated_checkpoint

            try:
                draft = str(
                    write_truncated_checkpoint(
                        resolve_model(args.model), scratch, num_layers=args.draft_layers
                    )
                )
            except ValueError as error:
                ap.error(str(error))
        result = measure(args, draft=draft)
    print(
        f"{'load':26} {'off tok/s':>10}   "
        + "   ".join(f"{s + ' tok/s':>12} {'speed-up':>9} {'accept':>7} {'same':>6}" for s in _sides(result))
    )
    for load, r in result["loads"].items():
        cells = [
            f"{r[s]['tok_s']:12} {r[s]['speedup']:9} {r[s]['acceptance']:7} {r[s]['identical']:>6}"
            for s in _sides(result)
        ]
        print(f"{load:26} {r['off_tok_s']:10}   " + "   ".join(cells))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _sides(result: dict[str, Any]) -> list[str]:
    first = next(iter(result["loads"].values()), {})
    return [side for side in first if side != "off_tok_s"]
