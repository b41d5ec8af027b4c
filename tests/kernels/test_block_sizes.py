"""KV-cache pages of other sizes than the default 16 tokens (`block_size`, vLLM's --block-size): the engine
writes the same greedy tokens at 8, 32 and 64 tokens a page as at 16, over a bf16 and an FP8 cache, with
prompts that end inside, at and past page boundaries and a shared prefix that the prefix cache serves
(CPU: the torch references, and with `-m slow` the Triton kernels in the interpreter; GPU with `-m gpu`:
a model with 64-wide heads, so that FP8 decodes run the CUDA kernel where the page is a multiple of 16,
and Triton's at 8 pages, which is held to Triton's at 16)."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_llama_equivalence import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import BACKEND_ENV, fp8_decode_cuda

PREFIX = random_prompts([70], seed=3)[0]
PROMPTS = random_prompts([5, 16, 33, 64]) + random_prompts([9, 40], seed=2, prefix=PREFIX)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def tokens_by_block_size(
    path: str, device_options: dict, kv_cache_dtype: str, block_sizes=(16, 8, 32, 64), params=GREEDY
) -> dict[int, list]:
    tokens = {}
    for block_size in block_sizes:
        llm = LLM(model=path, skip_tokenizer_init=True, max_model_len=256, block_size=block_size,
                  kv_cache_dtype=kv_cache_dtype, **device_options)  # fmt: skip
        assert llm.engine.runner.model.attention_layers()[0].k_cache.shape[1] == block_size
        # Twice: the second pass's prompts are prefix-cache hits, whole pages of them.
        for _ in range(2):
            outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
            tokens.setdefault(block_size, []).append([output.outputs[0].token_ids for output in outputs])
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_every_block_size_writes_the_same_tokens(hf_model_dirs, kv_cache_dtype) -> None:
    path, _ = hf_model_dirs["llama"]
    tokens = tokens_by_block_size(path, dict(dtype="float32", device="cpu"), kv_cache_dtype)
    assert tokens[16][0] == tokens[16][1]
    for block_size in (8, 32, 64):
        assert tokens[block_size] == tokens[16], f"block_size={block_size}"


# The Triton attention, cache-store and rotary kernels in the CPU's interpreter (~1 min).
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's: the GPU test runs Triton there")
def test_the_triton_kernels_take_every_block_size(hf_model_dirs, monkeypatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "triton")
    path, _ = hf_model_dirs["llama"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = tokens_by_block_size(path, dict(dtype="float32", device="cpu"), "fp8", (16, 8, 32), params)
    assert tokens[8] == tokens[16] and tokens[32] == tokens[16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_every_block_size_writes_the_same_tokens_on_the_gpu(
    llama_head_dim_64_dir, kv_cache_dtype, monkeypatch
) -> None:
    options = dict(dtype="bfloat16", kv_cache_memory=128 << 20)
    launches = 0
    cuda_decode = fp8_decode_cuda.fp8_decode_attention

    def counted(*args, **kwargs):
        nonlocal launches
        launches += 1
        return cuda_decode(*args, **kwargs)

    monkeypatch.setattr(fp8_decode_cuda, "fp8_decode_attention", counted)
    # The first passes only: the second recomputes each prompt's tokens past its cached pages, a number
    # that depends on the page size, and bf16 GEMMs over other row counts may round otherwise.
    tokens = tokens_by_block_size(llama_head_dim_64_dir, options, kv_cache_dtype, (16, 32, 64))
    assert tokens[32][0] == tokens[16][0] and tokens[64][0] == tokens[16][0]
    if kv_cache_dtype == "fp8" and torch.cuda.get_device_capability() >= (8, 9):
        assert launches > 0  # the CUDA decode served these engines' FP8 decodes
    # Pages of 8 tokens, which the CUDA decode does not take: Triton's decode, held to Triton's at 16.
    monkeypatch.setattr(fp8_decode_cuda, "DECODE_CUDA", False)
    triton_tokens = tokens_by_block_size(llama_head_dim_64_dir, options, kv_cache_dtype, (16, 8))
    assert triton_tokens[8][0] == triton_tokens[16][0]
