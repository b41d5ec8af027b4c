"""Building an engine core from an EngineConfig: resolve the model, size the KV cache, wire the parts."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from tokenmill import distributed
from tokenmill.attention_window import sliding_window
from tokenmill.config import EngineConfig
from tokenmill.core.engine import EngineCore
from tokenmill.core.kv_cache import KVCacheManager, cdiv
from tokenmill.core.scheduler import Scheduler
from tokenmill.loader import ModelSource, resolve_model
from tokenmill.models.registry import is_bare_model
from tokenmill.spec_decode.policy import batch_limit_for
from tokenmill.structured_outputs import StructuredOutputs
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger("tokenmill")

_CPU_DEFAULT_KV_BYTES = 1 << 30


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
    window = sliding_window(hf_config)
    if window is not None and window < model_max:
        # Attention here is full-context: only contexts inside the window give the model's own answer.
        model_max = window
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        why = " (its sliding_window: attention here is full-context)" if model_max == window else ""
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's context length of {model_max} "
            f"tokens{why}."
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
    ranks = None
    if config.tensor_parallel_size > 1:  # the other ranks build their runners beside this one
        from tokenmill.models.registry import check_tensor_parallel
        from tokenmill.worker.device import resolve_device
        from tokenmill.worker.tp_executor import start_ranks

        check_tensor_parallel(source.hf_config, config.tensor_parallel_size, config.enable_expert_parallel)
        ranks = start_ranks(config, config.tensor_parallel_size, resolve_device(config.device))
    try:
        return _build_engine(config, source, max_model_len, pooling_type, ranks)
    except BaseException:
        # A refusal after the ranks started (a layer the ranks cannot split, the KV cache too small): they
        # and the process group go with it, so this process can build another engine.
        if ranks is not None:
            ranks.stop()
        raise


def _build_engine(config: EngineConfig, source, max_model_len: int, pooling_type, ranks) -> EngineParts:
    if ranks is not None:
        ranks.send("build", max_model_len, pooling_type)
    runner = ModelRunner(config, source, max_model_len, pooling_type)
    executor = None
    if ranks is not None:
        from tokenmill.worker.tp_executor import TensorParallelExecutor

        executor = TensorParallelExecutor(runner, ranks)
    batched_tokens = runner.max_num_batched_tokens
    if executor is not None:
        executor.broadcast("num_blocks", batched_tokens)
    num_blocks = distributed.all_reduce_min(_num_kv_blocks(config, runner, batched_tokens))
    capacity = num_blocks * config.block_size
    if capacity < max_model_len:
        needed = cdiv(max_model_len, config.block_size)
        raise ValueError(
            f"max_model_len={max_model_len} needs {needed} KV blocks but only "
            f"{num_blocks} fit ({capacity} tokens); lower max_model_len or give the KV cache more memory "
            "(gpu_memory_utilization, kv_cache_memory or num_kv_blocks)."
        )
    if executor is not None:
        executor.broadcast("allocate", num_blocks)
        executor.broadcast("capture", batched_tokens)
    runner.allocate_kv_cache(num_blocks)
    runner.capture_cuda_graphs(batched_tokens)
    logger.info(
        "KV cache (%s): %d blocks x %d tokens = %d tokens (%.2f GiB); max concurrency at max_model_len=%d: "
        "%.1fx",
        str(runner.kv_dtype).removeprefix("torch."),
        num_blocks,
        config.block_size,
        capacity,
        num_blocks * runner.kv_bytes_per_block() / 2**30,
        max_model_len,
        capacity / max_model_len,
    )
    # Mean pooling sums the hidden state of every prompt token, so none may come from the prefix cache.
    prefix_caching = config.enable_prefix_caching and pooling_type != "mean"
    num_host_blocks = num_disk_blocks = 0

    def blocks_in(knob: str) -> int:
        gib = getattr(config, knob)
        num = int(gib * 2**30) // runner.kv_bytes_per_block()
        if num < 1:
            raise ValueError(
                f"{knob}={gib} holds no KV block ({runner.kv_bytes_per_block()} bytes each); give it more."
            )
        return num

    if config.kv_offload_gib and prefix_caching:
        num_host_blocks = blocks_in("kv_offload_gib")
        if config.kv_offload_disk is not None:
            num_disk_blocks = blocks_in("kv_offload_disk_gib")
        if executor is not None:  # every rank keeps its own KV heads' share of each block
            executor.broadcast("allocate_host", num_host_blocks, config.kv_offload_disk, num_disk_blocks)
        runner.allocate_host_kv_cache(num_host_blocks, config.kv_offload_disk, num_disk_blocks)
        logger.info(
            "KV offload: %d host blocks (%.2f GiB, %d tokens) behind the device's prefix cache%s",
            num_host_blocks, config.kv_offload_gib, num_host_blocks * config.block_size,
            f", {num_disk_blocks} disk blocks ({config.kv_offload_disk_gib:.2f} GiB in "
            f"{config.kv_offload_disk}) behind those" if num_disk_blocks else "",
        )  # fmt: skip
    kv = KVCacheManager(num_blocks, config.block_size, prefix_caching, num_host_blocks, num_disk_blocks)
    # On a CPU a step's time is its arithmetic: the budget counts attention too, so chunks deep into a
    # long prompt shrink and steps stay short. A GPU step is not (decode steps are memory-bound).
    context_cost = 0.0 if runner.device.type == "cuda" else runner.context_cost()
    spec = config.speculative_config
    spec_policy = None
    if spec is not None and spec.disable_by_batch_size is None and runner.device.type == "cuda":
        spec_policy = batch_limit_for(
            source.hf_config, torch.cuda.get_device_name(runner.device), spec.num_speculative_tokens,
            runner.drafter.draft_cost(), config.max_num_seqs, max_model_len,
            weight_dtype=_stored_as(runner.model),
            kv_dtype="fp8" if runner.kv_dtype == torch.float8_e4m3fn else "bf16",
        )  # fmt: skip
    structured = None
    if not config.skip_tokenizer_init and pooling_type is None:
        structured = StructuredOutputs(source.load_tokenizer, source.hf_config.vocab_size)
    scheduler = Scheduler(
        kv,
        config.max_num_seqs,
        batched_tokens,
        max_model_len,
        context_cost,
        config.max_prefill_tokens_with_decodes,
        config.speculative_config,
        spec_policy,
        structured,
    )
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    async_scheduling = config.async_scheduling
    if async_scheduling is None:
        # (Steps that speculate run synchronously either way: see EngineCore.)
        async_scheduling = runner.device.type == "cuda"
    core = EngineCore(scheduler, executor or runner, async_scheduling=async_scheduling)
    parts = EngineParts(core, runner, source, max_model_len, num_blocks, pooling_type)
    if config.warmup and runner.device.type == "cuda":
        from tokenmill.serving.warmup import warm_up

        warm_up(parts)
    return parts


def _stored_as(model: torch.nn.Module) -> str:
    """The planner's weight dtype (plan/memory.py WEIGHT_DTYPES) of the model as loaded, whichever way its
    linears were quantized (online or by the checkpoint): from their bytes a weight, over every tensor of
    each layer's shard (scales and zero points too), and FP8 told from INT8 by the dtype."""
    from tokenmill.layers.linear import LinearBase

    weights = stored = 0
    fp8 = False
    for layer in model.modules():
        if isinstance(layer, LinearBase):
            weights += layer.input_size_per_partition * layer.output_size_per_partition
            for tensor in layer.parameters(recurse=False):
                stored += tensor.numel() * tensor.element_size()
                fp8 = fp8 or tensor.dtype == torch.float8_e4m3fn
    per_weight = stored / weights if weights else 2.0
    if per_weight < 0.75:
        return "int4"
    if per_weight < 1.5:
        return "fp8" if fp8 else "int8"
    return "bf16"
