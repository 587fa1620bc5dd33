"""The paged KV cache must be invisible in the logits: block size, physical block order, chunking of the
prefill, sharing of prefix blocks and batch composition change nothing."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner, random_structgen_model

SEQ_LEN = 70
PREFILL_LEN = 50
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return random_structgen_model("LlamaForCausalLM", seed=3)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_then_decode(runner: PagedRunner, tokens: list[int], seq: int = 0) -> torch.Tensor:
    logits = [runner.step({seq: tokens[:PREFILL_LEN]})[seq]]
    logits += [runner.step({seq: [t]})[seq] for t in tokens[PREFILL_LEN:]]
    return torch.cat(logits)


@pytest.mark.parametrize(
    ("block_size", "shuffle_seed"), [(1, None), (32, None), (16, 0), (1, 1), (32, 2)], ids=str
)
def test_block_size_and_physical_order_do_not_change_logits(model, block_size: int, shuffle_seed) -> None:
    tokens = _tokens(SEQ_LEN, seed=0)
    reference = _prefill_then_decode(PagedRunner(model, block_size=16), tokens)
    runner = PagedRunner(
        model, block_size=block_size, num_blocks=128 * 16 // block_size, shuffle_seed=shuffle_seed
    )
    # A neighbour sequence interleaves its blocks with ours in the pool.
    runner.step({1: _tokens(33, seed=1)})
    got = _prefill_then_decode(runner, tokens)
    if shuffle_seed is not None:
        table = runner.block_tables[0]
        assert table != sorted(table), "the blocks were meant to be scattered out of order"
    torch.testing.assert_close(got, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunks", [(13, 1, 20, 16, 20), (16, 16, 16, 16, 6), (1, 69)], ids=str)
def test_chunked_prefill_equals_one_shot_prefill(model, chunks: tuple[int, ...]) -> None:
    tokens = _tokens(SEQ_LEN, seed=4)
    one_shot = PagedRunner(model).step({0: tokens})[0]
    runner = PagedRunner(model, shuffle_seed=5)
    pieces, start = [], 0
    for n in chunks:  # each chunk attends to the cached earlier chunks plus itself
        pieces.append(runner.step({0: tokens[start : start + n]})[0])
        start += n
    torch.testing.assert_close(torch.cat(pieces), one_shot, atol=ATOL, rtol=0)


def test_shared_prefix_blocks_equal_recomputation(model) -> None:
    prefix, suffix = _tokens(48, seed=6), _tokens(20, seed=7)
    alone = PagedRunner(model).step({0: prefix + suffix})[0][48:]
    runner = PagedRunner(model, shuffle_seed=8)
    runner.step({0: prefix + _tokens(5, seed=9)})
    runner.share_prefix(1, source=0, num_blocks=3)  # a prefix-cache hit on 3 full blocks: nothing recomputed
    got = runner.step({1: suffix})[1]
    torch.testing.assert_close(got, alone, atol=ATOL, rtol=0)
    assert runner.block_tables[1][:3] == runner.block_tables[0][:3]


def test_mixed_batch_equals_each_sequence_alone(model) -> None:
    prompts = {
        0: _tokens(37, seed=10),
        1: _tokens(5, seed=11),
        2: _tokens(16, seed=12),
        3: _tokens(30, seed=13),
    }
    next_tokens = {1: 7, 2: 99, 3: 450}
    first_chunk = 12  # sequence 0 prefills in two chunks; its second chunk shares a step with three decodes

    expected = {}
    for seq, prompt in prompts.items():
        runner = PagedRunner(model)
        if seq == 0:
            runner.step({0: prompt[:first_chunk]})
            expected[0] = runner.step({0: prompt[first_chunk:]})[0]
        else:
            runner.step({seq: prompt})
            expected[seq] = runner.step({seq: [next_tokens[seq]]})[seq]

    runner = PagedRunner(model, shuffle_seed=14)
    runner.step({0: prompts[0][:first_chunk], **{seq: prompts[seq] for seq in next_tokens}})
    mixed = runner.step({1: [7], 0: prompts[0][first_chunk:], 2: [99], 3: [450]})
    for seq, logits in expected.items():
        torch.testing.assert_close(mixed[seq], logits, atol=ATOL, rtol=0)


def test_batched_decode_equals_one_sequence_at_a_time(model) -> None:
    prompts = [_tokens(n, seed=20 + n) for n in (1, 15, 16, 17, 40)]
    batched = PagedRunner(model, shuffle_seed=15).greedy(prompts, max_new_tokens=12)
    alone = [PagedRunner(model).greedy([prompt], max_new_tokens=12)[0] for prompt in prompts]
    assert batched == alone
