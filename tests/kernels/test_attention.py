"""Triton paged attention against the torch reference: prefill, chunked prefill over cached prefixes,
decode with and without split-KV, padded requests, GQA ratios and head sizes that are not powers of two."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import attention, reference, sm_count, split_kv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def needs_cuda(test):
    """@pytest.mark.gpu, skipped cleanly where there is no CUDA device."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(skip(test))


FP32_TOL = dict(atol=2e-5, rtol=2e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)

SEQ_LENS = [1, 17, 33, 100, 129]
# A one-token prompt, a whole prompt, two chunks over cached prefixes and a decode step.
MIXED_QUERY_LENS = [1, 17, 5, 1, 60]


class Batch(NamedTuple):
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float


def fp8_cache(batch: Batch, k_scale: float = 1.0, v_scale: float = 1.0) -> Batch:
    """The batch with its cache in e4m3 as an FP8 KV cache holds it: K / k_scale and V / v_scale,
    saturated at 448."""
    k8 = (batch.k_cache.float() / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    v8 = (batch.v_cache.float() / v_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return batch._replace(k_cache=k8, v_cache=v8)


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    kv_block_size: int = 16,
    extra_query_rows: int = 0,
    seed: int = 0,
) -> Batch:
    """Random queries and a random cache whose blocks are scattered; every page, including the unused
    tail of each request's last page, holds random values, so a kernel that reads past seq_len fails."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // kv_block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, kv_block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, kv_block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    # Unused entries point far outside the cache: reading one would fault or fail loudly.
    block_tables = torch.full((len(seq_lens), max(max(blocks_per_seq), 1) + 1), 1 << 30, dtype=torch.int32)
    used = 0
    for row, count in enumerate(blocks_per_seq):
        block_tables[row, :count] = order[used : used + count]
        used += count
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    num_tokens = int(query_start_loc[-1]) + extra_query_rows
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    return Batch(
        query=query.to(DEVICE, dtype),
        k_cache=k_cache.to(DEVICE, dtype),
        v_cache=v_cache.to(DEVICE, dtype),
        block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=query_start_loc.to(DEVICE),
        scale=head_dim**-0.5,
    )


def both(batch: Batch, **hints: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Triton output, reference output); the reference runs in fp32 on the same inputs."""
    got = attention.paged_attention(*batch, **hints)
    want = reference.paged_attention(*batch)
    return got, want


# Head shapes of the mixed-batch tests: no GQA, a group of 3, and the same in bf16.
MIXED_SHAPES = pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads", "dtype"),
    [(48, 4, 4, torch.float32), (64, 6, 2, torch.float32), (64, 6, 2, torch.bfloat16)],
)


@MIXED_SHAPES
def test_mixed_prefill_chunks_and_decode_match_reference(
    head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    batch = make_batch(SEQ_LENS, MIXED_QUERY_LENS, num_heads, num_kv_heads, head_dim, dtype=dtype)
    got, want = both(batch, max_query_len=max(MIXED_QUERY_LENS))
    torch.testing.assert_close(got, want, **(FP32_TOL if dtype == torch.float32 else BF16_TOL))


@MIXED_SHAPES
def test_mixed_batch_split_into_decode_and_prompt_launches(
    head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    # Decodes (and a one-token prompt) between prompt chunks long enough for the large tile: with the
    # num_decodes hint they run in a launch of their own, the prompt chunks in another.
    seq_lens, query_lens = [1, 70, 33, 100, 129, 45], [1, 70, 1, 1, 60, 1]
    batch = make_batch(
        seq_lens, query_lens, num_heads, num_kv_heads, head_dim, dtype=dtype, extra_query_rows=3
    )
    out = torch.full_like(batch.query, 7.0)
    got = attention.paged_attention(*batch, out=out, max_query_len=70, num_decodes=4)
    want = reference.paged_attention(*batch)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got[: sum(query_lens)], want[: sum(query_lens)], **tol)
    assert bool((got[sum(query_lens) :] == 7.0).all())  # rows nobody owns are left alone


@pytest.mark.parametrize(("seq_lens", "query_lens"), [([70], [70]), ([129, 140], [129, 100])])
def test_long_prefill_spans_several_query_tiles(seq_lens: list[int], query_lens: list[int]) -> None:
    # With 3 heads per KV head these fill many query tiles; [140, 100] has a 40-token cached prefix.
    batch = make_batch(seq_lens, query_lens, 3, 1, 48)
    got, want = both(batch)
    torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("num_kv_splits", [1, 3, None])
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"), [(48, 4, 4), (64, 6, 2)])
def test_decode_matches_reference(
    num_kv_splits: int | None, head_dim: int, num_heads: int, num_kv_heads: int
) -> None:
    batch = make_batch(SEQ_LENS, [1] * len(SEQ_LENS), num_heads, num_kv_heads, head_dim)
    got, want = both(batch, max_query_len=1, max_seq_len=max(SEQ_LENS), num_kv_splits=num_kv_splits)
    torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("num_kv_splits", [4, 8])
def test_short_requests_beside_long_ones_leave_splits_empty(num_kv_splits: int) -> None:
    """A launch's split count is fixed (a CUDA graph's): requests shorter than it leave splits without
    keys, which the merge weighs at nothing; every request matches the reference."""
    seq_lens = [5, 300, 700, 1500, 256]
    batch = make_batch(seq_lens, [1] * len(seq_lens), 6, 2, 64, seed=3)
    got, want = both(batch, max_query_len=1, num_kv_splits=num_kv_splits)
    torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize(("group", "head_dim"), [(4, 80), (8, 96)])
def test_decode_gqa_ratios_and_odd_head_dims(group: int, head_dim: int) -> None:
    batch = make_batch([7, 70], [1, 1], group, 1, head_dim)
    got, want = both(batch, max_query_len=1, num_kv_splits=2)
    torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("max_query_len", [1, 4])
def test_padded_requests_and_rows_are_left_alone(max_query_len: int) -> None:
    """CUDA-graph padding: requests with seq_len 0 and query_len 0 (between and after the real ones) and
    query rows that no request owns. Their block-table rows are garbage; their output rows stay as given."""
    seq_lens = [40, 0, 23, 0, 0]
    query_lens = [max_query_len, 0, 1, 0, 0]
    batch = make_batch(seq_lens, query_lens, 6, 2, 48, extra_query_rows=3)
    owned = int(batch.query_start_loc[-1])
    sentinel = torch.full_like(batch.query, 7.0)
    got = attention.paged_attention(
        *batch, out=sentinel.clone(), max_query_len=max_query_len, num_kv_splits=4
    )
    want = reference.paged_attention(*batch, out=sentinel.clone())
    torch.testing.assert_close(got[:owned], want[:owned], **FP32_TOL)
    assert torch.equal(got[owned:], sentinel[owned:])


def test_max_query_len_is_found_when_not_given() -> None:
    batch = make_batch(SEQ_LENS, MIXED_QUERY_LENS, 6, 2, 64)
    torch.testing.assert_close(
        attention.paged_attention(*batch),
        attention.paged_attention(*batch, max_query_len=max(MIXED_QUERY_LENS)),
        atol=0.0,
        rtol=0.0,
    )


def test_writes_into_a_strided_out_and_reads_a_strided_query() -> None:
    """The model passes q as a view of the fused qkv projection, so its rows are not contiguous."""
    batch = make_batch(SEQ_LENS, MIXED_QUERY_LENS, 6, 2, 48)
    fused = torch.randn(batch.query.shape[0], 10, 48, device=DEVICE)
    fused[:, :6] = batch.query
    out = torch.zeros(batch.query.shape[0], 8, 48, device=DEVICE)[:, 1:7]
    strided = batch._replace(query=fused[:, :6])
    attention.paged_attention(*strided, out=out)
    torch.testing.assert_close(out, reference.paged_attention(*batch), **FP32_TOL)


def test_default_num_kv_splits_is_a_power_of_two_from_host_ints() -> None:
    cpu = torch.device("cpu")
    assert split_kv.default_num_kv_splits(1, 8, None, cpu) == 2
    assert split_kv.default_num_kv_splits(1, 1, None, cpu) == 16
    assert split_kv.default_num_kv_splits(1, 1, 300, cpu) == 2
    assert split_kv.default_num_kv_splits(1, 3, None, cpu) == 4  # 6 rounded down to a power of two
    assert split_kv.default_num_kv_splits(128, 8, 8192, cpu) == 1


def test_reference_accepts_the_launch_hints() -> None:
    batch = make_batch([5, 9], [1, 1], 2, 1, 16)
    plain = reference.paged_attention(*batch)
    # With max_query_len=1 the reference batches all decodes into one padded attention call.
    hinted = reference.paged_attention(*batch, max_query_len=1, max_seq_len=9, num_kv_splits=4)
    torch.testing.assert_close(plain, hinted, **FP32_TOL)


@needs_cuda
@pytest.mark.parametrize("max_query_len", [1, 100])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_gpu(max_query_len: int, group: int, dtype: torch.dtype) -> None:
    seq_lens = [1, 17, 33, 100, 129, 1000, 2050]
    query_lens = [1] * 7 if max_query_len == 1 else [1, 17, 5, 1, 60, 100, 1]
    batch = make_batch(seq_lens, query_lens, 4 * group, 4, 128, dtype=dtype)
    want = reference.paged_attention(*batch)
    got = attention.paged_attention(*batch, max_query_len=max_query_len)
    torch.testing.assert_close(got, want, **BF16_TOL)
    # The mixed batch again, its decodes in a launch of their own.
    split = attention.paged_attention(*batch, max_query_len=max_query_len, num_decodes=query_lens.count(1))
    torch.testing.assert_close(split, want, **BF16_TOL)


@needs_cuda
def test_decode_replays_in_a_cuda_graph_with_new_lengths() -> None:
    """Captured once, replayed after the lengths, block tables and queries change in place."""
    batch = make_batch([30, 0, 500, 2000], [1, 0, 1, 1], 32, 8, 128, dtype=torch.bfloat16)
    out = torch.zeros_like(batch.query)

    def step() -> None:
        attention.paged_attention(*batch, out=out, max_query_len=1, num_kv_splits=8)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # New lengths that fit the same cache and block-table width; blocks reshuffled.
    new_seq_lens = [2000, 0, 17, 520]
    order = torch.randperm(batch.k_cache.shape[0], device=DEVICE).to(torch.int32)
    used = 0
    for row, seq_len in enumerate(new_seq_lens):
        count = -(-seq_len // 16)
        batch.block_tables[row, :count] = order[used : used + count]
        used += count
    batch.seq_lens.copy_(torch.tensor(new_seq_lens, dtype=torch.int32))
    batch.query.normal_()
    graph.replay()
    want = reference.paged_attention(*batch, out=torch.zeros_like(out))
    torch.testing.assert_close(out, want, **BF16_TOL)


def test_reference_batched_decode_ignores_nan_in_unwritten_slots() -> None:
    # The KV cache is allocated uninitialised: slots past each request's length may hold NaN or inf.
    batch = make_batch([5, 17, 33], [1, 1, 1], 6, 2, 48)
    poisoned_k, poisoned_v = batch.k_cache.clone(), batch.v_cache.clone()
    block_size = poisoned_k.shape[1]
    for row, seq_len in enumerate([5, 17, 33]):
        last = int(batch.block_tables[row, (seq_len - 1) // block_size])
        poisoned_k[last, seq_len % block_size or block_size :] = float("nan")
        poisoned_v[last, seq_len % block_size or block_size :] = float("inf")
    fields = batch._asdict()
    fields.update(k_cache=poisoned_k, v_cache=poisoned_v)
    poisoned = type(batch)(**fields)
    per_request = reference.paged_attention(*batch)
    batched = reference.paged_attention(*poisoned, max_query_len=1)
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched, per_request, **FP32_TOL)


def test_reference_batched_decode_rebuilds_its_index_when_tables_change_in_place() -> None:
    # Layers of one step share the gather index; tensors edited in place between calls must not reuse it.
    batch = make_batch([5, 17, 33], [1, 1, 1], 6, 2, 48)
    first = reference.paged_attention(*batch, max_query_len=1)
    torch.testing.assert_close(first, reference.paged_attention(*batch), **FP32_TOL)
    batch.seq_lens[1] = 9  # a shorter context for request 1, same tensor object
    batch.block_tables[2, :3] = batch.block_tables[2, :3].flip(0).clone()  # its blocks in another order
    second = reference.paged_attention(*batch, max_query_len=1)
    torch.testing.assert_close(second, reference.paged_attention(*batch), **FP32_TOL)
    assert not torch.allclose(second[1], first[1]) and not torch.allclose(second[2], first[2])


@pytest.mark.parametrize("max_query_len", [1, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_reads_exactly_with_scales_folded_in(max_query_len: int | None, dtype: torch.dtype) -> None:
    # The same e4m3 values read by the kernel and by the reference (which reads them dequantized into a
    # cache of the query's dtype with scales 1): the scales must fold into the softmax and the output.
    query_lens = [1, 1, 1] if max_query_len == 1 else [1, 9, 33]
    batch = make_batch([5, 17, 33], query_lens, 6, 2, 48, dtype=dtype)
    k_scale, v_scale = 0.05, 0.3
    fp8 = fp8_cache(batch, k_scale, v_scale)
    k8, v8 = fp8.k_cache, fp8.v_cache
    dequantized = batch._replace(
        k_cache=(k8.float() * k_scale).to(dtype), v_cache=(v8.float() * v_scale).to(dtype)
    )
    hints = dict(max_query_len=max_query_len, k_scale=k_scale, v_scale=v_scale)
    want = reference.paged_attention(*dequantized)
    torch.testing.assert_close(
        reference.paged_attention(*fp8, **hints), want, **(FP32_TOL if dtype == torch.float32 else BF16_TOL)
    )
    torch.testing.assert_close(
        attention.paged_attention(*fp8, **hints), want, **(FP32_TOL if dtype == torch.float32 else BF16_TOL)
    )


def dense_attention(batch: Batch) -> torch.Tensor:
    """Float64 softmax attention written out: each request's queries over its context, the mask spelled
    as positions, the cache read block by block."""
    query, k_cache, v_cache, tables, seq_lens, starts, scale = batch
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = query.shape[1] // k_cache.shape[2]
    block = k_cache.shape[1]
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = int(starts[b]), int(starts[b + 1])
        slots = [int(tables[b, pos // block]) * block + pos % block for pos in range(seq_len)]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)  # [S, H, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        q = query[lo:hi].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        positions = torch.arange(seq_len - (hi - lo), seq_len)
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > positions[:, None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_chunks_over_a_prefix_match_dense_attention(contiguous: bool, dtype: torch.dtype) -> None:
    # Chunks of 40 and 7 queries over prefixes (two flash calls merged by log-sum-exp on a CPU), a whole
    # prompt and a decode; with blocks in cache order too (read in place, not gathered).
    batch = make_batch([300, 47, 33, 90], [40, 7, 33, 1], 6, 2, head_dim=64, dtype=dtype)
    if contiguous:
        tables = torch.arange(batch.block_tables.numel(), dtype=torch.int32).reshape(batch.block_tables.shape)
        k_cache = torch.randn(tables.numel(), *batch.k_cache.shape[1:]).to(batch.k_cache)
        batch = batch._replace(block_tables=tables, k_cache=k_cache, v_cache=torch.randn_like(k_cache))
    batch = batch._replace(**{name: getattr(batch, name).cpu() for name in Batch._fields[:-1]})
    got = reference.paged_attention(*batch)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.double(), dense_attention(batch), **tol)


def test_fp8_cache_decode_of_many_requests_takes_the_small_tile_and_matches() -> None:
    # Many short requests (_FP8_MANY_PROGRAMS programs per multiprocessor: 16 requests of 2 KV heads in
    # the interpreter, which counts 8; 264 on an H200) read an FP8 cache in 64-key tiles of two warps;
    # a few long ones in 128-key tiles.
    requests = attention._FP8_MANY_PROGRAMS * sm_count(DEVICE) // 2
    seq_lens = [(37 * i) % 190 + 1 for i in range(requests)]
    batch = make_batch(seq_lens, [1] * len(seq_lens), 8, 2, 64, dtype=torch.bfloat16)
    fp8 = fp8_cache(batch)
    k8, v8 = fp8.k_cache, fp8.v_cache
    many = len(seq_lens) * 2 / sm_count(batch.query.device)
    assert many >= attention._FP8_MANY_PROGRAMS
    assert attention.decode_config(4, 2, 1, many) == attention.TileConfig(16, 64, 2, 3)
    assert attention.decode_config(4, 2, 1, 1.0) == attention.TileConfig(16, 128, 4, 3)
    assert attention.decode_config(4, 2, 2, many) == attention.TileConfig(16, 64, 4, 3)  # bf16 cache
    dequantized = batch._replace(k_cache=k8.to(torch.bfloat16), v_cache=v8.to(torch.bfloat16))
    got = attention.paged_attention(*fp8, max_query_len=1, max_seq_len=max(seq_lens))
    torch.testing.assert_close(got, reference.paged_attention(*dequantized), **BF16_TOL)
