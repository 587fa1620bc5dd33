"""Prompts sharing a prefix, in process: what the prefix cache saves them, against the scheduling before it.

    structgen bench shared-prefixes scoring [--together] [--off scores,inflight] [--model M] [--contexts 16]
    structgen bench shared-prefixes burst [--off inflight] [--model M] [--json OUT]

`scoring`: multiple choice as lm-evaluation-harness asks it. `--contexts` contexts of `--context-tokens` tokens
(BFCL questions and their functions' JSON, `../shared/data/bfcl/` or `$STRUCTGEN_DATA`), each scored with each of
4 answers of 12 tokens (`prompt_logprobs=1`, `max_tokens=1`): one request at a time, or a context's 4 together
(`--together`). Reports the seconds, the scored tokens and the prefix cache's hit rate.

`burst`: 32 requests arriving together, sharing a 256-token prefix (a long system prompt) and 48 tokens of their
own each, `max_tokens=1`, three times: the time until all have their first token, and the mean time to it.

`--off` switches session 35's scheduling off for the run, for a before/after in the same code: `scores` (a scored
prompt reads nothing from the prefix cache) and `inflight` (a waiting sequence does not wait for the blocks a
running prompt is computing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from structgen.bench import shared_data

ANSWERS = 4
ANSWER_TOKENS = 12
OFF_PARTS = ("scores", "inflight")


class _NeverWait:
    """`InflightPrefixes` with nothing in flight: every waiting sequence is admitted as before session 35."""

    def __init__(self, *args: object) -> None:
        pass

    def add(self, seq: object) -> None:
        pass

    def holds_next(self, seq: object, num_cached_tokens: int) -> bool:
        return False


@contextlib.contextmanager
def switched_off(parts: set[str]) -> Iterator[None]:
    """The scheduler without the given parts of session 35's prefix reuse, put back on leaving."""
    from structgen.engine import scheduler
    from structgen.engine.block_manager import CachedPrefix

    saved = scheduler.cached_scored_prefix, scheduler.InflightPrefixes
    if "scores" in parts:
        scheduler.cached_scored_prefix = lambda bm, seq: (CachedPrefix([]), [])  # type: ignore[assignment]
    if "inflight" in parts:
        scheduler.InflightPrefixes = _NeverWait  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        scheduler.cached_scored_prefix, scheduler.InflightPrefixes = saved


def run(engine: Any, requests: list[tuple[str, list[int]]], params: Any) -> list[float]:
    """Add `requests` together and step until they finish: each one's seconds to its output."""
    start = time.perf_counter()
    for request_id, prompt in requests:
        engine.add_request(request_id, prompt, params, stream=False)
    done: list[float] = []
    while engine.has_unfinished():
        done += [time.perf_counter() - start for _ in engine.step()]
    return done


def scoring(engine: Any, data: Path, *, contexts: int, context_tokens: int, together: bool) -> dict[str, Any]:
    from structgen.bench.quality import documents
    from structgen.sampling_params import SamplingParams

    wanted = contexts + ANSWERS
    docs = [engine.tokenizer.encode(d) for d in documents(data, count=200)]
    docs = [d for d in docs if len(d) >= context_tokens + ANSWER_TOKENS][:wanted]
    if len(docs) < wanted:
        raise SystemExit(
            f"only {len(docs)} documents hold {context_tokens + ANSWER_TOKENS} tokens, {wanted} needed"
        )
    heads = [d[:context_tokens] for d in docs[:contexts]]
    answers = [d[context_tokens : context_tokens + ANSWER_TOKENS] for d in docs[contexts:]]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    start = time.perf_counter()
    for c, head in enumerate(heads):
        requests = [(f"{c}-{a}", head + answer) for a, answer in enumerate(answers)]
        for group in [requests] if together else [[r] for r in requests]:
            run(engine, group, params)
    return {
        "requests": contexts * ANSWERS,
        "scored_tokens": contexts * ANSWERS * (context_tokens + ANSWER_TOKENS - 1),
        "seconds": time.perf_counter() - start,
        "hit_rate": engine.block_manager.hit_rate,
    }


def burst(engine: Any) -> dict[str, Any]:
    from structgen.sampling_params import SamplingParams

    rng = random.Random(0)
    vocab = min(engine.vocab_size, 40_000)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    bursts = []
    for trial in range(3):
        prefix = [rng.randrange(1000, vocab) for _ in range(256)]
        prompts = [prefix + [rng.randrange(1000, vocab) for _ in range(48)] for _ in range(32)]
        firsts = run(engine, [(f"{trial}-{i}", p) for i, p in enumerate(prompts)], params)
        bursts.append({"all_seconds": max(firsts), "mean_seconds": sum(firsts) / len(firsts)})
    return {"bursts": bursts, "hit_rate": engine.block_manager.hit_rate}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=("scoring", "burst"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--together", action="store_true", help="scoring: a context's answers in one batch")
    ap.add_argument("--contexts", type=int, default=16, help="scoring: contexts, each with 4 answers")
    ap.add_argument("--context-tokens", type=int, default=300)
    ap.add_argument("--off", default="", help="comma-separated, of: " + ", ".join(OFF_PARTS))
    ap.add_argument(
        "--data", type=Path, default=None, help="the shared data directory (default ../shared/data)"
    )
    ap.add_argument("--kv-cache-tokens", type=int, default=None, help="(default: sized from memory)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    off = set(filter(None, args.off.split(",")))
    if off - set(OFF_PARTS) or args.contexts < 1 or args.context_tokens < 2:
        ap.error(f"--off takes {', '.join(OFF_PARTS)}; --contexts >= 1 and --context-tokens >= 2")
    from structgen.config import CacheConfig, EngineConfig
    from structgen.engine.llm_engine import LLMEngine

    cache = CacheConfig(kv_cache_tokens=args.kv_cache_tokens)
    with switched_off(off):
        engine = LLMEngine(EngineConfig(model=args.model, cache=cache))
        try:
            if args.workload == "scoring":
                result = scoring(
                    engine,
                    args.data or shared_data(),
                    contexts=args.contexts,
                    context_tokens=args.context_tokens,
                    together=args.together,
                )
                print(
                    f"{args.model}, off: {sorted(off) or 'nothing'}: {result['requests']} requests "
                    f"({'together' if args.together else 'one at a time'} a context), {result['scored_tokens']} "
                    f"scored tokens: {result['seconds']:.2f} s, hit rate {result['hit_rate']:.3f}"
                )
            else:
                result = burst(engine)
                for i, b in enumerate(result["bursts"]):
                    print(
                        f"{args.model}, off: {sorted(off) or 'nothing'}: burst {i}: all first tokens in "
                        f"{b['all_seconds']:.2f} s, mean {b['mean_seconds']:.2f} s"
                    )
        finally:
            engine.shutdown()
    if args.json:
        args.json.write_text(
            json.dumps({"args": {**vars(args), "data": str(args.data), "json": None}, **result})
        )
    return 0
