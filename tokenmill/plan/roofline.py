"""The roofline of one forward step on one GPU of a TP group: bytes moved and FLOPs for decode and prefill,
the time floor each sets, which binds, and the batch at which decode turns compute-bound."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from tokenmill.plan.gpus import RooflineCeilings
from tokenmill.plan.memory import HALF_BYTES, Deployment, kv_bytes_per_token, weight_bytes
from tokenmill.plan.model_shape import ModelShape

MAX_SEARCHED_BATCH = 1 << 24


class RooflinePoint(NamedTuple):
    phase: str  # "decode", "verify" (speculative decoding) or "prefill"
    batch: int  # sequences in the step
    tokens: int  # tokens computed in the step: batch for decode, batch x (k + 1) to verify k drafts
    context_len: int  # KV tokens each sequence attends to at the end of the step
    bytes_moved: float  # per GPU
    flops: float  # per GPU
    bandwidth_time_s: float
    compute_time_s: float

    @property
    def floor_s(self) -> float:
        return max(self.bandwidth_time_s, self.compute_time_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_time_s > self.bandwidth_time_s else "bandwidth"

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes_moved

    @property
    def tok_s_per_seq(self) -> float:
        return 1.0 / self.floor_s

    @property
    def tok_s_aggregate(self) -> float:
        return self.batch / self.floor_s


def expected_experts_touched(shape: ModelShape, num_tokens: int) -> float:
    """Distinct routed experts a layer reads for num_tokens tokens, routing taken as uniform: each token
    misses a given expert with probability 1 - k/E."""
    if not shape.is_moe:
        return 0.0
    miss = 1.0 - shape.num_experts_per_tok / shape.num_experts
    return shape.num_experts * (1.0 - miss**num_tokens)


def weight_bytes_read(deployment: Deployment, num_tokens: int) -> float:
    """Weight bytes one forward pass over num_tokens tokens streams from HBM (whole model, all ranks)."""
    shape = deployment.shape
    weights = weight_bytes(shape, deployment.weight_dtype)
    experts = expected_experts_touched(shape, num_tokens) * weights.per_expert_layer * shape.num_moe_layers
    # An untied token table is gathered: only one row per token comes off HBM.
    rows = 0 if shape.tie_word_embeddings else num_tokens * shape.hidden_size * HALF_BYTES
    return weights.read_every_step + experts + min(rows, weights.input_embedding)


def matmul_flops_per_token(shape: ModelShape, with_lm_head: bool = True) -> int:
    """2 x the weights one token multiplies through: its active experts only, and not the table gather."""
    counts = shape.param_counts()
    active = (
        counts.attention
        + counts.dense_mlp
        + counts.shared_experts
        + counts.router
        + counts.per_expert * shape.num_experts_per_tok * shape.num_moe_layers
    )
    if with_lm_head:
        active += counts.lm_head if counts.lm_head else counts.embedding
    return 2 * active


def attention_flops_per_context_token(shape: ModelShape, phase: str) -> int:
    """FLOPs of QK^T and PV for one query against one cached token, over all layers."""
    heads = shape.num_attention_heads
    if not shape.is_mla:
        return shape.num_layers * 4 * heads * shape.head_dim
    if phase == "decode":  # absorbed form: scores and values live in the compressed latent
        per_layer = 2 * heads * (shape.kv_lora_rank + shape.qk_rope_head_dim) + 2 * heads * shape.kv_lora_rank
    else:  # prefill expands the latent into per-head keys and values
        per_layer = 2 * heads * shape.qk_head_dim + 2 * heads * shape.v_head_dim
    return shape.num_layers * per_layer


def decode_point(
    deployment: Deployment,
    ceilings: RooflineCeilings,
    tp: int,
    batch: int,
    context_len: int,
    tokens_per_seq: int = 1,
) -> RooflinePoint:
    """One decode step: batch sequences, each attending to context_len cached tokens. With
    tokens_per_seq > 1, a speculative verify step: each sequence computes that many tokens (its last
    token and the drafts) over the same context, reading the weights and its KV once."""
    shape = deployment.shape
    kv_read = batch * context_len * kv_bytes_per_token(shape, deployment.kv_dtype, tp)
    tokens = batch * tokens_per_seq
    bytes_moved = weight_bytes_read(deployment, tokens) / tp + kv_read
    per_token = (
        matmul_flops_per_token(shape) + attention_flops_per_context_token(shape, "decode") * context_len
    )
    flops = tokens * per_token / tp
    return RooflinePoint(
        phase="decode" if tokens_per_seq == 1 else "verify",
        batch=batch,
        tokens=tokens,
        context_len=context_len,
        bytes_moved=bytes_moved,
        flops=flops,
        bandwidth_time_s=bytes_moved / ceilings.bandwidth_bytes_s,
        compute_time_s=flops / ceilings.flops,
    )


def prefill_point(
    deployment: Deployment, ceilings: RooflineCeilings, tp: int, input_len: int
) -> RooflinePoint:
    """Prefill of one prompt in one step: the floor under its time to first token."""
    shape = deployment.shape
    # Logits are needed for the last position only; causal attention sees input_len*(input_len+1)/2 pairs.
    flops = (
        matmul_flops_per_token(shape, with_lm_head=False) * input_len
        + (matmul_flops_per_token(shape) - matmul_flops_per_token(shape, with_lm_head=False))
        + attention_flops_per_context_token(shape, "prefill") * input_len * (input_len + 1) // 2
    ) / tp
    kv_written = input_len * kv_bytes_per_token(shape, deployment.kv_dtype, tp)
    bytes_moved = weight_bytes_read(deployment, input_len) / tp + kv_written
    return RooflinePoint(
        phase="prefill",
        batch=1,
        tokens=input_len,
        context_len=input_len,
        bytes_moved=bytes_moved,
        flops=flops,
        bandwidth_time_s=bytes_moved / ceilings.bandwidth_bytes_s,
        compute_time_s=flops / ceilings.flops,
    )


def compute_bound_batch(
    deployment: Deployment, ceilings: RooflineCeilings, tp: int, context_len: int
) -> int | None:
    """The smallest decode batch whose compute time reaches its bandwidth time, or None if none does.
    compute - bandwidth time is convex in the batch (the expert bytes read are concave in it) and
    negative at batch 0, so once positive it stays positive."""

    def is_compute_bound(batch: int) -> bool:
        point = decode_point(deployment, ceilings, tp, batch, context_len)
        return point.compute_time_s >= point.bandwidth_time_s

    return smallest_batch(is_compute_bound)


def largest_batch_within(
    deployment: Deployment, ceilings: RooflineCeilings, tp: int, context_len: int, step_time_s: float
) -> int:
    """The largest decode batch whose step floor is at most step_time_s; 0 if batch 1 already misses it.
    The floor grows with the batch (every sequence adds bytes and FLOPs), so bisection is exact."""

    def misses(batch: int) -> bool:
        return decode_point(deployment, ceilings, tp, batch, context_len).floor_s > step_time_s

    first_miss = smallest_batch(misses)
    return MAX_SEARCHED_BATCH if first_miss is None else first_miss - 1


def smallest_batch(holds: Callable[[int], bool]) -> int | None:
    """The smallest batch >= 1 for which holds(batch) is True, for a condition that stays True once it
    holds; None if it does not hold by MAX_SEARCHED_BATCH. Doubling, then bisection: exact."""
    high = 1
    while not holds(high):
        high *= 2
        if high > MAX_SEARCHED_BATCH:
            return None
    low = high // 2  # does not hold (or 0)
    while high - low > 1:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle
    return high
