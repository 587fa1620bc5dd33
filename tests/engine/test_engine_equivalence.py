"""The engine's batching must not change what a request generates.

Greedy and seeded outputs of a request run alone are the reference; a mixed batch (with requests arriving
mid-run), chunked prefill, preemption forced by a tiny cache, other block sizes, prefix caching on or off and
`n > 1` forks must all reproduce them token for token.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import EngineFactory, run_all

from structgen.engine.llm_engine import LLMEngine
from structgen.engine.sequence import Sequence
from structgen.sampling_params import SamplingParams

_rng = random.Random(0)
# Ordinary token ids (no special tokens) of mixed lengths; two share a 32-token prefix for cache hits.
_shared = [_rng.randrange(1000, 50000) for _ in range(32)]
PROMPTS = [
    [_rng.randrange(1000, 50000) for _ in range(5)],
    [*_shared, *(_rng.randrange(1000, 50000) for _ in range(9))],
    [_rng.randrange(1000, 50000) for _ in range(17)],
    [_rng.randrange(1000, 50000) for _ in range(48)],
    [*_shared, *(_rng.randrange(1000, 50000) for _ in range(38))],
]
MAX_TOKENS = [12, 9, 10, 7, 11]


def greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], ignore_eos=True)


def seeded(i: int, seed: int | None = None) -> SamplingParams:
    # top_k keeps the candidates few: the random model's distribution is nearly flat over 100k tokens, where
    # the float rounding differences between batch shapes (gemv vs gemm) can move an inverse-CDF draw to a
    # neighbouring token. Batch invariance of the draw itself is what is tested, not of BLAS.
    return SamplingParams(
        temperature=0.8,
        top_k=40,
        top_p=0.95,
        seed=1000 + i if seed is None else seed,
        max_tokens=MAX_TOKENS[i],
        ignore_eos=True,
    )


def run_alone(make_engine: EngineFactory, params: list[SamplingParams]) -> list[list[int]]:
    engine = make_engine(enable_prefix_caching=False)
    results = []
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(f"alone-{i}", prompt, p)
        results.append(run_all(engine)[f"alone-{i}"].outputs[0].token_ids)
    return results


def run_batched(engine: LLMEngine, params: list[SamplingParams], *, stagger: bool = True) -> list[list[int]]:
    """Add the first half, step twice (prefills then decodes), add the rest so prefills mix with decodes."""
    half = len(PROMPTS) // 2 if stagger else len(PROMPTS)
    finished = {}
    for i in range(half):
        engine.add_request(f"r{i}", PROMPTS[i], params[i])
    for _ in range(2 if stagger else 0):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    for i in range(half, len(PROMPTS)):
        engine.add_request(f"r{i}", PROMPTS[i], params[i])
    finished.update(run_all(engine))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [finished[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def greedy_alone(make_engine: EngineFactory) -> list[list[int]]:
    outputs = run_alone(make_engine, [greedy(i) for i in range(len(PROMPTS))])
    assert [len(o) for o in outputs] == MAX_TOKENS
    return outputs


@pytest.fixture(scope="module")
def seeded_alone(make_engine: EngineFactory) -> list[list[int]]:
    return run_alone(make_engine, [seeded(i) for i in range(len(PROMPTS))])


SETTINGS = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "tiny-cache-preempts": {"kv_cache_tokens": 96},
    "block-size-4": {"block_size": 4, "kv_cache_tokens": 1024},
    "no-prefix-cache": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_batch_equals_alone(
    make_engine: EngineFactory, greedy_alone: list[list[int]], setting: str
) -> None:
    engine = make_engine(**SETTINGS[setting])
    assert run_batched(engine, [greedy(i) for i in range(len(PROMPTS))]) == greedy_alone
    stats = engine.stats()
    if setting == "tiny-cache-preempts":
        assert stats.num_preemptions > 0, "the cache was meant to be too small for the whole batch"
    if setting in ("default", "chunked-prefill"):
        assert stats.prefix_cache_hit_tokens >= 32, "the two prompts sharing a 32-token prefix hit the cache"


@pytest.mark.parametrize("setting", ["default", "tiny-cache-preempts", "chunked-prefill"])
def test_seeded_sampling_independent_of_batch(
    make_engine: EngineFactory, seeded_alone: list[list[int]], setting: str
) -> None:
    engine = make_engine(**SETTINGS[setting])
    # Unseeded requests ride along and change the batch composition at every step.
    for j in range(3):
        engine.add_request(
            f"noise-{j}", PROMPTS[j][::-1], SamplingParams(temperature=1.0, max_tokens=5 + 4 * j)
        )
    assert run_batched(engine, [seeded(i) for i in range(len(PROMPTS))]) == seeded_alone


def test_seeded_sampling_differs_by_seed(seeded_alone: list[list[int]], make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.add_request("other-seed", PROMPTS[0], seeded(0, seed=99))
    assert run_all(engine)["other-seed"].outputs[0].token_ids != seeded_alone[0]


def test_n_forks_match_single_requests_with_derived_seeds(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = PROMPTS[1]  # 41 tokens: the forks share a partially filled last block (copy-on-write)
    engine.add_request(
        "n3", prompt, SamplingParams(n=3, temperature=0.8, top_k=40, seed=7, max_tokens=8, ignore_eos=True)
    )
    out = run_all(engine)["n3"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "three samples, not three copies"
    for i, completion in enumerate(out.outputs):
        engine.add_request(
            f"single-{i}",
            prompt,
            SamplingParams(temperature=0.8, top_k=40, seed=7 + i, max_tokens=8, ignore_eos=True),
        )
        assert run_all(engine)[f"single-{i}"].outputs[0].token_ids == completion.token_ids


def test_n_greedy_forks_share_prompt_blocks(make_engine: EngineFactory) -> None:
    engine = make_engine()
    bm = engine.block_manager
    prompt = PROMPTS[1]  # 41 tokens = 2 full blocks + 1 partial block of 16
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.step()  # prefill, then the request forks into 4 samples
    assert bm.num_used_blocks == 3, "the four samples share the prompt's blocks"
    engine.step()  # each sample writes its own token: three copy the shared partial block, the last keeps it
    assert bm.num_used_blocks == 2 + 4
    out = run_all(engine)["n4"]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 1  # greedy: all four agree
    assert bm.num_free_blocks == bm.num_blocks


def record_logits(engine: LLMEngine) -> dict[tuple[str, int], torch.Tensor]:
    """Install a logits processor that keeps every sampling row's logits, keyed by (request, output index)."""
    seen: dict[tuple[str, int], torch.Tensor] = {}

    def processor(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for row, seq in enumerate(seqs):
            seen[(seq.request_id, seq.num_output_tokens)] = logits[row].clone()

    engine.logits_processor = processor
    return seen


@pytest.mark.parametrize("setting", ["chunked-prefill", "tiny-cache-preempts", "block-size-4"])
def test_every_step_logits_match_the_plain_run(make_engine: EngineFactory, setting: str) -> None:
    """Stronger than comparing tokens: every logit of every step agrees with a run without the feature."""
    params = [seeded(i) for i in range(len(PROMPTS))]
    plain = make_engine(enable_prefix_caching=False, max_num_batched_tokens=4096)
    expected = record_logits(plain)
    plain_tokens = run_batched(plain, params, stagger=False)
    engine = make_engine(**SETTINGS[setting])
    got = record_logits(engine)
    assert run_batched(engine, params) == plain_tokens
    assert got.keys() == expected.keys()
    for key, logits in expected.items():
        torch.testing.assert_close(got[key], logits, atol=1e-4, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
