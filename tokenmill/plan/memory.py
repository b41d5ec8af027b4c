"""GPU memory accounting: weight bytes by dtype, KV bytes per token, the KV capacity left after the
utilisation fraction and the activation reserve, and the smallest tensor-parallel degree that fits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from tokenmill.plan.gpus import GpuSpec
from tokenmill.plan.model_shape import ModelShape

WEIGHT_DTYPES = ("bf16", "fp8", "int8", "int4")
KV_DTYPES = ("bf16", "fp8")
KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1}
HALF_BYTES = 2  # embeddings, lm_head, norms, biases and routers stay 16-bit in quantized checkpoints
INT4_GROUP_SIZE = 128  # one bf16 scale per 128 int4 weights (GPTQ/AWQ-style group quantization)
BLOCK_SIZE = 16  # tokens per KV page, as the engine allocates them
# CUDA context, cuBLAS/NCCL workspaces and the CUDA-graph pool: outside the activation peak, so kept apart.
FIXED_OVERHEAD_BYTES = 1 << 30
LOGITS_ROWS = 256  # logits are computed for sampled positions only: at most max_num_seqs rows
MAX_SEARCHED_TP = 64


def quantized_bytes(num_params: int, weight_dtype: str) -> int:
    if weight_dtype == "bf16":
        return HALF_BYTES * num_params
    if weight_dtype in ("fp8", "int8"):
        return num_params  # per-tensor or per-channel scales add under 0.1%
    if weight_dtype == "int4":
        return (num_params + 1) // 2 + HALF_BYTES * math.ceil(num_params / INT4_GROUP_SIZE)
    raise ValueError(f"unknown --weight-dtype {weight_dtype!r}; choose one of: {', '.join(WEIGHT_DTYPES)}")


class WeightBytes(NamedTuple):
    total: int
    input_embedding: int  # the token table, gathered row by row (when tied it is read whole as lm_head)
    routed_experts: int  # every routed expert: a decode step reads only the ones its tokens route to
    per_expert_layer: int  # one routed expert in one layer

    @property
    def read_every_step(self) -> int:
        """Bytes every forward pass streams regardless of routing: all but routed experts and the table."""
        return self.total - self.routed_experts - self.input_embedding


def weight_bytes(shape: ModelShape, weight_dtype: str) -> WeightBytes:
    counts = shape.param_counts()
    half = HALF_BYTES * (counts.embedding + counts.lm_head + counts.router + counts.norms_and_biases)
    per_expert = quantized_bytes(counts.per_expert, weight_dtype)
    routed = per_expert * shape.num_experts * shape.num_moe_layers
    linear = sum(
        quantized_bytes(n, weight_dtype) for n in (counts.attention, counts.dense_mlp, counts.shared_experts)
    )
    table = 0 if shape.tie_word_embeddings else HALF_BYTES * counts.embedding
    return WeightBytes(half + linear + routed, table, routed, per_expert)


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, tp: int = 1) -> int:
    """KV bytes one token occupies on one GPU of a TP group (tp=1: the whole model's figure)."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown --kv-dtype {kv_dtype!r}; choose one of: {', '.join(KV_DTYPES)}")
    element = KV_DTYPE_BYTES[kv_dtype]
    if shape.is_mla:
        # One compressed latent plus the shared rope key per layer; every TP rank keeps the whole latent.
        return shape.num_layers * (shape.kv_lora_rank + shape.qk_rope_head_dim) * element
    # KV heads split across ranks; with fewer heads than ranks each rank keeps a replicated head.
    heads_per_rank = math.ceil(shape.num_kv_heads / tp)
    return 2 * shape.num_layers * heads_per_rank * shape.head_dim * element


def activation_reserve_bytes(shape: ModelShape, tp: int, max_num_batched_tokens: int) -> int:
    """Peak activation memory of one forward pass over max_num_batched_tokens, plus the fixed overhead."""
    if shape.is_mla:  # prefill expands the latent into full per-head K and V
        attention_width = shape.num_attention_heads * (2 * shape.qk_head_dim + shape.v_head_dim)
    else:
        attention_width = (shape.num_attention_heads + 2 * shape.num_kv_heads) * shape.head_dim
    mlp_width = shape.intermediate_size if shape.num_dense_layers else 0
    if shape.is_moe:
        routed_width = shape.num_experts_per_tok * shape.moe_intermediate_size
        mlp_width = max(mlp_width, routed_width + shape.shared_expert_intermediate_size)
    # Residual, normed input, attention output and MLP output, then the sharded QKV and gate/up/act buffers.
    per_token = 4 * shape.hidden_size + (attention_width + 3 * mlp_width) / tp
    logits = min(max_num_batched_tokens, LOGITS_ROWS) * shape.vocab_size * 4  # fp32, gathered on each rank
    return FIXED_OVERHEAD_BYTES + int(max_num_batched_tokens * per_token * HALF_BYTES) + logits


@dataclass(frozen=True)
class Deployment:
    """What is being planned: a model on a kind of card, with the knobs that change memory."""

    shape: ModelShape
    gpu: GpuSpec
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    context_len: int = 8192  # tokens one sequence holds in the KV cache
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"unknown --weight-dtype {self.weight_dtype!r}; choose one of: {', '.join(WEIGHT_DTYPES)}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown --kv-dtype {self.kv_dtype!r}; choose one of: {', '.join(KV_DTYPES)}")
        if self.context_len <= 0:
            raise ValueError(f"--context must be positive, got {self.context_len}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")


class MemoryPlan(NamedTuple):
    tp: int
    weight_bytes: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    usable_bytes_per_gpu: int  # memory the driver reports x utilisation fraction
    reserve_bytes_per_gpu: int
    kv_cache_bytes_per_gpu: int  # negative when weights and reserve alone overflow the card
    num_kv_blocks: int
    kv_capacity_tokens: int
    context_len: int
    max_concurrent_seqs: int

    @property
    def fits(self) -> bool:
        return self.max_concurrent_seqs >= 1


def valid_tp_degrees(shape: ModelShape, limit: int) -> list[int]:
    """TP degrees the attention heads split evenly over (KV heads split or replicate evenly), and the
    MLP widths too, as the engine's check_tensor_parallel asks."""
    return [tp for tp in range(1, limit + 1) if not _unsplit_width(shape, tp)]


def _unsplit_width(shape: ModelShape, tp: int) -> str:
    """What tp does not split evenly, or '' when it splits everything."""
    if shape.num_attention_heads % tp or not (
        shape.is_mla or shape.num_kv_heads % tp == 0 or tp % shape.num_kv_heads == 0
    ):
        return f"{shape.num_attention_heads} attention heads ({shape.num_kv_heads} KV heads)"
    if shape.num_dense_layers and shape.intermediate_size % tp:
        return f"intermediate_size {shape.intermediate_size}"
    if shape.is_moe and shape.moe_intermediate_size % tp:
        return f"moe_intermediate_size {shape.moe_intermediate_size}"
    return ""


def plan_memory(deployment: Deployment, tp: int) -> MemoryPlan:
    shape = deployment.shape
    weights = weight_bytes(shape, deployment.weight_dtype).total
    weights_per_gpu = math.ceil(weights / tp)
    kv_per_gpu = kv_bytes_per_token(shape, deployment.kv_dtype, tp)
    usable = int(deployment.gpu.memory_bytes * deployment.gpu_memory_utilization)
    reserve = activation_reserve_bytes(shape, tp, deployment.max_num_batched_tokens)
    kv_cache = usable - weights_per_gpu - reserve
    num_blocks = max(kv_cache, 0) // (BLOCK_SIZE * kv_per_gpu)
    return MemoryPlan(
        tp=tp,
        weight_bytes=weights,
        weight_bytes_per_gpu=weights_per_gpu,
        kv_bytes_per_token=kv_bytes_per_token(shape, deployment.kv_dtype),
        kv_bytes_per_token_per_gpu=kv_per_gpu,
        usable_bytes_per_gpu=usable,
        reserve_bytes_per_gpu=reserve,
        kv_cache_bytes_per_gpu=kv_cache,
        num_kv_blocks=num_blocks,
        kv_capacity_tokens=num_blocks * BLOCK_SIZE,
        context_len=deployment.context_len,
        max_concurrent_seqs=num_blocks // math.ceil(deployment.context_len / BLOCK_SIZE),
    )


def plan_at_tp(deployment: Deployment, tp: int) -> MemoryPlan:
    """The plan at a TP degree the user chose, or a clear error if the model does not fit there."""
    unsplit = _unsplit_width(deployment.shape, tp)
    if unsplit:
        raise ValueError(f"--tp {tp} does not divide {deployment.shape.name}'s {unsplit} evenly")
    plan = plan_memory(deployment, tp)
    if not plan.fits:
        raise ValueError(_does_not_fit(deployment, plan))
    return plan


def smallest_fitting_plan(deployment: Deployment, num_gpus: int) -> MemoryPlan:
    """The plan at the smallest TP degree (within num_gpus) that holds one sequence of the context."""
    widest = plan_memory(deployment, max(valid_tp_degrees(deployment.shape, num_gpus)))
    for tp in valid_tp_degrees(deployment.shape, MAX_SEARCHED_TP):
        plan = plan_memory(deployment, tp)
        if plan.fits and tp <= num_gpus:
            return plan
        if plan.fits:
            raise ValueError(f"{_does_not_fit(deployment, widest)}; it fits at tp {tp}: pass --num-gpus {tp}")
    raise ValueError(
        f"{_does_not_fit(deployment, widest)}, nor at any tensor-parallel degree up to {MAX_SEARCHED_TP}"
    )


def _does_not_fit(deployment: Deployment, plan: MemoryPlan) -> str:
    one_sequence = plan.kv_bytes_per_token_per_gpu * math.ceil(plan.context_len / BLOCK_SIZE) * BLOCK_SIZE
    needed = plan.weight_bytes_per_gpu + plan.reserve_bytes_per_gpu + one_sequence
    return (
        f"{deployment.shape.name} with {deployment.weight_dtype} weights ({plan.weight_bytes / 1e9:.2f} GB) "
        f"does not fit at tp {plan.tp} on {deployment.gpu.name}: one GPU needs {needed / 1e9:.2f} GB "
        f"(weights {plan.weight_bytes_per_gpu / 1e9:.2f}, reserve {plan.reserve_bytes_per_gpu / 1e9:.2f}, "
        f"KV of one {plan.context_len}-token sequence {one_sequence / 1e9:.2f}) but has "
        f"{plan.usable_bytes_per_gpu / 1e9:.2f} GB usable"
    )
