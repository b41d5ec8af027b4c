"""A head-major KV cache (TOKENMILL_KV_LAYOUT=hnd: a KV head's slots of a block side by side, the tensor's
shape unchanged) read and written by the Triton kernels through its strides: the same results as the
token-major cache, bit for bit (CPU: the Triton interpreter; GPU with `-m gpu`); the block rows that
offload and disaggregation move are the same logical bytes; the knob's errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.test_attention import DEVICE, fp8_cache, make_batch  # noqa: E402
from tokenmill.kernels import attention, kv_cache, rotary  # noqa: E402
from tokenmill.worker import kv_layout  # noqa: E402
from tokenmill.worker.kv_offload import BlockRows  # noqa: E402


def head_major(cache: torch.Tensor) -> torch.Tensor:
    copy = kv_layout.empty_kv_cache(*cache.shape, cache.dtype, cache.device, "hnd")
    copy.copy_(cache)
    assert copy.stride(2) == cache.shape[1] * cache.shape[3] and copy.stride(1) == cache.shape[3]
    return copy


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 17, 5]])
def test_attention_over_a_head_major_cache_is_the_same(fp8, query_lens) -> None:
    batch = make_batch([1, 40, 70], query_lens, 6, 2, 64, dtype=torch.bfloat16)
    if fp8:
        batch = fp8_cache(batch, 0.5, 0.25)
    hints = dict(k_scale=0.5, v_scale=0.25) if fp8 else {}
    want = attention.paged_attention(*batch, **hints)
    hm = batch._replace(k_cache=head_major(batch.k_cache), v_cache=head_major(batch.v_cache))
    got = attention.paged_attention(*hm, **hints)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fp8", [False, True])
def test_stores_into_a_head_major_cache_land_where_the_token_major_ones_do(fp8) -> None:
    torch.manual_seed(0)
    blocks, block_size, heads, dim, tokens = 5, 16, 2, 64, 7
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    caches = [torch.zeros(blocks, block_size, heads, dim, device=DEVICE).to(dtype) for _ in range(2)]
    hm = [head_major(c) for c in caches]
    key, value = (torch.randn(tokens, heads, dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.tensor([3, 17, 18, 40, -1, 79, 64], device=DEVICE)
    kv_cache.write_kv_cache(key, value, *caches, slots, 0.5, 0.25)
    kv_cache.write_kv_cache(key, value, *hm, slots, 0.5, 0.25)
    for a, b in zip(caches, hm, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # And the rotary launch that stores the rotated key.
    positions = torch.arange(tokens, device=DEVICE) + 5
    cos_sin = torch.randn(32, dim, device=DEVICE, dtype=torch.bfloat16)
    outs = []
    for pair in (caches, hm):
        query = torch.ones(tokens, 6, dim, device=DEVICE, dtype=torch.bfloat16)
        outs.append(rotary.rotary_and_write_kv_cache(positions, query, key.clone(), value, cos_sin, *pair,
                                                     slots, 0.5, 0.25))  # fmt: skip
    for a, b in zip(caches, hm, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert all(torch.equal(x, y) for x, y in zip(*outs, strict=True))


class _Layer:
    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k, v


def test_block_rows_are_the_same_logical_bytes() -> None:
    """Offload and disaggregation move a block as rows: a head-major engine's rows are a token-major
    one's, so the two may exchange blocks."""
    torch.manual_seed(1)
    k, v = (torch.randn(6, 16, 2, 8, device=DEVICE).to(torch.float8_e4m3fn) for _ in range(2))
    token_major, heads_first = (
        BlockRows([_Layer(k, v)], DEVICE),
        BlockRows([_Layer(head_major(k), head_major(v))], DEVICE),
    )
    rows = token_major.gather([4, 1])
    assert torch.equal(heads_first.gather([4, 1]), rows)
    blank = [kv_layout.empty_kv_cache(6, 16, 2, 8, torch.float8_e4m3fn, DEVICE, "hnd") for _ in range(2)]
    into = BlockRows([_Layer(*blank)], DEVICE)
    into.scatter(rows, [0, 5])
    assert torch.equal(blank[0][0].view(torch.uint8), k[4].view(torch.uint8))
    assert torch.equal(blank[1][5].view(torch.uint8), v[1].view(torch.uint8))


def test_the_layout_knob(monkeypatch) -> None:
    """auto (the default): head-major for an FP8 cache under the GPU kernels, token-major otherwise; hnd
    refused where the torch reference kernels run (a CPU, or TOKENMILL_ATTENTION_BACKEND=torch)."""
    from tokenmill.kernels import BACKEND_ENV

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    monkeypatch.delenv(kv_layout.ENV, raising=False)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert kv_layout.kv_cache_layout(cpu, fp8) == kv_layout.kv_cache_layout(cpu, bf16) == "nhd"
    assert kv_layout.kv_cache_layout(gpu, fp8) == "hnd"
    assert kv_layout.kv_cache_layout(gpu, bf16) == "nhd"
    monkeypatch.setenv(kv_layout.ENV, "nhd")
    assert kv_layout.kv_cache_layout(gpu, fp8) == "nhd"
    monkeypatch.setenv(kv_layout.ENV, "hnd")
    with pytest.raises(ValueError, match="TOKENMILL_KV_LAYOUT=hnd needs a CUDA device"):
        kv_layout.kv_cache_layout(cpu, bf16)
    assert kv_layout.kv_cache_layout(gpu, bf16) == "hnd"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    with pytest.raises(ValueError, match="TOKENMILL_KV_LAYOUT=hnd needs a CUDA device and its Triton"):
        kv_layout.kv_cache_layout(gpu, fp8)
    monkeypatch.delenv(kv_layout.ENV)
    assert kv_layout.kv_cache_layout(gpu, fp8) == "nhd"
    monkeypatch.setenv(kv_layout.ENV, "HND ")
    with pytest.raises(ValueError, match="TOKENMILL_KV_LAYOUT='HND '"):
        kv_layout.kv_cache_layout(cpu, fp8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_an_engine_on_a_head_major_cache_writes_the_same_tokens(
    monkeypatch, llama_head_dim_64_dir, kv_cache_dtype
) -> None:
    """The whole engine (prefill, decode graphs, the CUDA FP8 decode: 64-wide heads, which it takes) on
    each layout: the same greedy tokens, and the cache allocated as asked."""
    from tests.models.test_llama_equivalence import PROMPTS
    from tokenmill import LLM, SamplingParams

    path = llama_head_dim_64_dir
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for layout in kv_layout.LAYOUTS:
        monkeypatch.setenv(kv_layout.ENV, layout)
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, block_size=16,
                  kv_cache_dtype=kv_cache_dtype, kv_cache_memory=128 << 20)  # fmt: skip
        cache = llm.engine.runner.model.attention_layers()[0].k_cache
        head_major = layout == "hnd" or (layout == "auto" and kv_cache_dtype == "fp8")
        assert cache.is_contiguous() != head_major
        outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
        tokens[layout] = [output.outputs[0].token_ids for output in outputs]
        del llm
        torch.cuda.empty_cache()
    assert tokens["hnd"] == tokens["nhd"] == tokens["auto"]
