"""Building an engine core from an EngineConfig: resolve the model, size the KV cache, wire the parts."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.engine import EngineCore
from tokenmill.core.kv_cache import KVCacheManager, cdiv
from tokenmill.core.scheduler import Scheduler
from tokenmill.loader import ModelSource, resolve_model
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger("tokenmill")

_CPU_DEFAULT_KV_BYTES = 1 << 30


class EngineParts(NamedTuple):
    core: EngineCore
    runner: ModelRunner
    source: ModelSource
    max_model_len: int
    num_kv_blocks: int


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
    batched_tokens = config.max_num_batched_tokens or 8192
    runner = ModelRunner(config, source, max_model_len)
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
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
    scheduler = Scheduler(kv, config.max_num_seqs, batched_tokens, max_model_len)
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    async_scheduling = config.async_scheduling
    if async_scheduling is None:
        async_scheduling = runner.device.type == "cuda"
    core = EngineCore(scheduler, runner, async_scheduling=async_scheduling)
    return EngineParts(core, runner, source, max_model_len, num_blocks)
