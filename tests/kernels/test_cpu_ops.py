"""The native CPU kernels against their torch references, in both dtypes, plus the launchers' checks and the
no-compiler fallback. The first test in a fresh cache builds the library (~1 min on two cores)."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from kernel_helpers import torch_threads
from structgen.kernels import cpu_build, cpu_ops

from structgen.attention.torch_backend import paged_decode_attention as torch_paged_decode_attention

DTYPES = [torch.float32, torch.bfloat16]
# bf16 outputs are compared at a couple of bf16 ulps (the kernel accumulates in another order); the fused
# elementwise kernels round exactly like the tensor ops they replace, so those compare exactly in bf16.
ATTENTION_TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 8e-3}


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu_ops.available(), f"native CPU kernels did not build: {cpu_build.unavailable_reason()}"


def _paged_cache(
    lens: list[int],
    *,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)  # scattered blocks, as after preemptions and frees
    tables = torch.full((len(lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)  # -1 past each context
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used : used + n].int()
        used += n
    query = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [
        (9, 3, 64),
        (4, 4, 64),
        (8, 2, 128),
        (8, 4, 32),
        (6, 1, 48),
        (10, 1, 64),
    ],  # fixed-size paths (64, 128, 32), generic dim, group > 8
)
def test_paged_decode_attention_matches_references(
    heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    lens = [1, 15, 16, 17, 100, 257, 3]
    query, key_cache, value_cache, tables, context_lens = _paged_cache(
        lens, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype
    )
    args = dict(block_tables=tables, context_lens=context_lens, scale=dim**-0.5)
    out = cpu_ops.paged_decode_attention(query, key_cache, value_cache, **args)
    reference = cpu_ops.paged_decode_attention_reference(query, key_cache, value_cache, **args)
    torch_path = torch_paged_decode_attention(
        query, key_cache, value_cache, max_context_len=max(lens), **args
    )
    tolerance = ATTENTION_TOLERANCE[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(out.float(), torch_path.float(), atol=2 * tolerance, rtol=2 * tolerance)


def test_paged_decode_attention_writes_chosen_rows_of_a_strided_query() -> None:
    lens = [40, 5, 70]
    query, key_cache, value_cache, tables, context_lens = _paged_cache(
        lens, heads=9, kv_heads=3, dim=64, dtype=torch.float32
    )
    # The decode rows of a mixed step: rows 4, 0 and 9 of a 12-row batch; q is a view of a fused projection.
    fused = torch.randn(12, 9 * 64 + 32)
    strided = fused[:, : 9 * 64].view(12, 9, 64)
    rows = [4, 0, 9]
    strided[rows] = query
    out = torch.full_like(strided, 7.0).contiguous()
    cpu_ops.paged_decode_attention(
        strided,
        key_cache,
        value_cache,
        block_tables=tables,
        context_lens=context_lens,
        scale=0.125,
        out=out,
        rows=torch.tensor(rows, dtype=torch.int32),
    )
    expected = cpu_ops.paged_decode_attention_reference(
        query, key_cache, value_cache, block_tables=tables, context_lens=context_lens, scale=0.125
    )
    torch.testing.assert_close(out[rows], expected, atol=2e-6, rtol=2e-6)
    untouched = [i for i in range(12) if i not in rows]
    assert bool((out[untouched] == 7.0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 64), (8, 1, 64), (6, 2, 64), (8, 4, 32), (4, 1, 32)]
)
def test_rows_of_one_context_attended_together_match_one_by_one(
    heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    # A sequence's new tokens fed as rows (forced tokens): each sees one more token through the same table, and
    # the kernel attends such runs in one task; each row must get what it gets alone. Runs cross a block edge
    # (15..19), are longer than one task takes (7 rows), sit beside single rows and a row of another table
    # whose length happens to follow on.
    seqs = {"a": 19, "b": 40, "c": 7, "d": 41}
    entries = [("a", 15), ("a", 16), ("a", 17), ("a", 18), ("a", 19), ("b", 40), ("d", 41), ("c", 1)]
    entries += [("c", n) for n in range(2, 8)] + [("b", 40)]
    _, key_cache, value_cache, tables, _ = _paged_cache(
        list(seqs.values()), heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype, seed=5
    )
    index = {name: i for i, name in enumerate(seqs)}
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(len(entries), heads, dim, generator=gen).to(dtype)
    args = dict(
        block_tables=tables[[index[name] for name, _ in entries]],
        context_lens=torch.tensor([n for _, n in entries], dtype=torch.int32),
        scale=dim**-0.5,
    )
    out = cpu_ops.paged_decode_attention(rows, key_cache, value_cache, **args)
    one_by_one = torch.stack(
        [
            cpu_ops.paged_decode_attention(
                rows[i : i + 1],
                key_cache,
                value_cache,
                block_tables=args["block_tables"][i : i + 1],
                context_lens=args["context_lens"][i : i + 1],
                scale=dim**-0.5,
            )[0]
            for i in range(len(entries))
        ]
    )
    reference = cpu_ops.paged_decode_attention_reference(rows, key_cache, value_cache, **args)
    assert torch.equal(out, one_by_one)
    tolerance = ATTENTION_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), reference.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("lens", [[900, 1, 2, 1, 3, 1], [1, 1, 1, 1, 2, 700], [0, 5, 0], [333]])
def test_unequal_contexts_split_by_cost_cover_every_row_once(threads: int, lens: list[int]) -> None:
    # The tasks are cut into runs of about equal context, not of equal counts: with one long context among short
    # ones (or more threads than tasks) every row must still be attended exactly once.
    query, key_cache, value_cache, tables, context_lens = _paged_cache(
        lens, heads=4, kv_heads=2, dim=64, dtype=torch.float32
    )
    args = dict(block_tables=tables, context_lens=context_lens, scale=0.125)
    out = torch.full_like(query, float("nan"))
    with torch_threads(threads):
        cpu_ops.paged_decode_attention(query, key_cache, value_cache, out=out, **args)
    expected = cpu_ops.paged_decode_attention_reference(query, key_cache, value_cache, **args)
    live = [i for i, n in enumerate(lens) if n > 0]  # (an empty context's row is left to the caller)
    torch.testing.assert_close(out[live], expected[live], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_contexts_staged_ahead_give_the_same_rows_on_any_thread_count(dtype: torch.dtype) -> None:
    # Each thread requests the blocks of the context it takes next while computing the current one, and the
    # first a few blocks ahead of itself (cpu_context_stager.h): prefetches only, so every thread count (runs
    # cut at different places, first runs and staged ones) must give bit-equal rows, and the reference's values.
    rng = random.Random(7)
    lens = [rng.randint(1, 600) for _ in range(40)] + [0, 1500, 16, 17]
    query, key_cache, value_cache, tables, context_lens = _paged_cache(
        lens, heads=9, kv_heads=3, dim=64, dtype=dtype, seed=11
    )
    args = dict(block_tables=tables, context_lens=context_lens, scale=0.125)
    outs = []
    for threads in (1, 2, 3, 7):
        with torch_threads(threads):
            outs.append(cpu_ops.paged_decode_attention(query, key_cache, value_cache, **args))
    live = [i for i, n in enumerate(lens) if n > 0]
    for out in outs[1:]:
        assert torch.equal(out[live], outs[0][live])
    reference = cpu_ops.paged_decode_attention_reference(query, key_cache, value_cache, **args)
    tolerance = ATTENTION_TOLERANCE[dtype]
    torch.testing.assert_close(outs[0][live].float(), reference[live].float(), atol=tolerance, rtol=tolerance)


def test_paged_decode_attention_rejects_bad_calls() -> None:
    query, key_cache, value_cache, tables, context_lens = _paged_cache(
        [20], heads=4, kv_heads=2, dim=64, dtype=torch.float32
    )
    good = dict(block_tables=tables, context_lens=context_lens, scale=0.125)
    with pytest.raises(ValueError, match="query heads"):
        cpu_ops.paged_decode_attention(torch.randn(1, 3, 64), key_cache, value_cache, **good)
    with pytest.raises(ValueError, match="int32"):
        cpu_ops.paged_decode_attention(
            query, key_cache, value_cache, **{**good, "block_tables": tables.long()}
        )
    with pytest.raises(ValueError, match="query"):
        cpu_ops.paged_decode_attention(query.half(), key_cache, value_cache, **good)
    bad_table = tables.clone()
    bad_table[0, 0] = key_cache.shape[0]  # a block past the pool
    with pytest.raises(ValueError, match="out of range"):
        cpu_ops.paged_decode_attention(query, key_cache, value_cache, **{**good, "block_tables": bad_table})
    # What the kernel itself refuses before reading anything (the launcher checks nothing on the hot path).
    with pytest.raises(ValueError, match="longer than its block table"):
        too_long = torch.tensor([tables.shape[1] * 16 + 1], dtype=torch.int32)
        cpu_ops.paged_decode_attention(query, key_cache, value_cache, **{**good, "context_lens": too_long})
    with pytest.raises(ValueError, match="query rows for 1 sequences"):
        cpu_ops.paged_decode_attention(torch.randn(2, 4, 64), key_cache, value_cache, **good)
    with pytest.raises(ValueError, match="row index is out of range"):
        cpu_ops.paged_decode_attention(
            query, key_cache, value_cache, **good, rows=torch.tensor([1], dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="one dtype"):
        cpu_ops.paged_decode_attention(query, key_cache, value_cache.bfloat16(), **good)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_matches_reference_and_skips_padding(dtype: torch.dtype) -> None:
    key_cache = torch.zeros(6, 16, 3, 64, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    fused = torch.randn(5, 3 * 64 * 2 + 8)  # float32 projections into a bf16 cache convert on the way
    key, value = fused[:, : 3 * 64].view(5, 3, 64), fused[:, 3 * 64 : 6 * 64].view(5, 3, 64)
    slots = torch.tensor([17, -1, 0, 95, 40], dtype=torch.int64)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    cpu_ops.write_kv_cache(key, value, key_cache, value_cache, slots)
    cpu_ops.write_kv_cache_reference(key, value, ref_k, ref_v, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    assert int((key_cache != 0).flatten(2).any(-1).sum()) == 4  # the -1 row was not stored
    with pytest.raises(ValueError, match="past the end"):
        cpu_ops.write_kv_cache(key, value, key_cache, value_cache, torch.tensor([0, 1, 2, 3, 96]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norms_match_hf_arithmetic(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(33, 576, generator=gen) * 3).to(dtype)
    residual = torch.randn(33, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    expected_sum = residual + x
    expected = cpu_ops.rms_norm_reference(expected_sum, weight, eps=1e-5)
    tolerance = 0 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(
        cpu_ops.rms_norm(expected_sum, weight, eps=1e-5), expected, atol=tolerance, rtol=tolerance
    )
    out, summed = cpu_ops.fused_add_rms_norm(x, residual, weight, eps=1e-5)
    assert summed is residual and torch.equal(
        residual, expected_sum
    )  # the sum went into the residual in place
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_rotate_half(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    fused = torch.randn(7, 9 * 64 + 2 * 3 * 64, generator=gen).to(dtype)
    q, k = fused[:, : 9 * 64].view(7, 9, 64), fused[:, 9 * 64 : 12 * 64].view(7, 3, 64)
    angles = torch.rand(7, 1, 32, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected_q, expected_k = cpu_ops.rotary_reference(q, cos, sin), cpu_ops.rotary_reference(k, cos, sin)
    values = fused[:, 12 * 64 :].clone()
    cpu_ops.rotary_embedding_(q, k, cos, sin)
    tolerance = 0 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(q, expected_q, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k, expected_k, atol=tolerance, rtol=tolerance)
    assert torch.equal(fused[:, 12 * 64 :], values)  # v, beside q and k in the projection, is untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    x = torch.cat([torch.linspace(-100, 100, 3072).view(1, -1), torch.randn(5, 3072) * 4]).to(dtype)
    x[0, 0], x[0, 1] = float("inf"), float("-inf")
    expected = cpu_ops.silu_and_mul_reference(x)
    out = cpu_ops.silu_and_mul(x)
    # fp32: the kernel's exp is within a couple of ulps of libm's; bf16 rounds both to the same values, except
    # below x = -88 where the kernel's exp(-x) saturates and silu gives -0 instead of a value under 1e-35.
    rtol = 2e-6 if dtype == torch.float32 else 0
    torch.testing.assert_close(out, expected, atol=1e-35, rtol=rtol, equal_nan=True)


def test_launchers_reject_other_devices_and_dtypes() -> None:
    with pytest.raises(ValueError, match="float32, bfloat16"):
        cpu_ops.silu_and_mul(torch.randn(2, 8).half())
    with pytest.raises(ValueError, match=r"\[rows, 2 \* width\]"):
        cpu_ops.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.rms_norm(torch.randn(2, 8), torch.randn(4), eps=1e-5)
    with pytest.raises(ValueError, match="share a dtype"):
        cpu_ops.rotary_embedding_(
            torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 4).bfloat16(), torch.randn(2, 1, 4)
        )


def test_without_a_compiler_load_falls_back_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path
) -> None:
    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.setattr(cpu_build, "_compiler", lambda: None)
    monkeypatch.setenv("STRUCTGEN_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="structgen.kernels"):
        assert cpu_build.load() is False
        assert cpu_build.load() is False  # asked again: no second build attempt, no second line
    lines = [r for r in caplog.records if r.name == "structgen.kernels"]
    assert len(lines) == 1 and "no C++ compiler" in lines[0].getMessage()
    assert cpu_build.unavailable_reason() == "no C++ compiler found (set CXX)"
    assert not list(tmp_path.iterdir())  # nothing half-built left behind


def test_a_failing_compiler_falls_back_too(monkeypatch: pytest.MonkeyPatch, tmp_path, caplog) -> None:
    fake = tmp_path / "fake-c++"
    fake.write_text("#!/bin/sh\necho 'fatal error: no headers here' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("STRUCTGEN_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="structgen.kernels"):
        assert cpu_build.load() is False
    assert "build or load failed" in str(cpu_build.unavailable_reason())
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))


def test_switch_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.setenv(cpu_build.ENV_SWITCH, "0")
    assert cpu_build.load() is False
    assert cpu_build.unavailable_reason() == f"{cpu_build.ENV_SWITCH}=0"


def test_attention_backend_choice_follows_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from structgen.attention import TorchAttentionBackend, get_attention_backend
    from structgen.attention.cpu_backend import CpuAttentionBackend

    assert isinstance(get_attention_backend("cpu"), CpuAttentionBackend)
    monkeypatch.setattr(cpu_build, "_state", {"loaded": False, "reason": "test"})
    backend = get_attention_backend("cpu")
    assert type(backend) is TorchAttentionBackend
    with pytest.raises(ValueError, match="unavailable: test"):
        get_attention_backend("cpu", name="cpu")


def test_random_contexts_agree_with_the_torch_backend_across_many_shapes() -> None:
    rng = random.Random(3)
    for trial in range(10):
        lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
        dtype = DTYPES[trial % 2]
        query, key_cache, value_cache, tables, context_lens = _paged_cache(
            lens, heads=6, kv_heads=2, dim=64, dtype=dtype, seed=trial
        )
        args = dict(block_tables=tables, context_lens=context_lens, scale=0.125)
        out = cpu_ops.paged_decode_attention(query, key_cache, value_cache, **args)
        expected = cpu_ops.paged_decode_attention_reference(query, key_cache, value_cache, **args)
        tolerance = ATTENTION_TOLERANCE[dtype]
        torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
