"""Start-up warm-up on a GPU: everything a first request would otherwise pay for on its path (Triton
compiles of each kernel variant, cuBLAS heuristics, a cuDNN plan per dense-prefill length) is met by a
few requests the engine runs before it serves, and that leave no trace behind."""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from tokenmill.core.request import Request
from tokenmill.layers.attention import dense_bucket
from tokenmill.sampling_params import SamplingParams, pooling_request_params

if TYPE_CHECKING:
    from tokenmill.serving.engine_setup import EngineParts

logger = logging.getLogger("tokenmill")

# Prompt lengths start-up runs: around the multiples of 16 Triton specialises integer arguments on, and
# spread up to a full step, so every kernel variant and GEMM shape class is met before any request.
_WARMUP_LENGTHS = (1, 2, 3, 15, 16, 17, 31, 100, 255, 256, 257, 1000, 1024, 2047, 4100, 8191)


def warm_up(parts: EngineParts) -> None:
    """Meet at start-up what a first request would otherwise pay for on its path: a cuDNN plan for every
    dense-prefill bucket, and Triton compiles and cuBLAS heuristics for prompts alone and in mixed
    batches, greedy and sampled. The requests leave no trace: the prefix cache and counters are reset."""
    start = time.perf_counter()
    core, runner, scheduler = parts.core, parts.runner, parts.core.scheduler
    budget = scheduler.max_num_batched_tokens
    longest = min(budget, parts.max_model_len - 4)
    buckets = sorted({dense_bucket(n) for n in range(1, longest + 1)})
    runner.warm_up_dense_prefill(buckets)
    rng = random.Random(0)
    vocab_size = runner.hf_config.vocab_size
    lengths = [n for n in _WARMUP_LENGTHS if n <= longest]
    if parts.pooling_type is not None:
        rounds = [[pooling_request_params()]]
    else:
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(
            max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, logprobs=2, ignore_eos=True, seed=0
        )
        rounds = [[greedy], [greedy, sampled]]
    count = 0

    def add(prompt: list[int], params: SamplingParams) -> None:
        nonlocal count
        core.add_request(Request(f"warmup-{count}", prompt, params))
        count += 1

    def run_all() -> None:
        while core.has_unfinished_requests():
            core.step()

    for round_params in rounds:
        # Each length alone (the dense path), then all together (varlen prefill, then a decode batch).
        batches = [[n] for n in lengths] if len(round_params) == 1 else [lengths]
        for batch in batches:
            for length in batch:
                for params in round_params:
                    add([rng.randrange(vocab_size) for _ in range(length)], params)
            run_all()
    # Short prompts beside another request (the paged path, not the dense one): the paged kernel's tile
    # grows with the step's longest query, and serving meets every size class of it next to decodes.
    for length in (n for n in (2, 3, 4, 5, 8, 11, 16, 17, 40, 64, 65) if n <= longest):
        add([rng.randrange(vocab_size)], rounds[0][0])
        add([rng.randrange(vocab_size) for _ in range(length)], rounds[0][0])
        run_all()
    # Prompts that continue a cached prefix, alone and batched, and one longer than a step: attention
    # over a context longer than the step's queries (chunked prefill) has kernel variants of its own.
    params = rounds[0][0]
    for length in (n for n in (17, 100, 1000) if n + 300 <= longest):
        base = [rng.randrange(vocab_size) for _ in range(length)]
        add(base, params)
        run_all()
        for extra in (5, 300):
            add(base + [rng.randrange(vocab_size) for _ in range(extra)], params)
            run_all()
        for extra in (5, 300):
            add(base + [rng.randrange(vocab_size) for _ in range(extra)], params)
        run_all()
    if budget + 64 <= parts.max_model_len - 4:
        add([rng.randrange(vocab_size) for _ in range(budget + 64)], params)
        run_all()
    scheduler.kv.reset_prefix_cache()
    scheduler.kv.prefix_cache_queries = scheduler.kv.prefix_cache_hits = 0
    scheduler.num_preemptions = 0
    elapsed = time.perf_counter() - start
    logger.info("warm-up: %d dense-prefill plans and %d requests in %.1f s", len(buckets), count, elapsed)
