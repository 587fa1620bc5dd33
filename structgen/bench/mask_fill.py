"""Mask fill per request-step: our `Grammar.fill_bitmask` / `StructuredOutputManager.fill_bitmask` against the
backend library's own call on the same matcher state, on the `tiny` model's cl100k tokenizer (100k tokens).

At every step of a valid output the two calls alternate `--repeat` times on the same state; the per-step
medians give p50/p90 over the steps. The batched section fills 32 requests' rows at once (the per-step
path of the engine) and reports the time per request.

    structgen bench mask-fill [--repeat 15] [--batch 32] [--backends llguidance,xgrammar,outlines] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from structgen.bench import shared_data

SAMPLES = shared_data() / "vllm-samples"
# (schema, a valid output): the first one a backend enforces exactly is measured.
CASES = [
    (
        SAMPLES / "sample_json_schema.v1.json",
        '{"name":"Maria Lopez","age":34,"skills":["python","sql"],"grade":"A","email":"maria@example.com",'
        '"work_history":[{"company":"Acme","duration":2.5,"position":"engineer"}]}',
    ),
    (
        SAMPLES / "sample_definition_json_schema.v1.json",
        '{"steps":[{"explanation":"Add 2 and 3","output":"5"},{"explanation":"Multiply by 4","output":"20"}],'
        '"final_answer":"The result is 20"}',
    ),
]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--backends", default="llguidance,xgrammar,outlines")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from structgen.models.registry import resolve_model
    from structgen.structured import (
        StructuredOutputError,
        StructuredOutputManager,
        StructuredOutputsParams,
        TokenizerInfo,
        create_backend,
    )
    from structgen.tokenizer import Tokenizer

    model_dir = resolve_model("tiny")
    tokenizer = Tokenizer.from_dir(model_dir)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    info = TokenizerInfo.from_tokenizer(tokenizer, vocab_size=vocab_size)
    print(f"cl100k vocabulary: {info.num_tokens} tokens, mask over the model's {vocab_size}")
    print(
        "\n| backend | schema (output tokens) | path | raw p50 µs | ours p50 µs | ours / raw (p50) | raw p90 µs | ours p90 µs |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    rows: list[dict[str, Any]] = []
    for name in args.backends.split(","):
        backend = create_backend(name, info)
        for schema_file, output in CASES:  # noqa: B007 (the pair that compiles is used below)
            try:
                grammar = backend.compile(
                    StructuredOutputsParams(json=json.loads(schema_file.read_text())).to_spec()
                )
                break
            except StructuredOutputError:
                continue
        else:
            print(f"| {name} | (no sample schema it enforces exactly) | | | | | | |")
            continue
        ids = tokenizer.encode(output, add_special_tokens=False)
        label = f"{name} | {schema_file.name} ({len(ids)})"
        manager = StructuredOutputManager(info, backends={name: backend})
        raw_one, ours_one = _single(name, grammar, ids, vocab_size, args.repeat)
        rows.append(_row(label, "one request", raw_one, ours_one))
        raw_batch, ours_batch = _batched(name, grammar, manager, ids, vocab_size, args.batch, args.repeat)
        rows.append(_row(label, f"batch of {args.batch}, per request", raw_batch, ours_batch))
        manager.shutdown()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _row(name: str, path: str, raw: list[float], ours: list[float]) -> dict[str, Any]:
    r50, o50 = statistics.median(raw), statistics.median(ours)
    r90, o90 = _p90(raw), _p90(ours)
    print(f"| {name} | {path} | {r50:.1f} | {o50:.1f} | {o50 / r50:.2f}x | {r90:.1f} | {o90:.1f} |")
    return {
        "case": name,
        "path": path,
        "raw_p50_us": r50,
        "ours_p50_us": o50,
        "raw_p90_us": r90,
        "ours_p90_us": o90,
    }


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def _raw_single(name: str, grammar: Any) -> Callable[[Any, int], None]:
    """The call a user of the library makes directly (what vLLM's adapters call)."""
    if name == "llguidance":
        import llguidance.torch

        matcher = grammar.matcher
        return lambda bitmask, row: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)
    if name == "xgrammar":
        matcher = grammar.matcher
        return lambda bitmask, row: matcher.fill_next_token_bitmask(bitmask, row)
    guide = grammar._guide
    return lambda bitmask, row: guide.write_mask_into(bitmask[row].data_ptr(), bitmask.shape[1], 4)


def _single(
    name: str, grammar: Any, ids: list[int], vocab_size: int, repeat: int
) -> tuple[list[float], list[float]]:
    from structgen.structured import allocate_token_bitmask

    bitmask = allocate_token_bitmask(4, vocab_size)
    raw_call = _raw_single(name, grammar)
    raw_steps, ours_steps = [], []
    for token in ids:
        raw_t, ours_t = [], []
        for _ in range(repeat):
            t0 = time.perf_counter_ns()
            raw_call(bitmask, 2)
            t1 = time.perf_counter_ns()
            grammar.fill_bitmask(bitmask, 1)
            t2 = time.perf_counter_ns()
            raw_t.append(t1 - t0)
            ours_t.append(t2 - t1)
        assert bitmask[1].equal(bitmask[2])
        raw_steps.append(statistics.median(raw_t) / 1e3)
        ours_steps.append(statistics.median(ours_t) / 1e3)
        assert grammar.accept_tokens([token])
    return raw_steps, ours_steps


def _batched(
    name: str, grammar: Any, manager: Any, ids: list[int], vocab_size: int, batch: int, repeat: int
) -> tuple[list[float], list[float]]:
    from structgen.structured import allocate_token_bitmask

    # `batch` requests at staggered positions of the same output.
    grammars, positions = [], []
    for k in range(batch):
        g = grammar.clone()
        g.reset()
        positions.append((k * 7) % (len(ids) - 8))
        assert g.accept_tokens(ids[: positions[-1]])
        grammars.append(g)
    rows = list(range(batch))
    items = list(zip(grammars, rows, strict=True))
    raw_call = _raw_batch(name, grammars, rows)
    raw_mask = allocate_token_bitmask(batch, vocab_size)
    ours_mask = allocate_token_bitmask(batch, vocab_size)
    raw_steps, ours_steps = [], []
    for _ in range(8):  # eight steps; every request advances one token between them
        raw_t, ours_t = [], []
        for _ in range(repeat):
            t0 = time.perf_counter_ns()
            raw_call(raw_mask)
            t1 = time.perf_counter_ns()
            manager.fill_bitmask(items, ours_mask)
            t2 = time.perf_counter_ns()
            raw_t.append((t1 - t0) / batch)
            ours_t.append((t2 - t1) / batch)
        assert raw_mask.equal(ours_mask)
        raw_steps.append(statistics.median(raw_t) / 1e3)
        ours_steps.append(statistics.median(ours_t) / 1e3)
        for k, g in enumerate(grammars):
            assert g.accept_tokens([ids[positions[k]]])
            positions[k] += 1
    return raw_steps, ours_steps


def _raw_batch(name: str, grammars: list[Any], rows: list[int]) -> Callable[[Any], None]:
    if name == "llguidance":
        import llguidance
        import llguidance.torch

        executor = llguidance.LLExecutor()
        pairs = [(g.matcher, r) for g, r in zip(grammars, rows, strict=True)]
        return lambda bitmask: llguidance.torch.fill_next_token_bitmask_par(executor, pairs, bitmask)
    if name == "xgrammar":
        import xgrammar

        batch = xgrammar.BatchGrammarMatcher(max_threads=2)
        matchers = [g.matcher for g in grammars]
        return lambda bitmask: batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
    guides = [g._guide for g in grammars]

    def fill(bitmask: Any) -> None:
        for guide, row in zip(guides, rows, strict=True):
            guide.write_mask_into(bitmask[row].data_ptr(), bitmask.shape[1], 4)

    return fill
