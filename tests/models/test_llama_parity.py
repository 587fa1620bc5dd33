"""Logit and greedy-token parity of every model family with transformers, through the paged KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paged_harness import FAMILY_CONFIGS, PagedRunner, hf_tiny_model, load_structgen

PROMPT_LENGTHS = (5, 16, 17, 40)
DECODE_STEPS = 16
GREEDY_PROMPT_LENGTHS = (1, 3, 7, 12, 16, 17, 25, 40)


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    architecture, overrides = FAMILY_CONFIGS[request.param]
    model_dir = tmp_path_factory.mktemp(request.param)
    hf_model = hf_tiny_model(architecture, overrides, model_dir)
    return request.param, hf_model, model_dir


def _random_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_loads_the_family_it_was_saved_as(family: tuple) -> None:
    name, hf_model, model_dir = family
    model = load_structgen(model_dir)
    assert model.config.architecture == FAMILY_CONFIGS[name][0]
    assert model.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == hf_model.config.tie_word_embeddings


def test_prefill_and_decode_logits_match_transformers(family: tuple) -> None:
    _, hf_model, model_dir = family
    runner = PagedRunner(load_structgen(model_dir), block_size=16)
    sequences = [_random_tokens(n + DECODE_STEPS, seed=n) for n in PROMPT_LENGTHS]
    with torch.no_grad():
        expected = [hf_model(torch.tensor([seq])).logits[0] for seq in sequences]

    # All prompts prefill together in one step, then every sequence decodes its next token per step.
    prefill = runner.step(
        {i: seq[:n] for i, (seq, n) in enumerate(zip(sequences, PROMPT_LENGTHS, strict=True))}
    )
    for i, n in enumerate(PROMPT_LENGTHS):
        torch.testing.assert_close(prefill[i], expected[i][:n], atol=1e-4, rtol=0)
    for step in range(DECODE_STEPS - 1):
        decoded = runner.step(
            {i: [seq[n + step]] for i, (seq, n) in enumerate(zip(sequences, PROMPT_LENGTHS, strict=True))}
        )
        for i, n in enumerate(PROMPT_LENGTHS):
            torch.testing.assert_close(decoded[i][0], expected[i][n + step], atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers_generate(family: tuple) -> None:
    _, hf_model, model_dir = family
    prompts = [_random_tokens(n, seed=100 + n) for n in GREEDY_PROMPT_LENGTHS]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
            expected.append(out[0, len(prompt) :].tolist())
    assert all(len(tokens) == 32 for tokens in expected)

    got = PagedRunner(load_structgen(model_dir), block_size=16).greedy(prompts, max_new_tokens=32)
    assert got == expected


def test_bfloat16_model_tracks_float32(tmp_path: Path) -> None:
    architecture, overrides = FAMILY_CONFIGS["qwen3-qk-norm"]
    hf_tiny_model(architecture, overrides, tmp_path)
    tokens = _random_tokens(24, seed=7)
    fp32 = PagedRunner(load_structgen(tmp_path, dtype=torch.float32)).step({0: tokens})[0]
    bf16_runner = PagedRunner(load_structgen(tmp_path, dtype=torch.bfloat16))
    bf16 = bf16_runner.step({0: tokens[:20]})[0]
    for t in tokens[20:]:
        bf16 = torch.cat([bf16, bf16_runner.step({0: [t]})[0]])
    assert bf16.dtype == torch.float32  # compute_logits always hands float32 to the sampler
    assert bf16_runner.kv_caches[0][0].dtype == torch.bfloat16
    # bf16 keeps ~3 significant digits; the argmax agrees wherever fp32 has a clear winner.
    assert (bf16 - fp32).abs().max() < 0.1 * fp32.abs().max()
    clear = (fp32.topk(2).values[:, 0] - fp32.topk(2).values[:, 1]) > 0.1 * fp32.abs().max()
    assert torch.equal(bf16.argmax(-1)[clear], fp32.argmax(-1)[clear])
