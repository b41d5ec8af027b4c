"""A whole plan (memory at the chosen TP degree plus the decode and prefill rooflines) and its two
renderings: the terminal table and the JSON object."""

from __future__ import annotations

from typing import Any, NamedTuple

from tokenmill.plan.gpus import RooflineCeilings
from tokenmill.plan.memory import Deployment, MemoryPlan, plan_at_tp, smallest_fitting_plan
from tokenmill.plan.roofline import (
    RooflinePoint,
    compute_bound_batch,
    decode_point,
    largest_batch_within,
    matmul_flops_per_token,
    prefill_point,
)
from tokenmill.plan.speculative import SpeculativePlan


class TargetConcurrency(NamedTuple):
    """Requests one replica should carry (running + waiting): the figure to autoscale replicas on."""

    seqs: int
    bound: str  # which limit sets it: "kv_cache", "max_num_seqs" or "tpot"


TARGET_BOUNDS = {
    "kv_cache": "the sequences the KV cache holds",
    "max_num_seqs": "--max-num-seqs, the engine's running batch",
    "tpot": "the largest batch whose decode floor meets --tpot-ms",
}


class Plan(NamedTuple):
    deployment: Deployment
    ceilings: RooflineCeilings
    num_gpus: int
    min_tp: int
    memory: MemoryPlan  # at the TP degree in use
    decode: RooflinePoint  # at the requested batch
    decode_points: list[RooflinePoint]  # batch 1, the requested batch, and the KV cache's full capacity
    prefill: RooflinePoint
    compute_bound_batch: int | None  # at the decode context; None: the KV read outgrows compute
    compute_bound_batch_weights_only: int | None  # the same with no KV read (context 0)
    target_concurrency: TargetConcurrency
    notes: list[str]
    speculative: SpeculativePlan | None = None  # with --speculative

    @property
    def tp(self) -> int:
        return self.memory.tp


def build_plan(
    deployment: Deployment,
    ceilings: RooflineCeilings,
    *,
    num_gpus: int,
    tp: int | None,
    batch: int,
    decode_context_len: int,
    input_len: int,
    max_num_seqs: int,
    tpot_s: float | None = None,
) -> Plan:
    if tp is not None and tp > num_gpus:
        raise ValueError(f"--tp {tp} needs at least {tp} GPUs but --num-gpus is {num_gpus}")
    memory = plan_at_tp(deployment, tp) if tp is not None else smallest_fitting_plan(deployment, num_gpus)
    min_tp = smallest_fitting_plan(deployment, num_gpus).tp
    in_use = memory.tp
    decode = decode_point(deployment, ceilings, in_use, batch, decode_context_len)
    batches = sorted({1, batch, memory.max_concurrent_seqs})
    notes = []
    if batch > memory.max_concurrent_seqs:
        notes.append(
            f"batch {batch:,} exceeds the {memory.max_concurrent_seqs:,} sequences of "
            f"{memory.context_len:,} tokens the KV cache holds"
        )
    limit = deployment.shape.context_limit
    if limit and deployment.context_len > limit:
        what = (
            f"{limit:,}-token sliding window, the most the engine serves it (its attention is full-context)"
            if limit == deployment.shape.sliding_window
            else f"{limit:,} positions"
        )
        notes.append(f"context {deployment.context_len:,} exceeds the model's {what}")
    return Plan(
        deployment=deployment,
        ceilings=ceilings,
        num_gpus=num_gpus,
        min_tp=min_tp,
        memory=memory,
        decode=decode,
        decode_points=[decode_point(deployment, ceilings, in_use, b, decode_context_len) for b in batches],
        prefill=prefill_point(deployment, ceilings, in_use, input_len),
        compute_bound_batch=compute_bound_batch(deployment, ceilings, in_use, decode_context_len),
        compute_bound_batch_weights_only=compute_bound_batch(deployment, ceilings, in_use, 0),
        target_concurrency=target_concurrency(
            deployment, ceilings, memory, decode_context_len, max_num_seqs, tpot_s
        ),
        notes=notes,
    )


def target_concurrency(
    deployment: Deployment,
    ceilings: RooflineCeilings,
    memory: MemoryPlan,
    decode_context_len: int,
    max_num_seqs: int,
    tpot_s: float | None,
) -> TargetConcurrency:
    """As many requests as one replica can run at once (its KV cache at the planned context, capped by
    the engine's running batch) and, with a TPOT target, no more than the decode roofline lets meet it.
    Past this figure requests queue or slow down, so it is where another replica should come in."""
    limits = {"kv_cache": memory.max_concurrent_seqs, "max_num_seqs": max_num_seqs}
    if tpot_s is not None:
        limits["tpot"] = largest_batch_within(deployment, ceilings, memory.tp, decode_context_len, tpot_s)
        if limits["tpot"] == 0:
            floor = decode_point(deployment, ceilings, memory.tp, 1, decode_context_len).floor_s
            raise ValueError(
                f"--tpot-ms {tpot_s * 1e3:g} is under the decode floor of one sequence "
                f"({floor * 1e3:.2f} ms): no batch meets it"
            )
    bound = min(limits, key=limits.__getitem__)
    return TargetConcurrency(limits[bound], bound)


def point_json(point: RooflinePoint) -> dict[str, Any]:
    return {
        "phase": point.phase,
        "batch": point.batch,
        "tokens": point.tokens,
        "context_len": point.context_len,
        "bytes_moved": point.bytes_moved,
        "flops": point.flops,
        "bandwidth_time_s": point.bandwidth_time_s,
        "compute_time_s": point.compute_time_s,
        "floor_s": point.floor_s,
        "bound": point.bound,
        "arithmetic_intensity": point.arithmetic_intensity,
        "tok_s_per_seq": point.tok_s_per_seq,
        "tok_s_aggregate": point.tok_s_aggregate,
    }


def plan_json(plan: Plan) -> dict[str, Any]:
    deployment, memory, decode, prefill = plan.deployment, plan.memory, plan.decode, plan.prefill
    shape = deployment.shape
    counts = shape.param_counts()
    return {
        "model": shape.name,
        "gpu": deployment.gpu.name,
        "num_gpus": plan.num_gpus,
        "tp": plan.tp,
        "min_tp": plan.min_tp,
        "data_parallel_replicas": plan.num_gpus // plan.tp,
        "weight_dtype": deployment.weight_dtype,
        "kv_dtype": deployment.kv_dtype,
        "compute_dtype": plan.ceilings.compute_dtype,
        "ceilings": {
            "bandwidth_bytes_s": plan.ceilings.bandwidth_bytes_s,
            "flops": plan.ceilings.flops,
            "ops_per_byte": plan.ceilings.ops_per_byte,
            "source": plan.ceilings.source,
        },
        "params": counts.total,
        "active_params_per_token": matmul_flops_per_token(shape) // 2,
        "weight_bytes": memory.weight_bytes,
        "weight_bytes_per_gpu": memory.weight_bytes_per_gpu,
        "kv_bytes_per_token": memory.kv_bytes_per_token,
        "kv_bytes_per_token_per_gpu": memory.kv_bytes_per_token_per_gpu,
        "usable_bytes_per_gpu": memory.usable_bytes_per_gpu,
        "reserve_bytes_per_gpu": memory.reserve_bytes_per_gpu,
        "kv_cache_bytes_per_gpu": memory.kv_cache_bytes_per_gpu,
        "kv_capacity_tokens": memory.kv_capacity_tokens,
        "context_len": memory.context_len,
        "max_concurrent_seqs": memory.max_concurrent_seqs,
        "batch": decode.batch,
        "decode_context_len": decode.context_len,
        "decode_bytes_per_step": decode.bytes_moved,
        "decode_flops_per_step": decode.flops,
        "decode_step_floor_s": decode.floor_s,
        "decode_bound": decode.bound,
        "decode_tok_s_ceiling": decode.tok_s_per_seq,
        "decode_tok_s_aggregate": decode.tok_s_aggregate,
        "decode_arithmetic_intensity": decode.arithmetic_intensity,
        "ops_per_byte": plan.ceilings.ops_per_byte,
        "compute_bound_batch": plan.compute_bound_batch,
        "compute_bound_batch_weights_only": plan.compute_bound_batch_weights_only,
        "target_concurrency": plan.target_concurrency.seqs,
        "target_concurrency_bound": plan.target_concurrency.bound,
        "input_len": prefill.tokens,
        "prefill_flops": prefill.flops,
        "prefill_bytes": prefill.bytes_moved,
        "prefill_floor_s": prefill.floor_s,
        "prefill_bound": prefill.bound,
        "prefill_arithmetic_intensity": prefill.arithmetic_intensity,
        "decode_points": [point_json(p) for p in plan.decode_points],
        "speculative": None if plan.speculative is None else speculative_json(plan.speculative),
        "notes": plan.notes,
    }


def speculative_json(spec: SpeculativePlan) -> dict[str, Any]:
    return {
        "num_speculative_tokens": spec.num_speculative_tokens,
        "acceptance": spec.acceptance,
        "tokens_per_step": spec.tokens_per_step,
        "verify": point_json(spec.verify),
        "verify_cost": spec.verify_cost,
        "verify_cost_source": spec.verify_cost_source,
        "draft_cost": spec.draft_cost,
        "speedup": spec.speedup,
        "break_even_batch": spec.break_even_batch,
    }


def si(value: float, unit: str) -> str:
    """1.23e12 FLOP -> '1.23 TFLOP'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def format_plan(plan: Plan) -> str:
    deployment, memory, ceilings = plan.deployment, plan.memory, plan.ceilings
    shape, gpu = deployment.shape, deployment.gpu
    lines = [
        f"{shape.name} on {plan.tp} x {gpu.name} (tp {plan.tp} of {plan.num_gpus} GPUs), "
        f"{deployment.weight_dtype} weights, {deployment.kv_dtype} KV cache",
        f"ceilings ({ceilings.source}): {ceilings.bandwidth_bytes_s / 1e12:.2f} TB/s, "
        f"{ceilings.flops / 1e12:.0f} {ceilings.compute_dtype} TFLOP/s; ops:byte {ceilings.ops_per_byte:.0f}",
        "",
        "memory (per GPU)",
        f"  {'weights':<34}{si(memory.weight_bytes_per_gpu, 'B'):>14}   "
        f"whole model {si(memory.weight_bytes, 'B')}, {shape.param_counts().total / 1e9:.2f} B params",
        f"  {'KV per token':<34}{memory.kv_bytes_per_token_per_gpu:>12,} B   "
        f"whole model {memory.kv_bytes_per_token:,} B",
        f"  {'usable':<34}{si(memory.usable_bytes_per_gpu, 'B'):>14}   "
        f"{deployment.gpu_memory_utilization:.0%} of {gpu.memory_bytes / 2**30:.1f} GiB",
        f"  {'activation + overhead reserve':<34}{si(memory.reserve_bytes_per_gpu, 'B'):>14}",
        f"  {'KV cache':<34}{si(max(memory.kv_cache_bytes_per_gpu, 0), 'B'):>14}   "
        f"{memory.kv_capacity_tokens:,} tokens",
        f"  {f'max sequences of {memory.context_len:,} tokens':<34}{memory.max_concurrent_seqs:>14,}",
        f"  {'smallest TP degree that fits':<34}{plan.min_tp:>14}",
        "",
        f"decode roofline (each sequence attends to {plan.decode.context_len:,} cached tokens)",
        f"  {'batch':>7} {'bytes/step':>12} {'FLOPs/step':>13} {'floor':>10} {'bound':>10} "
        f"{'tok/s/seq':>10} {'tok/s total':>12} {'FLOP/B':>8}",
    ]
    for point in plan.decode_points:
        lines.append(
            f"  {point.batch:>7,} {si(point.bytes_moved, 'B'):>12} {si(point.flops, 'FLOP'):>13} "
            f"{format_seconds(point.floor_s):>10} {point.bound:>10} {point.tok_s_per_seq:>10.1f} "
            f"{point.tok_s_aggregate:>12.1f} {point.arithmetic_intensity:>8.1f}"
        )
    never = "never (each sequence adds more KV bytes than its FLOPs can hide)"
    at_context = never if plan.compute_bound_batch is None else f"batch {plan.compute_bound_batch:,}"
    weights_only = plan.compute_bound_batch_weights_only
    lines.append(
        f"  turns compute-bound at: {at_context}; "
        f"with no KV read: {'never' if weights_only is None else f'batch {weights_only:,}'}"
    )
    target = plan.target_concurrency
    lines.append(f"  target concurrency per replica: {target.seqs:,} ({TARGET_BOUNDS[target.bound]})")
    prefill = plan.prefill
    lines += [
        "",
        f"prefill of {prefill.tokens:,} tokens",
        f"  {si(prefill.flops, 'FLOP')}, {si(prefill.bytes_moved, 'B')} moved, intensity "
        f"{prefill.arithmetic_intensity:,.0f} FLOP/B: {prefill.bound}-bound, TTFT floor "
        f"{format_seconds(prefill.floor_s)}",
    ]
    if plan.speculative is not None:
        lines += ["", *format_speculative(plan.speculative, plan.decode.batch)]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def format_speculative(spec: SpeculativePlan, batch: int) -> list[str]:
    k = spec.num_speculative_tokens
    stops = (
        "never (the step stays bandwidth-bound)"
        if spec.break_even_batch is None
        else (f"batch {spec.break_even_batch:,}")
    )
    draft = (
        "none (a proposer without a model, e.g. n-gram)"
        if spec.draft_cost == 0
        else (f"{spec.draft_cost:.3f} of a decode step per draft token")
    )
    cost = f"{spec.verify_cost:.3f}x a decode step"
    floor = f"roofline floor {format_seconds(spec.verify.floor_s)}, {spec.verify.bound}-bound"
    return [
        f"speculative decoding: {k} draft tokens a step, acceptance {spec.acceptance:.2f}",
        f"  {'tokens per verify step (tau)':<34}{spec.tokens_per_step:.2f}",
        f"  {f'verify step at batch {batch:,}':<34}{cost} ({spec.verify_cost_source}; {floor})",
        f"  {'draft cost':<34}{draft}",
        f"  {f'predicted speed-up at batch {batch:,}':<34}{spec.speedup:.2f}x",
        f"  {'stops paying at (roofline)':<34}{stops}",
    ]
