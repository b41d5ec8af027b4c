"""The decode attention beside the rest (kernels/attention.py): what it reads before its PDL wait and
what after, the rotary and the K/V store in its own launch (paged_attention's `rotary`), its register
tile over other cache block sizes and FP8 caches, and the attention layer's two decode paths."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.test_attention import (  # noqa: E402
    BF16_TOL,
    DEVICE,
    FP32_TOL,
    Batch,
    fp8_cache,
    make_batch,
    needs_cuda,
)
from tokenmill.kernels import StepRotary, attention, reference  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's stand-in for the PDL wait")
@pytest.mark.parametrize("num_kv_splits", [1, 2])
@pytest.mark.parametrize("seq_len", [20, 64, 65, 100, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_this_steps_key_and_value_after_its_wait(
    monkeypatch, num_kv_splits: int, seq_len: int, dtype: torch.dtype
) -> None:
    """pdl.EARLY_READS: a decode reads its split's first key tile before the PDL wait, but this step's own
    key and value (which the launch before stores) only after it. Here the "wait" is where that store
    lands: before it the step's slot holds NaN, so a kernel that used an earlier read of it would show
    NaN (and one that kept the tile's early zeros there, a wrong output). One request and one
    KV head: each program runs whole before the next, and the store lands at the first one's wait (later
    programs see it stored, as on the GPU). The step's key in the first tile and in a later one."""
    batch = make_batch([seq_len], [1], 4, 1, 64, dtype=dtype, seed=seq_len)
    want = reference.paged_attention(*batch)
    page, slot = int(batch.block_tables[0, (seq_len - 1) // 16]), (seq_len - 1) % 16
    fresh_k, fresh_v = batch.k_cache[page, slot].clone(), batch.v_cache[page, slot].clone()
    batch.k_cache[page, slot], batch.v_cache[page, slot] = float("nan"), float("nan")
    waits = []

    def wait(PDL) -> None:
        waits.append(PDL)
        batch.k_cache[page, slot], batch.v_cache[page, slot] = fresh_k, fresh_v

    monkeypatch.setattr(attention.pdl, "EARLY_READS", True)
    monkeypatch.setattr(attention.pdl, "start", wait)
    got = attention.paged_attention(*batch, max_query_len=1, num_kv_splits=num_kv_splits)
    # Every program waited: the attention's, one a split, and the merge's, one a head.
    assert len(waits) == num_kv_splits + (4 if num_kv_splits > 1 else 0)
    torch.testing.assert_close(
        got.float(), want.float(), **(FP32_TOL if dtype == torch.float32 else BF16_TOL)
    )


def step_rotary(
    batch: Batch, num_kv_heads: int, seed: int = 0, cos_sin_dtype: torch.dtype | None = None
) -> StepRotary:
    """A decode step's rotary inputs for `batch` (request b's one query token is token b): each token at
    position seq_len - 1 with its real slot, rows past the requests' tokens (padding) at position 0 and
    slot -1; an unrotated key and a value, and a cos/sin cache of real angles."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens, _, head_dim = batch.query.shape
    seq_lens = batch.seq_lens.cpu()
    block = batch.k_cache.shape[1]
    tables = batch.block_tables.cpu()
    positions = torch.zeros(num_tokens, dtype=torch.long)
    slots = torch.full((num_tokens,), -1, dtype=torch.long)
    for b, seq_len in enumerate(seq_lens.tolist()[:num_tokens]):
        if seq_len > 0:
            positions[b] = seq_len - 1
            slots[b] = int(tables[b, (seq_len - 1) // block]) * block + (seq_len - 1) % block
    angles = torch.rand(int(seq_lens.max()) + 8, head_dim // 2, generator=gen) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    dtype = batch.query.dtype
    return StepRotary(
        positions=positions.to(DEVICE), cos_sin_cache=cos_sin.to(DEVICE, cos_sin_dtype or dtype),
        key=key.to(DEVICE, dtype),
        value=value.to(DEVICE, dtype), slot_mapping=slots.to(DEVICE),
    )  # fmt: skip


@pytest.mark.parametrize("num_kv_splits", [1, 3, None])
@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads", "dtype", "fp8"),
    [
        (64, 4, 1, torch.float32, False),
        (48, 6, 2, torch.float32, False),  # head_dim not a power of two, a group of 3
        (64, 4, 2, torch.bfloat16, False),
        (48, 6, 2, torch.bfloat16, True),  # an FP8 cache under bf16 queries
    ],
)
def test_decode_rotates_and_stores_the_steps_key_itself(
    num_kv_splits: int | None, head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, fp8: bool
) -> None:
    """paged_attention with `rotary` (the attention layer's decode): the kernel rotates the query and the
    step's key and stores the step's key and value: the same output and cache as the rotary launch and
    then attention (the reference), for keys in the first tile of a split, a later one, and padding."""
    seq_lens = [1, 17, 64, 65, 130, 300, 0]
    batch = make_batch(
        seq_lens,
        [1] * 6 + [0],
        num_heads,
        num_kv_heads,
        head_dim,
        dtype=dtype,
        extra_query_rows=1,
        seed=head_dim,
    )
    scales = {}
    if fp8:
        k_scale, v_scale = 0.05, 0.3
        batch, scales = fp8_cache(batch, k_scale, v_scale), dict(k_scale=k_scale, v_scale=v_scale)
    rotary = step_rotary(batch, num_kv_heads, seed=head_dim)
    before = batch.k_cache.flatten(0, 1).float().clone()
    want_batch = batch._replace(k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone())
    want = reference.paged_attention(*want_batch, max_query_len=1, rotary=rotary, **scales)
    got_batch = batch._replace(query=batch.query.clone())
    got = attention.paged_attention(
        *got_batch, max_query_len=1, num_kv_splits=num_kv_splits, rotary=rotary, **scales
    )
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got[:6], want[:6], **tol)
    # The step's keys and values where the rotary launch stores them, and nothing else of the cache.
    torch.testing.assert_close(got_batch.k_cache.float(), want_batch.k_cache.float(), **tol)
    torch.testing.assert_close(got_batch.v_cache.float(), want_batch.v_cache.float(), **tol)
    slots = rotary.slot_mapping[:6].cpu()
    assert not torch.equal(got_batch.k_cache.flatten(0, 1).float()[slots], before[slots])  # they were stored


@pytest.mark.parametrize("kv_block_size", [1, 8, 32])
@pytest.mark.parametrize("rotary", [False, True])
def test_decode_over_other_cache_block_sizes(kv_block_size: int, rotary: bool) -> None:
    """A decode's tiles through block tables of 1-, 8- and 32-token blocks (a tile spans several blocks,
    or a block several tiles), with and without the rotary and K/V store in its launch."""
    seq_lens = [3, 40, 129]
    batch = make_batch(seq_lens, [1] * 3, 6, 2, 64, kv_block_size=kv_block_size, seed=kv_block_size)
    step = step_rotary(batch, 2, seed=kv_block_size) if rotary else None
    want_batch = batch._replace(k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone())
    want = reference.paged_attention(*want_batch, max_query_len=1, rotary=step)
    got = attention.paged_attention(*batch, max_query_len=1, num_kv_splits=2, rotary=step)
    torch.testing.assert_close(got, want, **FP32_TOL)
    torch.testing.assert_close(batch.k_cache, want_batch.k_cache, **FP32_TOL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's stand-in for the PDL wait")
@pytest.mark.parametrize("seq_len", [20, 100])
def test_rotary_decode_reads_the_steps_query_key_and_value_after_its_wait(monkeypatch, seq_len: int) -> None:
    """With `rotary` the unrotated query, key and value come from the launch before (the QKV projection):
    read after the wait. Here they are NaN until the first program's wait (see the test above)."""
    batch = make_batch([seq_len], [1], 4, 1, 64, seed=seq_len)
    rotary = step_rotary(batch, 1, seed=seq_len)
    want = reference.paged_attention(
        *batch._replace(k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone()), rotary=rotary
    )
    inputs = [batch.query, rotary.key, rotary.value]
    saved = [x.clone() for x in inputs]
    for x in inputs:
        x.fill_(float("nan"))

    def wait(PDL) -> None:
        for x, value in zip(inputs, saved, strict=True):
            x.copy_(value)

    monkeypatch.setattr(attention.pdl, "EARLY_READS", True)
    monkeypatch.setattr(attention.pdl, "start", wait)
    got = attention.paged_attention(*batch, max_query_len=1, num_kv_splits=2, rotary=rotary)
    torch.testing.assert_close(got, want, **FP32_TOL)


def test_rotary_outside_decodes_runs_the_rotary_launch_first() -> None:
    """A step with longer queries takes `rotary` too: the separate launch rotates and stores, then the
    prompt kernel attends, as the reference does."""
    seq_lens, query_lens = [9, 30], [9, 4]
    batch = make_batch(seq_lens, query_lens, 4, 2, 64)
    gen = torch.Generator().manual_seed(1)
    tokens = sum(query_lens)
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens, strict=True)])
    tables, block = batch.block_tables.cpu(), batch.k_cache.shape[1]
    starts = [0, 9]
    slots = torch.tensor(
        [
            int(tables[b, int(p) // block]) * block + int(p) % block
            for b in range(2)
            for p in positions[starts[b] : starts[b] + query_lens[b]]
        ]
    )
    angles = torch.rand(40, 32, generator=gen) * 6.3
    rotary = StepRotary(
        positions.to(DEVICE), torch.cat((angles.cos(), angles.sin()), -1).to(DEVICE),
        torch.randn(tokens, 2, 64, generator=gen).to(DEVICE),
        torch.randn(tokens, 2, 64, generator=gen).to(DEVICE), slots.to(DEVICE),
    )  # fmt: skip
    want_batch = batch._replace(k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone())
    want = reference.paged_attention(*want_batch._replace(query=batch.query.clone()), rotary=rotary)
    got = attention.paged_attention(*batch, max_query_len=9, rotary=rotary)
    torch.testing.assert_close(got, want, **FP32_TOL)
    torch.testing.assert_close(batch.k_cache, want_batch.k_cache, **FP32_TOL)


@pytest.mark.parametrize("num_kv_splits", [1, 3, None])
def test_fp8_decode_over_long_splits(num_kv_splits: int | None) -> None:
    """An FP8 cache's decode tile is 128 keys but its register tile (the newest keys) 64: the keys before
    it are whole tiles and then what is left of one, against the reference."""
    batch = make_batch([5, 130, 300, 700], [1] * 4, 6, 2, 48, dtype=torch.bfloat16, seed=7)
    k_scale, v_scale = 0.05, 0.3
    fp8 = fp8_cache(batch, k_scale, v_scale)
    hints = dict(max_query_len=1, k_scale=k_scale, v_scale=v_scale)
    want = reference.paged_attention(*fp8, **hints)
    got = attention.paged_attention(*fp8, num_kv_splits=num_kv_splits, **hints)
    torch.testing.assert_close(got, want, **BF16_TOL)


@pytest.mark.slow  # attention.FP8_PAIR_LOADS is off by default (timed, no gain: docs/performance.md)
@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize(("head_dim", "seq_lens"), [(128, [700, 5, 300]), (64, [130, 1000]), (48, [300])])
def test_fp8_pair_loads_read_what_the_byte_loads_read(
    monkeypatch, num_kv_splits: int, head_dim: int, seq_lens: list[int]
) -> None:
    """attention.FP8_PAIR_LOADS: a decode's whole tiles over an e4m3 cache read as 16-bit pairs widened in
    registers (attention_tiles.fp8_pair_words, widen_pairs) give what the tiles read value by value give
    (the same fp16 operands: bit for bit in the interpreter): the newest keys' register tile with the
    step's own key put in, the whole tiles before it and the masked remainder; a padded head dim (48)
    keeps the value-by-value reads."""
    batch = make_batch(seq_lens, [1] * len(seq_lens), 8, 2, head_dim, dtype=torch.bfloat16, seed=head_dim)
    k_scale, v_scale = 0.05, 0.3
    fp8 = fp8_cache(batch, k_scale, v_scale)
    hints = dict(max_query_len=1, k_scale=k_scale, v_scale=v_scale, num_kv_splits=num_kv_splits)
    values = attention.paged_attention(*fp8, **hints)
    monkeypatch.setattr(attention, "FP8_PAIR_LOADS", True)
    pairs = attention.paged_attention(*fp8, **hints)
    if DEVICE == "cpu":
        assert torch.equal(pairs, values)
    else:
        torch.testing.assert_close(pairs, values, **FP32_TOL)
    torch.testing.assert_close(pairs, reference.paged_attention(*fp8, max_query_len=1, k_scale=k_scale,
                                                               v_scale=v_scale), **BF16_TOL)  # fmt: skip
    # A decode that rotates and stores the step's key itself puts its words into the tile.
    rotary = step_rotary(fp8, 2, seed=head_dim)
    outputs = []
    for on in (False, True):
        monkeypatch.setattr(attention, "FP8_PAIR_LOADS", on)
        # (A decode may leave the query and key rotated in place, as the reference says: fresh copies a run.)
        run = fp8._replace(query=fp8.query.clone(), k_cache=fp8.k_cache.clone(), v_cache=fp8.v_cache.clone())
        step = rotary._replace(key=rotary.key.clone())
        outputs.append((attention.paged_attention(*run, rotary=step, **hints), run.k_cache, run.v_cache))
    (values, k_values, v_values), (pairs, k_pairs, v_pairs) = outputs
    assert torch.equal(k_pairs.view(torch.uint8), k_values.view(torch.uint8))
    assert torch.equal(v_pairs.view(torch.uint8), v_values.view(torch.uint8))
    if DEVICE == "cpu":
        assert torch.equal(pairs, values)
    else:
        torch.testing.assert_close(pairs, values, **FP32_TOL)


@pytest.mark.parametrize("fused", [True, False])
def test_the_attention_layer_decodes_with_the_rotary_in_its_launch(monkeypatch, fused: bool) -> None:
    """layers/attention.py: a decode step (one query token a request) hands the rotary and the K/V store
    to the attention launch (DECODE_ROTARY), a prompt step does not; the Triton layer's outputs and cache
    match the torch one's either way."""
    from types import SimpleNamespace

    from tokenmill.kernels import _kernels_for
    from tokenmill.layers import attention as attention_layer
    from tokenmill.layers.attention import Attention, AttentionMetadata
    from tokenmill.layers.rotary import RotaryEmbedding

    monkeypatch.setattr(attention_layer, "DECODE_ROTARY", fused)
    config = SimpleNamespace(rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512)
    heads, kv_heads, dim = 4, 2, 64
    layers, launches = {}, []
    for backend in ("triton", "torch"):
        kernels = _kernels_for(DEVICE, backend)
        with torch.device(DEVICE):  # the rotary's cos/sin table too
            layer = Attention(
                heads, kv_heads, dim, dim**-0.5, kernels, RotaryEmbedding(config, dim, 512, kernels)
            )
        if backend == "triton":  # count the separate rotary launches
            separate = kernels.rotary_and_write_kv_cache
            layer.kernels = kernels._replace(
                rotary_and_write_kv_cache=lambda *args, separate=separate, **kw: (
                    launches.append(1),
                    separate(*args, **kw),
                )[1]
            )
        layer.k_cache = torch.zeros(8, 16, kv_heads, dim, device=DEVICE)
        layer.v_cache = torch.zeros(8, 16, kv_heads, dim, device=DEVICE)
        layers[backend] = layer
    gen = torch.Generator().manual_seed(0)
    tables = torch.tensor([[3, 5, 0], [1, 2, 4]], dtype=torch.int32)
    # A prompt of 20 and one of 30 tokens, then a decode step of each.
    steps = [([20, 30], [20, 30]), ([21, 31], [1, 1])]
    for seq_lens, query_lens in steps:
        positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens, strict=True)])
        requests = torch.cat([torch.full((q,), b) for b, q in enumerate(query_lens)])
        slots = tables[requests, positions // 16].long() * 16 + positions % 16
        md = AttentionMetadata(
            slot_mapping=slots.to(DEVICE), block_tables=tables.to(DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor([0, query_lens[0], sum(query_lens)], device=DEVICE).int(),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), num_decodes=query_lens.count(1),
        )  # fmt: skip
        q, k, v = (
            torch.randn(len(positions), n, dim, generator=gen).to(DEVICE) for n in (heads, kv_heads, kv_heads)
        )
        positions = positions.to(DEVICE)
        got = layers["triton"].attend(q.clone(), k.clone(), v.clone(), md, positions=positions)
        want = layers["torch"].attend(q.clone(), k.clone(), v.clone(), md, positions=positions)
        torch.testing.assert_close(got, want, **FP32_TOL)
    torch.testing.assert_close(layers["triton"].k_cache, layers["torch"].k_cache, **FP32_TOL)
    torch.testing.assert_close(layers["triton"].v_cache, layers["torch"].v_cache, **FP32_TOL)
    assert len(launches) == (1 if fused else 2)  # the prompt's; the decode's too unless fused


@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_decode_after_pdl_launches_in_a_graph_matches_eager(fp8: bool, fused: bool) -> None:
    """A decode step as the graphs run it: the query, key and value written by launches just before (a
    norm each, with PDL), then the rotary and K/V store and attention (in one launch when fused), reading
    their metadata and earlier keys before their PDL waits (pdl.EARLY_READS). The step's slots hold NaN
    before each run, so a read of them before the store lands would show. Replayed, it matches the same
    launches run eagerly (no PDL), output and cache, bit for bit."""
    from tokenmill.kernels import norm, rotary

    batch = make_batch([300, 17, 64, 1], [1] * 4, 32, 8, 128, dtype=torch.bfloat16, seed=5)
    if fp8:
        batch = batch._replace(
            k_cache=(batch.k_cache.float() * 4).to(torch.float8_e4m3fn),
            v_cache=(batch.v_cache.float() * 4).to(torch.float8_e4m3fn),
        )
    scales = dict(k_scale=0.25, v_scale=0.25) if fp8 else {}
    step = step_rotary(batch, 8, seed=5)
    raw = [torch.randn(4, n * 128, device=DEVICE, dtype=torch.bfloat16) for n in (32, 8, 8)]
    weight = torch.rand(128, device=DEVICE, dtype=torch.bfloat16) + 0.5
    slots = step.slot_mapping.long()
    out = torch.zeros_like(batch.query)

    def run() -> None:
        q, k, v = (norm.rms_norm(x.view(4, -1, 128), weight, 1e-6) for x in raw)
        rot = step._replace(key=k, value=v)
        if fused:
            attention.paged_attention(
                q, *batch[1:], out=out, max_query_len=1, num_kv_splits=8, rotary=rot, **scales
            )
        else:
            q, _ = rotary.rotary_and_write_kv_cache(
                step.positions, q, k, v, step.cos_sin_cache, batch.k_cache, batch.v_cache, slots, **scales
            )
            attention.paged_attention(q, *batch[1:], out=out, max_query_len=1, num_kv_splits=8, **scales)

    def poison() -> None:  # NaN in the step's slots (e4m3's NaN byte is 0x7F)
        for cache in (batch.k_cache, batch.v_cache):
            if fp8:
                cache.view(torch.uint8).view(-1, 8, 128)[slots] = 0x7F
            else:
                cache.view(-1, 8, 128)[slots] = float("nan")

    poison()
    run()
    torch.cuda.synchronize()
    want, want_k = out.clone(), batch.k_cache.clone()
    assert torch.isfinite(want.float()).all()
    graph = pdl_graph(run)
    for _ in range(3):
        poison()
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert torch.equal(batch.k_cache.view(torch.uint8), want_k.view(torch.uint8))


def pdl_graph(run) -> torch.cuda.CUDAGraph:
    """run() captured in a CUDA graph with PDL, after a run that compiles its PDL variants (nothing may
    compile while a stream captures)."""
    from tokenmill.kernels import pdl

    graph = torch.cuda.CUDAGraph()
    with pdl.in_graphs():
        run()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            run()
    return graph
