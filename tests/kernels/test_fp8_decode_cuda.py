"""The CUDA decode attention over an e4m3 cache (kernels/fp8_decode_attention.cu) against the torch
reference: GQA groups 1-16, head_dim 64 and 128, pages of 16 and 32 slots, lengths that end mid-tile and
mid-page, NaN bytes in the slots past each request's end, splits from one to more than a short request
has tiles, a padded request, bf16 and fp16 queries, KV scales; the route through paged_attention (with the
step's rotary and store) and PDL launches inside a CUDA graph. On a CPU with NVRTC every variant is built
for sm_89 and sm_90 and checked for spills; the numerics need a GPU (`-m gpu`)."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from transformers import LlamaConfig  # noqa: E402

from tests.kernels.test_attention import BF16_TOL, fp8_cache, make_batch  # noqa: E402
from tests.kernels.test_decode_attention import step_rotary  # noqa: E402
from tokenmill.kernels import StepRotary, attention, cuda_rtc, fp8_decode_cuda, pdl, reference  # noqa: E402
from tokenmill.kernels.fp8_decode_cuda import fp8_decode_attention, supports  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding  # noqa: E402

CUDA = torch.cuda.is_available()
FP8_CUDA = CUDA and torch.cuda.get_device_capability() >= (8, 9)
gpu = pytest.mark.skipif(not FP8_CUDA, reason="needs a CUDA device of compute capability 8.9 or later")
K_SCALE, V_SCALE = 0.05, 0.3


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
@pytest.mark.parametrize("arch", [89, 90])
def test_every_variant_compiles_without_spills(arch) -> None:
    source = fp8_decode_cuda.SOURCE.read_text()
    # Every head shape and group class, both dtypes and both stores, each tile config at least once.
    shapes = [(64, 1), (64, 8), (128, 1), (128, 4), (128, 6), (128, 12), (128, 16)]
    configs = itertools.cycle([(4, 1), (4, 2), (8, 1), (8, 2), (2, 2), (2, 1), (1, 1), (1, 2)])
    for (head_dim, group), (warps, ahead), n in zip(shapes * 2, configs, itertools.count()):
        bf16, split, rotary = n % 2, (n // 2) % 2, (n // 3) % 2
        defines = dict(HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=16, BF16=bf16, WARPS=warps, AHEAD=ahead,
                       MIN_BLOCKS=1, SPLIT=split, ROTARY=rotary, EARLY=(n // 5) % 2,
                       COS_SIN_F32=rotary * (n // 7) % 2, MERGE=split * (n // 4) % 2)  # fmt: skip
        cubin, log = cuda_rtc.compile_cubin(source, "fp8_decode_attention", arch, defines, verbose=True)
        assert cubin[:4] == b"\x7fELF", defines
        assert "0 bytes spill stores" in log and "0 bytes spill loads" in log, (defines, log)


def test_the_engines_step_rotary_fuses() -> None:
    """A decode step's rotary inputs as the engine builds them (layers/rotary.py's float32 cos/sin cache,
    int64 positions and slots as the graphs and the input batch hold them, key and value split off the QKV
    projection's output) are ones the launch rotates and stores itself. Until the fiftieth session the
    cache was float32 where the kernel took 16-bit only: every FP8 decode step ran a rotary launch a layer."""
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    rotary_embedding = RotaryEmbedding(config, head_dim=64, max_position=128)
    tokens, heads, kv_heads, head_dim = 3, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    rotary = StepRotary(
        torch.arange(tokens), rotary_embedding.cos_sin_cache, k.view(tokens, kv_heads, head_dim),
        v.view(tokens, kv_heads, head_dim), torch.arange(tokens),
    )  # fmt: skip
    assert fp8_decode_cuda.fuses_rotary(q.view(tokens, heads, head_dim), rotary)


def test_many_requests_take_one_warp_blocks(monkeypatch) -> None:
    monkeypatch.setattr(fp8_decode_cuda, "CONFIG", None)
    monkeypatch.setattr(fp8_decode_cuda, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert fp8_decode_cuda.launch_config(1, 8, cpu) == fp8_decode_cuda.FEW_REQUESTS
    assert fp8_decode_cuda.launch_config(64, 8, cpu) == fp8_decode_cuda.FEW_REQUESTS  # 512 < 4 x 132
    assert fp8_decode_cuda.launch_config(66, 8, cpu) == fp8_decode_cuda.MANY_REQUESTS
    # Many requests on a CPU's nominal 8 multiprocessors: one split.
    assert fp8_decode_cuda.default_num_splits(66, 8, 4096, cpu) == 1
    monkeypatch.setattr(fp8_decode_cuda, "CONFIG", fp8_decode_cuda.DecodeConfig(2, 2))
    assert fp8_decode_cuda.launch_config(256, 8, cpu) == fp8_decode_cuda.DecodeConfig(2, 2)


def test_tiles_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_FP8_DECODE_TILES", "2,1")
    assert fp8_decode_cuda._config_from_env() == fp8_decode_cuda.DecodeConfig(2, 1, 1)
    monkeypatch.setenv("TOKENMILL_FP8_DECODE_TILES", "4,1,3")
    assert fp8_decode_cuda._config_from_env() == fp8_decode_cuda.DecodeConfig(4, 1, 3)
    for bad in ("4", "4,x", "4,1,3,1", "0,1", "4,1,0", "4,-1"):
        monkeypatch.setenv("TOKENMILL_FP8_DECODE_TILES", bad)
        with pytest.raises(ValueError, match="TOKENMILL_FP8_DECODE_TILES"):
            fp8_decode_cuda._config_from_env()


def fp8_batch(seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16, padded=False, seed=0):
    """A decode batch (one query token a request; with `padded` a last request with none) over an e4m3
    cache whose slots past each request's end hold NaN bytes."""
    query_lens = [1] * len(seq_lens)
    if padded:
        seq_lens, query_lens = [*seq_lens, 0], [*query_lens, 0]
    batch = make_batch(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, dtype=dtype,
                       kv_block_size=block_size, extra_query_rows=1, seed=seed)  # fmt: skip
    batch = fp8_cache(batch, K_SCALE, V_SCALE)
    tables = batch.block_tables.cpu()
    for row, seq_len in enumerate(seq_lens):
        if seq_len % block_size:
            page = int(tables[row, seq_len // block_size])
            for cache in (batch.k_cache, batch.v_cache):
                cache.view(torch.uint8)[page, seq_len % block_size :] = 0x7F  # e4m3 NaN
    return batch


def check(batch, **hints) -> None:
    want = reference.paged_attention(*batch, k_scale=K_SCALE, v_scale=V_SCALE)
    out = torch.full_like(batch.query, 7.0)
    got = fp8_decode_attention(*batch, out=out, k_scale=K_SCALE, v_scale=V_SCALE, **hints)
    owned = int(batch.query_start_loc[-1])
    assert torch.isfinite(got[:owned].float()).all()
    torch.testing.assert_close(got[:owned].float(), want[:owned].float(), **BF16_TOL)
    assert bool((got[owned:] == 7.0).all())  # rows nobody owns are left alone


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 128), (8, 2, 128), (32, 8, 128), (24, 4, 128), (16, 2, 128), (12, 1, 128), (32, 2, 128),
     (16, 8, 64), (8, 1, 64)],
)  # fmt: skip
@pytest.mark.parametrize("num_kv_splits", [1, 3, 16, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(num_heads, num_kv_heads, head_dim, num_kv_splits, dtype) -> None:
    seq_lens = [1, 15, 16, 17, 100, 333, 1024, 2500]
    batch = fp8_batch(
        seq_lens, num_heads, num_kv_heads, head_dim, dtype, padded=True, seed=num_heads + head_dim
    )
    assert supports(*batch[:3], *batch[3:6])
    check(batch, num_kv_splits=num_kv_splits, max_seq_len=max(seq_lens))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (12, 1, 128), (16, 8, 64)])
@pytest.mark.parametrize("num_kv_splits", [2, 3, 16])
def test_merges_its_splits_in_the_launch(
    monkeypatch, num_heads, num_kv_heads, head_dim, num_kv_splits
) -> None:
    """MERGE: the last split block of each request's KV head merges the partials itself, splits with no
    keys (the one-key request's) among them, a padded request counting nothing; launch after launch (the
    counters zero again after each), the reference's output."""
    monkeypatch.setattr(fp8_decode_cuda, "MERGE_IN_KERNEL", True)
    seq_lens = [1, 17, 100, 333, 2500]
    batch = fp8_batch(
        seq_lens, num_heads, num_kv_heads, head_dim, torch.bfloat16, padded=True, seed=num_kv_splits
    )
    for _ in range(3):
        check(batch, num_kv_splits=num_kv_splits)
    counts = fp8_decode_cuda.merge_counts(batch.query.device, len(seq_lens) * num_kv_heads)
    assert not counts.any()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("config", [(2, 2), (4, 2), (8, 1), (8, 3), (1, 1), (1, 2), (4, 1, 3)])
def test_every_tile_config(monkeypatch, config) -> None:
    # (4, 1, 3): registers capped for three blocks a multiprocessor, which spills; still right.
    monkeypatch.setattr(fp8_decode_cuda, "CONFIG", fp8_decode_cuda.DecodeConfig(*config))
    batch = fp8_batch([1, 17, 100, 333, 2500], 32, 8, 128, torch.bfloat16, padded=True, seed=sum(config))
    for splits in (1, 3):
        check(batch, num_kv_splits=splits)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [32, 64])
def test_larger_pages(block_size) -> None:
    batch = fp8_batch(
        [3, 31, 32, 33, 700, 4097], 32, 8, 128, torch.bfloat16, block_size=block_size, seed=block_size
    )
    check(batch, num_kv_splits=4)


@gpu
@pytest.mark.gpu
def test_long_context_many_splits() -> None:
    batch = fp8_batch([32768, 20001], 32, 8, 128, torch.bfloat16, seed=5)
    for splits in (None, 32):
        check(batch, num_kv_splits=splits, max_seq_len=32768)


@gpu
@pytest.mark.gpu
def test_what_it_does_not_take() -> None:
    batch = fp8_batch([40], 8, 2, 128, torch.bfloat16)
    assert supports(*batch[:6])
    assert not supports(batch.query.float(), *batch[1:6])  # fp32 queries
    bf16_cache = batch._replace(
        k_cache=batch.k_cache.to(torch.bfloat16), v_cache=batch.v_cache.to(torch.bfloat16)
    )
    assert not supports(*bf16_cache[:6])
    wide = fp8_batch([40], 34, 2, 128, torch.bfloat16)  # a group of 17
    assert not supports(*wide[:6])
    odd = fp8_batch([40], 8, 2, 96, torch.bfloat16)
    assert not supports(*odd[:6])
    pages_of_8 = fp8_batch([40], 8, 2, 128, torch.bfloat16, block_size=8)
    assert not supports(*pages_of_8[:6])
    with pytest.raises(ValueError, match="does not take"):
        fp8_decode_attention(*odd)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_splits", [1, None])
def test_paged_attention_routes_fp8_decodes_here(monkeypatch, num_kv_splits) -> None:
    """With DECODE_CUDA on, paged_attention's decode over an e4m3 cache (the rotary and the step's store in
    the launch) gives what the Triton decode gives, and stores the step's key and value alike."""
    seq_lens = [1, 17, 64, 65, 130, 300, 2000]
    batch = fp8_batch(seq_lens, 32, 8, 128, torch.bfloat16, padded=True, seed=3)
    rotary = step_rotary(batch, 8, seed=3)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    results, calls = [], []
    real = fp8_decode_cuda.fp8_decode_attention
    monkeypatch.setattr(
        fp8_decode_cuda, "fp8_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    for on in (False, True):
        monkeypatch.setattr(fp8_decode_cuda, "DECODE_CUDA", on)
        run = batch._replace(
            query=batch.query.clone(), k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone()
        )
        out = attention.paged_attention(*run, max_query_len=1, max_seq_len=max(seq_lens),
                                        num_kv_splits=num_kv_splits, rotary=rotary, **scales)  # fmt: skip
        assert len(calls) == int(on)
        results.append((out[: len(seq_lens)].float(), run.k_cache.float(), run.v_cache.float()))
    (triton_out, triton_k, triton_v), (cuda_out, cuda_k, cuda_v) = results
    torch.testing.assert_close(cuda_out, triton_out, **BF16_TOL)
    torch.testing.assert_close(cuda_k, triton_k, equal_nan=True, **BF16_TOL)
    torch.testing.assert_close(cuda_v, triton_v, equal_nan=True, **BF16_TOL)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_a_kernel_nvrtc_cannot_build_leaves_the_decode_to_triton(monkeypatch, caplog, fused) -> None:
    """NVRTC failing for this GPU (an older library than the card, say): a warning, nothing written twice
    (the unfused rotary launch comes after the build), and the Triton decode's output and cache."""
    batch = fp8_batch([1, 17, 300, 2000], 32, 8, 128, torch.bfloat16, seed=5)
    rotary = step_rotary(batch, 8, seed=5)
    if not fused:
        rotary = rotary._replace(positions=rotary.positions.int(), slot_mapping=rotary.slot_mapping.int())
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    want_batch = batch._replace(
        query=batch.query.clone(), k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone()
    )
    monkeypatch.setattr(fp8_decode_cuda, "DECODE_CUDA", False)
    want_rotary = rotary._replace(key=rotary.key.clone())
    want = attention.paged_attention(*want_batch, max_query_len=1, rotary=want_rotary, **scales)

    def unbuildable(*args, **kwargs):
        raise cuda_rtc.CudaRtcError("fp8_decode_attention does not compile: invalid arch")

    monkeypatch.setattr(fp8_decode_cuda, "DECODE_CUDA", True)
    monkeypatch.setattr(cuda_rtc, "_kernels", {})
    monkeypatch.setattr(cuda_rtc, "compile_cubin", unbuildable)
    with caplog.at_level("WARNING", logger="tokenmill"):
        got = attention.paged_attention(*batch, max_query_len=1, rotary=rotary, **scales)
    assert not fp8_decode_cuda.DECODE_CUDA and "decoding with Triton" in caplog.text
    torch.testing.assert_close(got[:4].float(), want[:4].float(), rtol=0, atol=0)
    torch.testing.assert_close(
        batch.k_cache.float(), want_batch.k_cache.float(), equal_nan=True, rtol=0, atol=0
    )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_splits", [1, 3, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (12, 1, 128), (16, 8, 64)])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("cos_sin_dtype", [torch.float32, torch.bfloat16])
def test_rotates_and_stores_the_steps_key_itself(
    num_kv_splits, num_heads, num_kv_heads, head_dim, fused, cos_sin_dtype
) -> None:
    """With `rotary` the launch rotates the query and the step's key and stores the key and value (fused:
    int64 positions and slots; the cos/sin cache in float32 as the engine holds it, or in the query's
    dtype), or a rotary launch goes first (int32 ones): the reference's output and cache either way, the
    step's key in the first tile of a split, a later one, a page's last slot, and a padded request that
    stores nothing."""
    seq_lens = [1, 16, 17, 64, 65, 300, 2000]
    batch = fp8_batch(seq_lens, num_heads, num_kv_heads, head_dim, torch.bfloat16, padded=True, seed=head_dim)
    rotary = step_rotary(batch, num_kv_heads, seed=num_heads, cos_sin_dtype=cos_sin_dtype)
    if not fused:
        rotary = rotary._replace(positions=rotary.positions.int(), slot_mapping=rotary.slot_mapping.int())
    assert fp8_decode_cuda.fuses_rotary(batch.query, rotary) == fused
    want_batch = batch._replace(
        query=batch.query.clone(), k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone()
    )
    # The reference indexes the cache by int64 slots.
    want_rotary = rotary._replace(
        key=rotary.key.clone(), positions=rotary.positions.long(), slot_mapping=rotary.slot_mapping.long()
    )
    want = reference.paged_attention(
        *want_batch, max_query_len=1, rotary=want_rotary, k_scale=K_SCALE, v_scale=V_SCALE
    )
    got = fp8_decode_attention(
        *batch, num_kv_splits=num_kv_splits, k_scale=K_SCALE, v_scale=V_SCALE, rotary=rotary
    )
    owned = len(seq_lens)
    torch.testing.assert_close(got[:owned].float(), want[:owned].float(), **BF16_TOL)
    # The caches alike byte for byte but for the stale NaN tails (and a rounding of the rotated key apart).
    for got_cache, want_cache in ((batch.k_cache, want_batch.k_cache), (batch.v_cache, want_batch.v_cache)):
        torch.testing.assert_close(
            got_cache.float(), want_cache.float(), equal_nan=True, atol=0.07, rtol=0.07
        )
        differ = (got_cache.view(torch.uint8) != want_cache.view(torch.uint8)).sum().item()
        assert differ <= len(seq_lens) * num_kv_heads * head_dim // 20


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("rotary", [None, "fused", "launch"])
@pytest.mark.parametrize("merge", [False, True])
def test_pdl_launches_in_a_graph_read_what_the_launch_before_wrote(monkeypatch, rotary, early, merge) -> None:
    """Captured with PDL between copies that write the query and the cache and the merge after it (or in
    it, merge): replayed over new values, the graph's output follows them. With `rotary` the step's key
    and value are new each replay too, stored by the launch (fused) or by the rotary launch just before
    it, a kernel (int32 positions): the tile holding them loads after the wait, earlier keys' tiles before
    it (early)."""
    monkeypatch.setattr(pdl, "EARLY_READS", early)
    monkeypatch.setattr(fp8_decode_cuda, "MERGE_IN_KERNEL", merge)
    batch = fp8_batch([900, 3000, 77, 16], 32, 8, 128, torch.bfloat16, seed=9)
    step = step_rotary(batch, 8, seed=4) if rotary else None
    if rotary == "launch":
        step = step._replace(positions=step.positions.int(), slot_mapping=step.slot_mapping.int())
    source = batch._replace(
        query=batch.query.clone(), k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone()
    )
    source_key = step.key.clone() if step else None
    out = torch.empty_like(batch.query)
    stream = torch.cuda.Stream()

    def launch() -> None:
        batch.query.copy_(source.query)
        batch.k_cache.copy_(source.k_cache)
        if step is not None:
            step.key.copy_(source_key)
        fp8_decode_attention(*batch, out=out, num_kv_splits=4, k_scale=K_SCALE, v_scale=V_SCALE, rotary=step)

    with torch.cuda.stream(stream), pdl.in_graphs():
        for _ in range(2):  # warm-up (compiles) outside the capture
            launch()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            launch()
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        source.query.copy_(torch.randn(source.query.shape, generator=gen, device="cuda"))
        source.k_cache.copy_(
            (torch.randn(source.k_cache.shape, generator=gen, device="cuda") * 4).to(torch.float8_e4m3fn)
        )
        if step is not None:
            source_key.copy_(torch.randn(source_key.shape, generator=gen, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want_rotary = None
        if step is not None:  # the reference indexes the cache by int64 slots
            want_rotary = step._replace(
                key=source_key.clone(), positions=step.positions.long(), slot_mapping=step.slot_mapping.long()
            )
        want = reference.paged_attention(
            source.query.clone(), source.k_cache.clone(), source.v_cache.clone(), *source[3:],
            k_scale=K_SCALE, v_scale=V_SCALE, max_query_len=1, rotary=want_rotary,
        )  # fmt: skip
        torch.testing.assert_close(out[:4].float(), want[:4].float(), **BF16_TOL)
