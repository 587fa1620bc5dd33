"""Time the batched sampler on [64, 100352] logits against a plain `torch.argmax` in the same run.

    structgen bench sampler [--batch 64] [--vocab 100352] [--iters 10] [--device cpu|cuda] [--threads N]
                            [--logprobs-mode MODE] [--json OUT]

Cases: `greedy` (every row temperature 0), `sampled` (every row temperature 1, no truncation), `mixed` (a quarter greedy, the rest a mix of temperature, top-k,
top-p, min-p, seeds, penalties over 256-token histories, logprobs), `top_p` (every row top_p=0.9), and
`top_p_flat` (the same on nearly flat logits, whose nucleus is too large for the top-k candidates and falls
back to sorting: the worst case). Logits are Gaussian with std 4: the likeliest token holds ~15% (median)
and a 0.9 nucleus 1 to 1,000 tokens (median ~480), flatter than most model steps, so most top-p rows need
the second, larger candidate set. `logprobs`: every row temperature 0.8, top_p=0.9 and 5 top logprobs, in
the sampler's `--logprobs-mode` (the raw default, or processed_logprobs: what that mode costs). Every row has 5% of its vocabulary masked to -inf, as the
structured-output mask would. Prints the median milliseconds per call and the ratio to `torch.argmax`. On the
CPU, glibc keeps freed buffers mapped as in the engine (`structgen.engine.host_memory`; before session 38 the
bench's fresh [B, V] allocations were faulted in page by page, ~2x their memory traffic).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from structgen.config import LOGPROBS_MODES
from structgen.engine.sampler import Sampler, SamplingRow, make_generator
from structgen.sampling_params import SamplingParams

_MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1),
    SamplingParams(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2),
    SamplingParams(temperature=0.6, logprobs=5),
]


def _rows(params: Sequence[SamplingParams], device: torch.device, vocab: int) -> list[SamplingRow]:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for p in params:
        history = torch.randint(0, vocab, (512,), generator=gen).tolist()
        generator = make_generator(p.seed, device) if p.seed is not None else None
        rows.append(SamplingRow(p, history[:256], history[256:], generator, frozenset({0})))
    return rows


def _time(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median milliseconds per call, after one warm-up call."""
    fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=100_352)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument(
        "--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES, help="the sampler's logprobs_mode"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write ms/call per case here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cpu":
        from structgen.engine.host_memory import keep_freed_memory

        keep_freed_memory()  # as the engine's runner does: each call's [B, V] buffers are not faulted in anew
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(args.batch, args.vocab, generator=gen) < 0.05
    logits = (torch.randn(args.batch, args.vocab, generator=gen) * 4).masked_fill_(mask, float("-inf"))
    flat = (torch.randn(args.batch, args.vocab, generator=gen) * 0.1).masked_fill_(mask, float("-inf"))
    logits, flat = logits.to(device), flat.to(device)
    sampler = Sampler(logprobs_mode=args.logprobs_mode)
    cases = {
        "greedy": (logits, [SamplingParams(temperature=0)] * args.batch),
        "sampled": (logits, [SamplingParams()] * args.batch),
        "mixed": (logits, [_MIXED[i % len(_MIXED)] for i in range(args.batch)]),
        "top_p": (logits, [SamplingParams(top_p=0.9)] * args.batch),
        "top_p_flat": (flat, [SamplingParams(top_p=0.9)] * args.batch),
        "logprobs": (logits, [SamplingParams(temperature=0.8, top_p=0.9, logprobs=5)] * args.batch),
    }
    baseline = _time(lambda: logits.argmax(dim=1).tolist(), args.iters, device)
    print(
        f"sampler on [{args.batch}, {args.vocab}] {device} (torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    print(f"{'case':<12} {'ms/call':>9} {'x argmax':>9}")
    print(f"{'argmax':<12} {baseline:9.2f} {1.0:9.2f}")
    report = {
        "device": str(device),
        "batch": args.batch,
        "vocab": args.vocab,
        "logprobs_mode": args.logprobs_mode,
        "argmax_ms": baseline,
        "cases": {},
    }
    for name, (case_logits, params) in cases.items():
        rows = _rows(params, device, args.vocab)
        ms = _time(lambda case_logits=case_logits, rows=rows: sampler(case_logits, rows), args.iters, device)
        print(f"{name:<12} {ms:9.2f} {ms / baseline:9.2f}")
        report["cases"][name] = {"ms": ms, "x_argmax": ms / baseline}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
