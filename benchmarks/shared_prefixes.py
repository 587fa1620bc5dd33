"""Prompts sharing a prefix, in process on SmolLM2: what the prefix cache saves them (session 35).

    python benchmarks/shared_prefixes.py scoring [--together] [--off scores,inflight]
    python benchmarks/shared_prefixes.py burst [--off inflight]

`scoring`: multiple choice as lm-evaluation-harness asks it. 16 contexts of 300 tokens (BFCL questions and their
functions' JSON, `../shared/data/bfcl/`), each scored with each of 4 answers of 12 tokens (`prompt_logprobs=1`,
`max_tokens=1`): one request at a time, or a context's 4 requests together (`--together`). Prints the seconds,
the scored tokens and the prefix cache's hit rate.

`burst`: 32 requests arriving together, sharing a 256-token prefix (a long system prompt) and 48 tokens of their
own each, `max_tokens=1`, three times: the wall time until all have their first token, and the mean time to it.

`--off` switches this session's scheduling off in process, for the comparison in the same run: `scores` (a
scored prompt reads nothing from the cache, as before) and `inflight` (a waiting sequence does not wait for the
blocks a running prompt is computing).
"""

from __future__ import annotations

import argparse
import random
import time

from structgen.bench import shared_data
from structgen.bench.quality import documents
from structgen.config import EngineConfig
from structgen.engine import scheduler
from structgen.engine.block_manager import CachedPrefix
from structgen.engine.llm_engine import LLMEngine
from structgen.engine.sequence import Sequence
from structgen.sampling_params import SamplingParams


class _NeverWait:
    def __init__(self, *args: object) -> None:
        pass

    def add(self, seq: Sequence) -> None:
        pass

    def holds_next(self, seq: Sequence, num_cached_tokens: int) -> bool:
        return False


def switch_off(parts: set[str]) -> None:
    if "scores" in parts:
        scheduler.cached_scored_prefix = lambda bm, seq: (CachedPrefix([]), [])  # type: ignore[assignment]
    if "inflight" in parts:
        scheduler.InflightPrefixes = _NeverWait  # type: ignore[assignment,misc]


def run(engine: LLMEngine, requests: list[tuple[str, list[int]]], params: SamplingParams) -> list[float]:
    """Add `requests` together and step until they finish: each one's seconds to its output."""
    start = time.perf_counter()
    for request_id, prompt in requests:
        engine.add_request(request_id, prompt, params, stream=False)
    done = []
    while engine.has_unfinished():
        done += [time.perf_counter() - start for _ in engine.step()]
    return done


def scoring(engine: LLMEngine, *, together: bool) -> None:
    docs = [engine.tokenizer.encode(d) for d in documents(shared_data(), count=200)]
    docs = [d for d in docs if len(d) >= 320][:20]
    contexts, answers = [d[:300] for d in docs[:16]], [d[300:312] for d in docs[16:20]]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    start = time.perf_counter()
    for c, context in enumerate(contexts):
        requests = [(f"{c}-{a}", context + answer) for a, answer in enumerate(answers)]
        for group in [requests] if together else [[r] for r in requests]:
            run(engine, group, params)
    seconds = time.perf_counter() - start
    tokens = len(contexts) * sum(len(contexts[0]) + len(a) - 1 for a in answers)
    print(
        f"{len(contexts) * len(answers)} requests ({'together' if together else 'one at a time'} a context), "
        f"{tokens} scored tokens: {seconds:.2f} s, hit rate {engine.block_manager.hit_rate:.3f}"
    )


def burst(engine: LLMEngine) -> None:
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for trial in range(3):
        prefix = [rng.randrange(1000, 40000) for _ in range(256)]
        prompts = [prefix + [rng.randrange(1000, 40000) for _ in range(48)] for _ in range(32)]
        firsts = run(engine, [(f"{trial}-{i}", p) for i, p in enumerate(prompts)], params)
        print(
            f"burst {trial}: all first tokens in {max(firsts):.2f} s, mean {sum(firsts) / len(firsts):.2f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workload", choices=["scoring", "burst"])
    parser.add_argument("--together", action="store_true", help="scoring: a context's answers in one batch")
    parser.add_argument("--off", default="", help="comma-separated: scores, inflight")
    args = parser.parse_args()
    switch_off(set(filter(None, args.off.split(","))))
    engine = LLMEngine(EngineConfig(model="smollm2-135m"))
    try:
        if args.workload == "scoring":
            scoring(engine, together=args.together)
        else:
            burst(engine)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
