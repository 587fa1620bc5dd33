"""Decode tokens/s of an offline `LLM` called from another thread than the one that created it, against the
previous behaviour in the same run.

    structgen bench llm-thread [--model smollm2-135m] [--tokens 128] [--repeats 3] [--rounds 2] [--threads N]
                               [--json OUT]

Three sides, each a greedy single stream of `--tokens` tokens, measured `--repeats` times after a warm-up in a
fresh process of its own (a process that ran the other sides would hold their OpenMP teams too), sides taking
turns for `--rounds` rounds; tokens/s, median of every run of a side:
- `same thread`: `LLM` created and called on the main thread (what most scripts do);
- `worker thread`: `LLM` created on the main thread, called from a `ThreadPoolExecutor` thread (a web
  framework's worker, a pool);
- `before`: an `LLMEngine` built on the main thread and stepped from a worker thread, as `LLM` did before it
  had a step thread of its own (`structgen.engine.step_thread`): two OpenMP teams, libgomp's throttled wait.
The ratio worth reading is `worker thread` / `before`; `worker thread` / `same thread` should be ~1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPT = "Write a long story about a dragon who learns to cook."
SIDES = ("same thread", "worker thread", "before")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="measured runs a process, after a warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="processes a side, the sides taking turns")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1 or args.rounds < 1:
        parser.error("--tokens, --repeats and --rounds must be >= 1")
    if args.side is not None:
        print(json.dumps(_measure(args)))
        return 0
    results: dict[str, list[float]] = {side: [] for side in SIDES}
    threads = None
    for _ in range(args.rounds):
        for side in SIDES:
            child = _child(args, side)
            results[side] += child["tokens_per_s"]
            threads = child["threads"]
    medians = {side: statistics.median(values) for side, values in results.items()}
    print(
        f"{args.model}, {args.tokens} tokens greedy, {threads} threads, {args.rounds} x {args.repeats} runs a side"
    )
    print(f"{'side':<14} {'tok/s':>8}  runs")
    for side, values in results.items():
        print(f"{side:<14} {medians[side]:8.1f}  {', '.join(f'{v:.1f}' for v in values)}")
    ratio = medians["worker thread"] / medians["before"]
    print(f"worker thread / before: {ratio:.2f}x")
    if args.json:
        report = {"model": args.model, "tokens": args.tokens, "threads": threads, "runs": results}
        args.json.write_text(json.dumps({**report, "median": medians, "ratio": ratio}, indent=2))
    return 0


def _child(args: argparse.Namespace, side: str) -> dict[str, object]:
    command = [sys.executable, "-m", "structgen.bench.llm_thread", "--side", side, "--model", args.model]
    command += ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {side!r} process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure(args: argparse.Namespace) -> dict[str, object]:
    """One side in this (fresh) process: a warm-up, then `--repeats` timed generations."""
    import torch

    from structgen.config import CacheConfig, EngineConfig
    from structgen.engine.llm import LLM
    from structgen.engine.llm_engine import LLMEngine
    from structgen.sampling_params import SamplingParams

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    cache_tokens = 4 * (args.tokens + 64)
    if args.side == "before":
        engine = LLMEngine(EngineConfig(model=args.model, cache=CacheConfig(kv_cache_tokens=cache_tokens)))
        ids = iter(range(1 << 30))

        def generate() -> int:  # the old `LLM._run`, on whichever thread calls
            request_id = f"before-{next(ids)}"
            engine.add_request(request_id, PROMPT, params)
            while True:
                for out in engine.step():
                    if out.request_id == request_id and out.finished:
                        return len(out.outputs[0].token_ids)

        shutdown = engine.shutdown
    else:
        llm = LLM(args.model, kv_cache_tokens=cache_tokens)

        def generate() -> int:
            return len(llm.generate(PROMPT, params)[0].outputs[0].token_ids)

        shutdown = llm.shutdown
    with ThreadPoolExecutor(1) as worker:
        run: Callable[[], float]
        if args.side == "same thread":
            run = lambda: _tokens_per_s(generate)  # noqa: E731
        else:
            run = lambda: worker.submit(_tokens_per_s, generate).result()  # noqa: E731
        run()  # warm-up: first-step allocations, the prompt's blocks
        rates = [run() for _ in range(args.repeats)]
    shutdown()
    return {"tokens_per_s": rates, "threads": torch.get_num_threads()}


def _tokens_per_s(generate: Callable[[], int]) -> float:
    start = time.perf_counter()
    tokens = generate()
    return tokens / (time.perf_counter() - start)


if __name__ == "__main__":
    sys.exit(main())
