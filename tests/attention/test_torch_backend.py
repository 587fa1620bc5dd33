"""TorchAttentionBackend against a dense float64 reference: decode, prefill, prefill on a cached prefix, mixed
batches, GQA/MQA, half precision, and padding slots."""

from __future__ import annotations

import random

import pytest
import torch

from structgen.attention import AttentionMetadata, TorchAttentionBackend, get_attention_backend, torch_backend
from structgen.attention.backend import AttentionBackend
from structgen.attention.torch_backend import (
    GROUP_WASTE_SHARE,
    GROUP_WASTE_SLOTS,
    decode_length_groups,
    write_kv_cache,
)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[n, heads, d]` are the last n positions of a context whose keys/values are k, v `[ctx, kv_heads, d]`."""
    n, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


class Scenario:
    """Sequences with `cached` tokens already in a paged cache and `new` tokens arriving in this step."""

    def __init__(
        self,
        cached: list[int],
        new: list[int],
        *,
        heads: int = 4,
        kv_heads: int = 2,
        head_dim: int = 16,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim, self.dtype = heads, kv_heads, head_dim, dtype
        self.cached, self.new = cached, new
        contexts = [c + n for c, n in zip(cached, new, strict=True)]
        blocks_needed = [-(-c // block_size) for c in contexts]
        num_blocks = sum(blocks_needed) + 3
        pool = list(range(num_blocks))
        random.Random(seed).shuffle(pool)
        self.tables = [[pool.pop() for _ in range(n)] for n in blocks_needed]
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.key_cache = torch.randn(shape, generator=gen).to(dtype)  # garbage where nothing was written
        self.value_cache = torch.randn(shape, generator=gen).to(dtype)
        self.keys = [torch.randn(c, kv_heads, head_dim, generator=gen).to(dtype) for c in contexts]
        self.values = [torch.randn(c, kv_heads, head_dim, generator=gen).to(dtype) for c in contexts]
        self.queries = [torch.randn(n, heads, head_dim, generator=gen).to(dtype) for n in new]
        self.block_size = block_size
        for i, c in enumerate(cached):  # the cached prefix is already stored
            write_kv_cache(
                self.keys[i][:c], self.values[i][:c], self.key_cache, self.value_cache, self._slots(i, 0, c)
            )

    def _slots(self, i: int, start: int, end: int) -> torch.Tensor:
        return torch.tensor(
            [
                self.tables[i][p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            ],
            dtype=torch.int64,
        )

    def metadata(self) -> AttentionMetadata:
        contexts = [c + n for c, n in zip(self.cached, self.new, strict=True)]
        width = max(len(t) for t in self.tables)
        starts = [0]
        for n in self.new:
            starts.append(starts[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.cat(
                [self._slots(i, c, c + n) for i, (c, n) in enumerate(zip(self.cached, self.new, strict=True))]
            ),
            block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in self.tables], dtype=torch.int32),
            context_lens=torch.tensor(contexts, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(self.new),
            max_context_len=max(contexts),
            block_size=self.block_size,
            query_lens_cpu=list(self.new),
            context_lens_cpu=contexts,
        )

    def run(self, backend: AttentionBackend | None = None) -> torch.Tensor:
        """The step through `backend` (the torch backend by default)."""
        new_k = torch.cat([k[c:] for k, c in zip(self.keys, self.cached, strict=True)])
        new_v = torch.cat([v[c:] for v, c in zip(self.values, self.cached, strict=True)])
        return (backend or TorchAttentionBackend()).forward(
            torch.cat(self.queries),
            new_k,
            new_v,
            (self.key_cache, self.value_cache),
            self.metadata(),
            scale=self.head_dim**-0.5,
        )

    def expected(self) -> torch.Tensor:
        return torch.cat(
            [
                _reference(q, k, v, self.head_dim**-0.5)
                for q, k, v in zip(self.queries, self.keys, self.values, strict=True)
            ]
        )


CASES = {
    "decode": ([0, 3, 4, 7, 15, 32], [1] * 6),
    "decode-wide-batch": ([random.Random(1).randrange(0, 60) for _ in range(64)], [1] * 64),
    # Contexts far apart: attended in several length groups, each padded only to its own longest.
    "decode-spread-lengths": ([0, 41, 300, 299, 720, 1203, 2000, 7], [1] * 8),
    "prefill": ([0, 0, 0], [1, 9, 17]),
    "prefill-on-cached-prefix": ([4, 5, 13], [4, 3, 8]),
    # Cached prefixes shorter than the new tokens: causal over the whole context (zero queries in front).
    "prefill-on-short-cached-prefix": ([2, 16, 1, 5], [30, 40, 9, 6]),
    "mixed": ([11, 0, 6, 30, 2], [1, 7, 1, 5, 1]),
    "mixed-spread-lengths": ([900, 0, 6, 1500, 2, 333], [1, 7, 1, 1, 5, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_matches_dense_reference(case: str, heads: int, kv_heads: int) -> None:
    cached, new = CASES[case]
    scenario = Scenario(cached, new, heads=heads, kv_heads=kv_heads)
    torch.testing.assert_close(scenario.run().double(), scenario.expected(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_half_precision(dtype: torch.dtype, atol: float, case: str) -> None:
    scenario = Scenario(*CASES[case], dtype=dtype)
    out = scenario.run()
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), scenario.expected(), atol=atol, rtol=0)


def test_writes_new_keys_and_values_at_their_slots() -> None:
    scenario = Scenario([3, 0], [1, 6])
    scenario.run()
    for i, (c, n) in enumerate(zip(scenario.cached, scenario.new, strict=True)):
        slots = scenario._slots(i, 0, c + n)
        flat_k = scenario.key_cache.view(-1, scenario.kv_heads, scenario.head_dim)
        flat_v = scenario.value_cache.view(-1, scenario.kv_heads, scenario.head_dim)
        torch.testing.assert_close(flat_k[slots], scenario.keys[i], atol=0, rtol=0)
        torch.testing.assert_close(flat_v[slots], scenario.values[i], atol=0, rtol=0)


def test_padding_slots_are_not_written() -> None:
    key_cache = torch.zeros(2, 4, 1, 8)
    value_cache = torch.zeros(2, 4, 1, 8)
    key, value = torch.ones(3, 1, 8), torch.full((3, 1, 8), 2.0)
    write_kv_cache(key, value, key_cache, value_cache, torch.tensor([5, -1, 0]))
    flat_k, flat_v = key_cache.view(8, 8), value_cache.view(8, 8)
    written = torch.zeros(8, dtype=torch.bool)
    written[[0, 5]] = True
    assert torch.all(flat_k[written] == 1) and torch.all(flat_k[~written] == 0)
    assert torch.all(flat_v[written] == 2) and torch.all(flat_v[~written] == 0)


def test_decode_never_takes_the_per_sequence_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("decode went through the per-sequence prefill path")

    monkeypatch.setattr(TorchAttentionBackend, "_mixed", forbidden)
    for case in ("decode", "decode-spread-lengths"):
        scenario = Scenario(*CASES[case])
        torch.testing.assert_close(scenario.run().double(), scenario.expected(), atol=1e-5, rtol=1e-5)


def test_a_short_cached_prefix_goes_causal_without_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, bool, bool]] = []  # (query rows, a mask given, is_causal)
    original = torch_backend.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        calls.append((q.shape[-2], attn_mask is not None, is_causal))
        return original(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", spy)
    scenario = Scenario([0, 2, 30, 7], [9, 30, 5, 7])
    torch.testing.assert_close(scenario.run().double(), scenario.expected(), atol=1e-5, rtol=1e-5)
    # fresh: causal on its own keys; 2 cached < 30 new: causal over 32 rows (2 of them zero queries); 30 cached
    # >= 5 new and 7 >= 7: the offset mask
    assert calls == [(9, False, True), (32, False, True), (5, True, False), (7, True, False)]


def test_decode_is_one_pass_per_length_group(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = torch_backend.paged_decode_attention

    def counting(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append(query.shape[0])
        return original(query, *args, **kwargs)

    monkeypatch.setattr(torch_backend, "paged_decode_attention", counting)
    scenario = Scenario(*CASES["decode-wide-batch"])  # contexts within 128 slots of each other: one group
    scenario.run()
    assert calls == [64]
    calls.clear()
    scenario = Scenario(*CASES["decode-spread-lengths"])
    scenario.run()
    assert len(calls) == len(decode_length_groups([c + 1 for c in scenario.cached], 4)) > 1
    assert sum(calls) == 8


def test_length_groups_cover_every_sequence_once_and_bound_the_padding() -> None:
    rng = random.Random(3)
    for _ in range(200):
        lens = [rng.randint(1, 3000) for _ in range(rng.randint(1, 80))]
        groups = decode_length_groups(lens, 16)
        assert sorted(i for g in groups for i in g.seqs) == list(range(len(lens)))
        for g in groups:
            assert g.max_context_len == max(lens[i] for i in g.seqs) == lens[g.seqs[0]]
            lead = -(-g.max_context_len // 16) * 16
            for i in g.seqs:
                waste = lead - -(-lens[i] // 16) * 16
                assert waste <= max(GROUP_WASTE_SLOTS, GROUP_WASTE_SHARE * lead)
    assert len(decode_length_groups([100, 90, 5, 64], 16)) == 1  # all within 128 slots
    assert [g.seqs for g in decode_length_groups([1000, 2000, 100], 16)] == [[1], [0], [2]]


def test_get_attention_backend() -> None:
    # On the CPU the native-kernel backend (a TorchAttentionBackend for prefill) unless asked for the reference.
    backend = get_attention_backend("cpu")
    assert isinstance(backend, TorchAttentionBackend)
    assert backend.name == "cpu"
    assert get_attention_backend("cpu", name="torch").name == "torch"
    with pytest.raises(RuntimeError):
        get_attention_backend("not-a-device")


def test_decode_takes_an_attention_output_in_any_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's SDPA returns the decode's `[seqs, kv_heads, group, d]` in a layout that cannot be viewed as
    `[seqs, heads, d]` (seen on an H200: the torch backend failed at its first decode step). Here SDPA's output
    is given that kind of layout on the CPU: same values, other strides."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def strided(*args, **kwargs) -> torch.Tensor:
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # kv_heads and group swapped in memory

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", strided)
    scenario = Scenario(*CASES["decode"], heads=4, kv_heads=2)
    torch.testing.assert_close(scenario.run().double(), scenario.expected(), atol=1e-5, rtol=1e-5)
