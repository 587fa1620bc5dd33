"""TritonAttentionBackend under Triton's interpreter: it matches the torch backend on decode, mixed and prefix
batches (cache contents included), backend selection honours the override, and the engine's greedy outputs on
`tiny` are the same token for token with either backend."""

from __future__ import annotations

import os

# Read when a kernel is decorated: this must happen before anything imports structgen.kernels.
os.environ["TRITON_INTERPRET"] = "1"

import random
from itertools import accumulate

import pytest
import torch

from structgen.attention import (
    BACKEND_ENV_VAR,
    AttentionMetadata,
    TorchAttentionBackend,
    get_attention_backend,
)
from structgen.attention.triton_backend import TritonAttentionBackend
from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
from structgen.engine.llm_engine import LLMEngine
from structgen.sampling_params import SamplingParams

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 32, 4


def _step(cached: list[int], new: list[int], *, padding: int = 0, seed: int = 0) -> tuple:
    """q/k/v and metadata of one step over sequences with `cached` tokens stored and `new` arriving, plus
    `padding` trailing rows of no sequence (slot -1), and a cache holding the cached prefixes."""
    gen = torch.Generator().manual_seed(seed)
    contexts = [c + n for c, n in zip(cached, new, strict=True)]
    needed = [-(-c // BLOCK_SIZE) for c in contexts]
    pool = list(range(sum(needed) + 1))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in needed]
    block_tables = torch.full((len(new), max(needed)), -1, dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    shape = (sum(needed) + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    slots = [
        tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for i, (c, n) in enumerate(zip(cached, new, strict=True))
        for p in range(c, c + n)
    ]
    num_tokens = sum(new) + padding
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1] * padding, dtype=torch.long),
        block_tables=block_tables,
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        query_start_loc=torch.tensor(list(accumulate(new, initial=0)), dtype=torch.int32),
        max_query_len=max(new),
        max_context_len=max(contexts),
        block_size=BLOCK_SIZE,
        query_lens_cpu=list(new),
        context_lens_cpu=contexts,
    )
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    return q, k, v, cache, metadata


@pytest.mark.parametrize(
    ("cached", "new", "padding"),
    [
        ([0, 3, 8, 20], [1, 1, 1, 1], 0),  # decode, incl. a one-token sequence and block boundaries
        ([0, 9, 4], [6, 1, 5], 0),  # mixed: a fresh prompt, a decode, a chunk on a cached prefix
        ([12], [3], 2),  # prefix-cache hit with padding rows
    ],
)
def test_matches_torch_backend(cached: list[int], new: list[int], padding: int) -> None:
    q, k, v, cache, metadata = _step(cached, new, padding=padding)
    torch_cache = (cache[0].clone(), cache[1].clone())
    expected = TorchAttentionBackend().forward(q, k, v, torch_cache, metadata, scale=HEAD_DIM**-0.5)
    out = TritonAttentionBackend().forward(q, k, v, cache, metadata, scale=HEAD_DIM**-0.5)
    rows = sum(new)
    torch.testing.assert_close(out[:rows], expected[:rows], atol=2e-5, rtol=2e-5)
    assert torch.equal(cache[0], torch_cache[0]) and torch.equal(cache[1], torch_cache[1])


def test_selection_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    assert isinstance(get_attention_backend("cpu"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("cuda"), TritonAttentionBackend)
    assert isinstance(get_attention_backend("cuda", name="torch"), TorchAttentionBackend)
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    assert isinstance(get_attention_backend("cpu"), TritonAttentionBackend)
    monkeypatch.setenv(BACKEND_ENV_VAR, "flash")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_attention_backend("cpu", name="triton")


def test_engine_greedy_outputs_match_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from structgen.models.loader import load_model
    from structgen.models.registry import resolve_model
    from structgen.tokenizer import Tokenizer

    model_dir = resolve_model("tiny")
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")  # the model picks its backend when it is built
    model = load_model(model_dir, dtype="float32", device="cpu")
    tokenizer = Tokenizer.from_dir(model_dir)
    attention = [layer.self_attn for layer in model.model.layers]
    assert all(isinstance(a.attn_backend, TritonAttentionBackend) for a in attention)

    prompts = ["The quick brown fox", "1, 2, 3,", "Structured outputs are"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def generate() -> list[list[int]]:
        # block_size 4 with an 8-token step budget: prompts are chunked over cached prefixes and decodes
        # run beside prefill chunks, so both kernels and their mixed use are exercised.
        config = EngineConfig(
            model="tiny",
            device="cpu",
            cache=CacheConfig(block_size=4, kv_cache_tokens=256),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8),
        )
        engine = LLMEngine(config, model=model, tokenizer=tokenizer, model_dir=model_dir)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [list(done[str(i)]) for i in range(len(prompts))]

    with_triton = generate()
    for a in attention:
        a.attn_backend = TorchAttentionBackend()
    with_torch = generate()
    assert with_triton == with_torch
    assert all(len(tokens) == 4 for tokens in with_triton)
