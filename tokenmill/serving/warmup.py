"""Start-up warm-up on a GPU: everything a first request would otherwise pay for on its path (Triton
compiles of each kernel variant, cuBLAS heuristics, a cuDNN plan per dense-prefill length) is met by a
few requests the engine runs before it serves, and that leave no trace behind."""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

import torch

from tokenmill.core.request import Request
from tokenmill.layers.attention import dense_bucket, dense_causal_attention
from tokenmill.sampling_params import SamplingParams, pooling_request_params

if TYPE_CHECKING:
    from tokenmill.serving.engine_setup import EngineParts
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger("tokenmill")

# Prompt lengths start-up runs, spread up to a full step so that every kernel variant and GEMM shape
# class is met before any request. Triton specialises an integer argument on whether it is 1 or a
# multiple of 16, so each class of rows the kernels tile by (up to 16, 32, 64 and 128 rows a program,
# and each power of two past them) is met with a multiple of 16 and with another length: a 128-token
# prompt's INT4 tensor-core GEMMs compiled on its path before 32, 64, 128, 512, 2048, 4096 and 8192
# were here (tests/serving/test_warmup.py checks each class is met both ways).
_WARMUP_LENGTHS = (
    1, 2, 3, 15, 16, 17, 31, 32, 40, 64, 100, 128, 255, 256, 257, 512, 1000, 1024, 2047, 2048, 3000,
    4096, 4100, 8191, 8192,
)  # fmt: skip


def warm_up(parts: EngineParts) -> None:
    """Meet at start-up what a first request would otherwise pay for on its path: a cuDNN plan for every
    dense-prefill bucket, and Triton compiles and cuBLAS heuristics for prompts alone and in mixed
    batches, greedy and sampled. The requests leave no trace: the prefix cache and counters are reset."""
    start = time.perf_counter()
    core, runner, scheduler = parts.core, parts.runner, parts.core.scheduler
    if scheduler.structured is not None:
        scheduler.structured.ll_tokenizer  # noqa: B018 (llguidance's view of the tokenizer: ~0.3 s once)
    budget = scheduler.max_num_batched_tokens
    longest = min(budget, parts.max_model_len - 4)
    buckets = sorted({dense_bucket(n) for n in range(1, longest + 1)})
    _build_dense_plans(runner, buckets)
    rng = random.Random(0)
    vocab_size = runner.hf_config.vocab_size
    if parts.pooling_type is not None:
        plain = pooling_request_params()
        variants = [plain]
    else:
        plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(
            max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, logprobs=2, ignore_eos=True, seed=0
        )
        variants = [plain, sampled]
    count = 0

    def tokens(length: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(length)]

    def run(*prompts: list[int], params: list[SamplingParams] | None = None) -> None:
        """The prompts (each with each of params, default the plain ones) as one batch, to the end."""
        nonlocal count
        for prompt in prompts:
            for request_params in params or [plain]:
                core.add_request(Request(f"warmup-{count}", prompt, request_params))
                count += 1
        while core.has_unfinished_requests():
            core.step()

    lengths = [n for n in _WARMUP_LENGTHS if n <= longest]
    for length in lengths:  # alone: the dense path
        run(tokens(length))
    if parts.pooling_type is None:
        # Temperature alone: the one-launch sampling's variant that draws (kernels/sample.py); the batches
        # above sample greedily and the one below asks for the torch form (top-k/p, logprobs, a seed).
        run(tokens(5), params=[SamplingParams(max_tokens=4, temperature=0.8, ignore_eos=True)])
    run(*map(tokens, lengths), params=variants)  # together: varlen prefill, then a decode batch
    # A full decode batch: launches of many programs take tiles of their own (an FP8 cache's decode
    # attention, kernels/attention.py's decode_config), which eager steps would otherwise compile late.
    run(*(tokens(3) for _ in range(min(scheduler.max_num_seqs, 512))))
    # Short prompts beside another request (the paged path, not the dense one): the paged kernel's tile
    # grows with the step's longest query, and serving meets every size class of it next to decodes.
    for length in (n for n in (2, 3, 4, 5, 8, 11, 16, 17, 40, 64, 65) if n <= longest):
        run(tokens(1), tokens(length))
    # Prompts that continue a cached prefix, alone and batched, and one longer than a step: attention
    # over a context longer than the step's queries (chunked prefill) has kernel variants of its own.
    for length in (n for n in (17, 100, 1000) if n + 300 <= longest):
        base = tokens(length)
        run(base)
        run(base + tokens(5))
        run(base + tokens(300))
        run(base + tokens(5), base + tokens(300))
    if budget + 64 <= parts.max_model_len - 4:
        run(tokens(budget + 64))
    scheduler.kv.reset_prefix_cache()
    scheduler.kv.prefix_cache_queries = scheduler.kv.prefix_cache_hits = 0
    scheduler.num_preemptions = 0
    scheduler.spec.reset_counters()
    elapsed = time.perf_counter() - start
    logger.info("warm-up: %d dense-prefill plans and %d requests in %.1f s", len(buckets), count, elapsed)
    report_late_compiles()


def report_late_compiles() -> None:
    """From now on, log every Triton kernel variant met for the first time: its request paid the compile
    (or the load from Triton's disk cache), and the line names the specialization warm-up missed."""
    try:
        from triton import knobs
    except ImportError:  # an older Triton: no hooks to watch with
        return
    started: dict[str, float] = {}

    def before(*, key, **_: object) -> None:
        started[str(key)] = time.perf_counter()

    def after(*, key, fn, compile, **_: object) -> None:  # noqa: A002 (Triton's keyword)
        took = time.perf_counter() - started.pop(str(key), time.perf_counter())
        # The key is the specialization itself: each argument's type and what Triton assumed of it
        # (a 16-byte aligned pointer, an integer == 1 or divisible by 16), then the constexprs and options.
        logger.warning(
            "kernel variant met after warm-up, %.0f ms on a request's path: %s, %d warps, %d stages, "
            "specialization %s",
            took * 1e3, fn.name, compile["num_warps"], compile["num_stages"], key,
        )  # fmt: skip

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after


@torch.inference_mode()
def _build_dense_plans(runner: ModelRunner, lengths: list[int]) -> None:
    """The dense-prefill plan of every length (bucket), built once on scratch tensors."""
    if not runner.dense_prefill_ok:
        return
    seen = set()
    options = dict(dtype=runner.dtype, device=runner.device)
    for attn in runner.model.attention_layers():
        shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        if shape in seen:
            continue
        seen.add(shape)
        for length in lengths:
            q = torch.zeros(length, attn.num_heads, attn.head_dim, **options)
            kv = torch.zeros(length, attn.num_kv_heads, attn.head_dim, **options)
            dense_causal_attention(q, kv, kv, attn.scale)
    torch.cuda.synchronize()
