"""Building an engine core from an EngineConfig: resolve the model, size the KV cache, wire the parts."""

from __future__ import annotations

import logging
import random
import time
from typing import NamedTuple

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.engine import EngineCore
from tokenmill.core.kv_cache import KVCacheManager, cdiv
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.layers.attention import dense_bucket
from tokenmill.loader import ModelSource, resolve_model
from tokenmill.models.registry import is_bare_model
from tokenmill.sampling_params import SamplingParams, pooling_request_params
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger("tokenmill")

_CPU_DEFAULT_KV_BYTES = 1 << 30
# Default token budget of a step. On a CPU a step costs its tokens at full price (no idle device to
# fill), so a small budget keeps every step short and lets a request that arrives behind a long prompt
# in within a step or two (an 8k-token prompt on the embedded model: 256-token chunks of 0.3-2 s on two
# cores, against one 34 s step at 8192) for little throughput (a 256-row GEMM runs ~25% slower there).
_GPU_DEFAULT_BATCHED_TOKENS = 8192
_CPU_DEFAULT_BATCHED_TOKENS = 256


class EngineParts(NamedTuple):
    core: EngineCore
    runner: ModelRunner
    source: ModelSource
    max_model_len: int
    num_kv_blocks: int
    pooling_type: str | None  # None for a generating engine; "last" or "mean" for the pooling runner


def resolve_pooling(config: EngineConfig, source: ModelSource) -> str | None:
    """The pooling runner's pooling type, or None when the engine generates text."""
    runner = config.runner
    if runner == "auto":
        runner = "pooling" if is_bare_model(source.hf_config) else "generate"
    if runner == "generate":
        if config.pooling_type is not None:
            raise ValueError("pooling_type needs runner='pooling' (this engine generates text).")
        if is_bare_model(source.hf_config):
            raise ValueError(
                f"{source.hf_config.architectures[0]} is a bare model with no LM head: it cannot generate "
                "text; serve it with runner='pooling' (--runner pooling)."
            )
        return None
    if config.pooling_type is not None:
        return config.pooling_type
    declared = source.sentence_transformers_pooling()
    if declared is None:
        return "last"
    if declared not in ("last", "mean"):
        raise ValueError(
            f"the model's sentence-transformers config asks for {declared!r} pooling, which is not "
            "supported; pass pooling_type='last' or 'mean' (--pooling-type)."
        )
    return declared


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
    sliding_window = getattr(hf_config, "sliding_window", None)
    if sliding_window and getattr(hf_config, "use_sliding_window", True):
        # Attention here is full-context: only contexts inside the window give the model's own answer.
        model_max = min(model_max, sliding_window)
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's context length of {model_max} tokens."
        )
    return config.max_model_len


def _num_kv_blocks(config: EngineConfig, runner: ModelRunner, batched_tokens: int) -> int:
    bytes_per_block = runner.kv_bytes_per_block()
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory // bytes_per_block
    if runner.device.type != "cuda":
        return _CPU_DEFAULT_KV_BYTES // bytes_per_block
    free_after_profile = runner.profile_free_memory(batched_tokens)
    return max(0, int(free_after_profile) // bytes_per_block)


def create_engine(config: EngineConfig) -> EngineParts:
    source = resolve_model(config.model, config.load_format, config.tokenizer)
    max_model_len = resolve_max_model_len(config, source.hf_config)
    pooling_type = resolve_pooling(config, source)
    runner = ModelRunner(config, source, max_model_len, pooling_type)
    batched_tokens = config.max_num_batched_tokens or (
        _GPU_DEFAULT_BATCHED_TOKENS if runner.device.type == "cuda" else _CPU_DEFAULT_BATCHED_TOKENS
    )
    num_blocks = _num_kv_blocks(config, runner, batched_tokens)
    capacity = num_blocks * config.block_size
    if capacity < max_model_len:
        needed = cdiv(max_model_len, config.block_size)
        raise ValueError(
            f"max_model_len={max_model_len} needs {needed} KV blocks but only "
            f"{num_blocks} fit ({capacity} tokens); lower max_model_len or give the KV cache more memory "
            "(gpu_memory_utilization, kv_cache_memory or num_kv_blocks)."
        )
    runner.allocate_kv_cache(num_blocks)
    runner.capture_cuda_graphs()
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB); max concurrency at max_model_len=%d: %.1fx",
        num_blocks,
        config.block_size,
        capacity,
        num_blocks * runner.kv_bytes_per_block() / 2**30,
        max_model_len,
        capacity / max_model_len,
    )
    # Mean pooling sums the hidden state of every prompt token, so none may come from the prefix cache.
    prefix_caching = config.enable_prefix_caching and pooling_type != "mean"
    kv = KVCacheManager(num_blocks, config.block_size, prefix_caching)
    # On a CPU a step's time is its arithmetic: the budget counts attention too, so chunks deep into a
    # long prompt shrink and steps stay short. A GPU step is not (decode steps are memory-bound).
    context_cost = 0.0 if runner.device.type == "cuda" else runner.context_cost()
    scheduler = Scheduler(kv, config.max_num_seqs, batched_tokens, max_model_len, context_cost)
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    async_scheduling = config.async_scheduling
    if async_scheduling is None:
        async_scheduling = runner.device.type == "cuda"
    core = EngineCore(scheduler, runner, async_scheduling=async_scheduling)
    parts = EngineParts(core, runner, source, max_model_len, num_blocks, pooling_type)
    if config.warmup and runner.device.type == "cuda":
        warm_up(parts)
    return parts


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
