"""The whole engine on a CUDA GPU (`benchmarks/gpu_engine.py`, `structgen bench gpu-engine`).

`benchmarks/gpu.py` checks the kernels and a bare decode loop; this runs what a user runs: `LLM` on `tiny`
(scheduler, paged cache, sampler, structured masks on the device), with every schema shape of the structural
benchmark.

1. Agreement (float32, greedy): the same structured and free requests under Triton attention with decode CUDA
   graphs, Triton eager, and the torch attention backend. Share of outputs equal to the torch backend's, and
   every structured output checked against its schema (the one hard requirement: exit code 1 if any fails).
2. Throughput (the model's own dtype, temperature 1, seeded): many concurrent requests, each shape constrained
   against the same requests unconstrained; tokens/s and the ratio, with and without forced tokens.
`--cpu-check` runs the same code on the CPU at small sizes (the torch backend only; numbers mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from structgen.bench.structured_shapes import Tally


@dataclass(slots=True)
class AgreementRow:
    backend: str
    requests: int
    same_as_torch: float  # share of outputs (structured and free) equal to the torch backend's
    structured_valid: float
    broken: int  # structured outputs that finished on their own and fail their schema: must be 0
    seconds: float


@dataclass(slots=True)
class ThroughputRow:
    shape: str
    requests: int
    free_tok_s: float
    constrained_tok_s: float  # every output token, forced ones too
    constrained_sampled_tok_s: float  # sampled tokens only (forced tokens are not counted)
    valid: float
    broken: int
    note: str = ""
    ratio: float = field(init=False)
    ratio_sampled: float = field(init=False)

    def __post_init__(self) -> None:
        self.ratio = self.constrained_tok_s / self.free_tok_s
        self.ratio_sampled = self.constrained_sampled_tok_s / self.free_tok_s


def _llm(*, device: str, dtype: str, backend: str, eager: bool, kv_tokens: int) -> Any:
    from structgen.attention import BACKEND_ENV_VAR
    from structgen.engine.llm import LLM

    # The variable is read when the model is built; put back afterwards so nothing else in the process sees it.
    before = os.environ.get(BACKEND_ENV_VAR)
    os.environ[BACKEND_ENV_VAR] = backend
    try:
        return LLM("tiny", device=device, dtype=dtype, enforce_eager=eager, kv_cache_tokens=kv_tokens)
    finally:
        if before is None:
            del os.environ[BACKEND_ENV_VAR]
        else:
            os.environ[BACKEND_ENV_VAR] = before


def _release(llm: Any) -> None:
    """Stop the engine's threads and give its cache back before the next engine is built (the caller drops its
    reference too)."""
    llm.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _params(shape: str, *, constrained: bool, temperature: float, seed: int | None, max_tokens: int) -> Any:
    """A request of `shape`: under its schema, or free and never ending early (the conservative baseline)."""
    from structgen.bench.structured_engine import params
    from structgen.bench.structured_shape_schemas import SHAPES

    schema = SHAPES[shape] if constrained else None
    return params(max_tokens, seed=seed, schema=schema, ignore_eos=not constrained, temperature=temperature)


def _requests(shapes: Sequence[str], per_shape: int, *, max_tokens: int, temperature: float):
    """(prompts, params, schema or None) for `per_shape` structured and as many free requests per shape."""
    from structgen.bench.structured_shape_schemas import SHAPES, prompt

    prompts, params, schemas = [], [], []
    for shape in shapes:
        for i in range(per_shape):
            for constrained in (True, False):
                prompts.append(prompt(shape, i))
                seed = 1000 + i if temperature > 0 else None
                params.append(
                    _params(
                        shape,
                        constrained=constrained,
                        temperature=temperature,
                        seed=seed,
                        max_tokens=max_tokens,
                    )
                )
                schemas.append(SHAPES[shape] if constrained else None)
    return prompts, params, schemas


def _tally(outs: Sequence[Any], schema: dict[str, Any]) -> Tally:
    """How the structured outputs ended (`Tally`: valid, and `invalid` = finished on their own yet failing the
    schema, which must be 0)."""
    from structgen.bench.structured_shape_schemas import validator

    tally, check = Tally(), validator(schema)
    for out in outs:
        tally.count(out.outputs[0].text, out.outputs[0].finish_reason, check)
    return tally


def agreement(
    *, device: str, backends: Sequence[tuple[str, str, bool]], shapes: Sequence[str], per_shape: int
) -> list[AgreementRow]:
    """Greedy float32 outputs of each (label, attention backend, eager) against the torch backend's."""
    prompts, params, schemas = _requests(shapes, per_shape, max_tokens=64, temperature=0.0)
    texts: dict[str, list[str]] = {}
    rows = []
    for label, backend, eager in backends:
        llm = _llm(device=device, dtype="float32", backend=backend, eager=eager, kv_tokens=32768)
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up: compiles, captures
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        _release(llm)
        del llm
        texts[label] = [o.outputs[0].text for o in outs]
        tallies = [_tally([o], s) for o, s in zip(outs, schemas, strict=True) if s is not None]
        valid = sum(t.valid for t in tallies) / len(tallies)
        broken = sum(t.invalid for t in tallies)
        rows.append(AgreementRow(label, len(prompts), 0.0, valid, broken, seconds))
    reference = texts[backends[-1][0]]
    for row in rows:
        same = sum(a == b for a, b in zip(texts[row.backend], reference, strict=True))
        row.same_as_torch = same / len(reference)
    return rows


def throughput(
    *, device: str, shapes: Sequence[str], requests: int, max_tokens: int, backend: str
) -> list[ThroughputRow]:
    """Per shape: `requests` constrained requests at once, then the same unconstrained (tokens/s each)."""
    from structgen.bench.structured_shape_schemas import SHAPES, prompt

    llm = _llm(
        device=device, dtype="auto", backend=backend, eager=False, kv_tokens=requests * (max_tokens + 96)
    )
    rows = []
    try:
        for shape in shapes:
            prompts = [prompt(shape, i) for i in range(requests)]

            def run(
                constrained: bool, *, shape: str = shape, prompts: list[str] = prompts
            ) -> tuple[float, list]:
                params = [
                    _params(shape, constrained=constrained, temperature=1.0, seed=i, max_tokens=max_tokens)
                    for i in range(requests)
                ]
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                return time.perf_counter() - start, outs

            run(True)  # warm-up: the grammar compiled, the graphs captured at this batch
            run(False)
            free_s, free_outs = run(False)
            con_s, con_outs = run(True)
            free_tokens = sum(len(o.outputs[0].token_ids) for o in free_outs)
            con_tokens = sum(len(o.outputs[0].token_ids) for o in con_outs)
            forced = sum(_forced_tokens(o) for o in con_outs)
            tally = _tally(con_outs, SHAPES[shape])
            rows.append(
                ThroughputRow(
                    shape,
                    requests,
                    free_tokens / free_s,
                    con_tokens / con_s,
                    (con_tokens - forced) / con_s,
                    tally.valid / requests,
                    tally.invalid,
                    note=f"{forced / max(con_tokens, 1):.0%} forced",
                )
            )
    finally:
        _release(llm)
    return rows


def _forced_tokens(out: Any) -> int:
    report = out.outputs[0].structured
    return report.forced_tokens if report is not None else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="structgen bench gpu-engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-check", action="store_true", help="the same code on the CPU, small sizes")
    parser.add_argument("--requests", type=int, default=256, help="concurrent requests per throughput run")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--shapes", help="comma-separated schema shapes (default: all)")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    from structgen.bench.structured_shape_schemas import SHAPES

    shapes = args.shapes.split(",") if args.shapes else list(SHAPES)
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"error: unknown shapes {unknown}; choose from {list(SHAPES)}", file=sys.stderr)
        return 2
    if args.cpu_check:
        device, backends, per_shape = "cpu", [("torch", "torch", True)], 1
        requests, max_tokens = 4, 48
    elif not torch.cuda.is_available():
        print("error: the engine GPU check needs CUDA (use --cpu-check on a CPU)", file=sys.stderr)
        return 2
    else:
        device, per_shape = "cuda", 4
        backends = [
            ("triton+graphs", "triton", False),
            ("triton eager", "triton", True),
            ("torch", "torch", True),
        ]
        requests, max_tokens = args.requests, args.max_tokens
    started = time.perf_counter()
    agree = agreement(device=device, backends=backends, shapes=shapes, per_shape=per_shape)
    print("\nbackend          requests  same as torch  structured valid  broken  seconds")
    for r in agree:
        print(
            f"{r.backend:<16} {r.requests:>8}  {100 * r.same_as_torch:>12.0f}%  {100 * r.structured_valid:>15.0f}%"
            f"  {r.broken:>6}  {r.seconds:>7.2f}"
        )
    rows = throughput(
        device=device, shapes=shapes, requests=requests, max_tokens=max_tokens, backend=backends[0][1]
    )
    print(
        "\nshape            requests  free tok/s  constrained tok/s  ratio  sampled-only ratio  valid  broken  note"
    )
    for r in rows:
        print(
            f"{r.shape:<16} {r.requests:>8}  {r.free_tok_s:>10.0f}  {r.constrained_tok_s:>17.0f}  {r.ratio:>5.3f}"
            f"  {r.ratio_sampled:>18.3f}  {100 * r.valid:>4.0f}%  {r.broken:>6}  {r.note}"
        )
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"\nwall time {time.perf_counter() - started:.0f} s on {name}", flush=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"agreement": [asdict(r) for r in agree], "throughput": [asdict(r) for r in rows]}, indent=2
            )
        )
    return 0 if all(r.broken == 0 for r in [*agree, *rows]) else 1
