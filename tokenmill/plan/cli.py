"""`tokenmill plan`: does the model fit, how many sequences, how fast can it possibly go, what binds it;
and with --calibrate, how close a measured run came to that."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tokenmill.config import EngineConfig
from tokenmill.plan.calibrate import calibration_rows, format_calibration, parse_bench_result, read_bench_json
from tokenmill.plan.catalogue import MODELS, checkpoint_weight_dtype, resolve_model
from tokenmill.plan.gpus import (
    GPUS,
    MEASURED,
    GpuSpec,
    RooflineCeilings,
    ceilings_for,
    custom_gpu,
    resolve_gpu,
)
from tokenmill.plan.memory import KV_DTYPES, WEIGHT_DTYPES, Deployment
from tokenmill.plan.model_shape import ModelShape
from tokenmill.plan.report import Plan, build_plan, format_plan, plan_json
from tokenmill.plan.speculative import plan_speculative

DEFAULT_CONTEXT = 8192
T = TypeVar("T")
SIZE_FLAGS = (
    "num_gpus", "tp", "context", "batch", "input_len", "output_len", "max_num_batched_tokens", "max_num_seqs",
    "tpot_ms",
)  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="memory, capacity and roofline planner",
        description="Plan a deployment: weight and KV memory, concurrent sequences, the decode and prefill "
        "roofline; or, with --calibrate, compare a benchmark result with that roofline.",
    )
    parser.add_argument(
        "--model", help=f"catalogue name ({', '.join(MODELS)}), 'default', a model directory or a .gguf file"
    )
    parser.add_argument(
        "--gpu", help=f"{', '.join(GPUS)}, or custom (with --memory-gb, --bandwidth-tbs, --tflops)"
    )
    parser.add_argument("--num-gpus", type=int, help="GPUs available (default: --tp, else 1)")
    parser.add_argument("--tp", type=int, help="tensor-parallel degree (default: the smallest that fits)")
    parser.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        help="default: a quantized checkpoint's own (from its quantization_config), else bf16",
    )
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16")
    parser.add_argument(
        "--context",
        type=int,
        help=f"tokens one sequence holds (default {DEFAULT_CONTEXT}, or input + output)",
    )
    parser.add_argument(
        "--batch", type=int, help="decode batch to plan (default 1; with --calibrate: measured)"
    )
    parser.add_argument("--input-len", type=int, help="prompt tokens (give with --output-len)")
    parser.add_argument("--output-len", type=int, help="generated tokens (give with --input-len)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="sizes the activation reserve"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
        help="the engine's running batch, as `tokenmill serve --max-num-seqs` (caps the target concurrency)",
    )  # fmt: skip
    parser.add_argument(
        "--tpot-ms", type=float,
        help="time-per-output-token target: the target concurrency is then no larger than the biggest "
        "decode batch whose roofline floor meets it",
    )  # fmt: skip
    parser.add_argument(
        "--measured", action="store_true", help="use our measured ceilings instead of the datasheet"
    )
    parser.add_argument("--memory-gb", type=float, help="--gpu custom: memory in GB")
    parser.add_argument("--bandwidth-tbs", type=float, help="--gpu custom: memory bandwidth in TB/s")
    parser.add_argument("--tflops", type=float, help="--gpu custom: dense tensor TFLOP/s")
    parser.add_argument(
        "--speculative", type=int, metavar="K", help="speculative decoding: K draft tokens per verify step"
    )
    parser.add_argument(
        "--acceptance", type=float, help="with --speculative: the chance each draft token is accepted"
    )
    parser.add_argument(
        "--draft-cost", type=float, default=0.0,
        help="with --speculative: one draft token's cost as a fraction of a decode step (0: n-gram)",
    )  # fmt: skip
    parser.add_argument(
        "--verify-cost", type=float,
        help="with --speculative: a measured verify step / decode step ratio, instead of the roofline's",
    )  # fmt: skip
    parser.add_argument("--chart", type=Path, metavar="PNG", help="write the roofline chart here")
    parser.add_argument("--calibrate", type=Path, metavar="RESULT.json", help="a `tokenmill bench` result")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for flag in SIZE_FLAGS:
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if args.gpu != "custom":
        given = [f for f in ("memory_gb", "bandwidth_tbs", "tflops") if getattr(args, f) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} applies to --gpu custom only")
    if args.speculative is None:
        given = [f for f in ("acceptance", "verify_cost") if getattr(args, f) is not None]
        if given or args.draft_cost:
            raise ValueError(f"--{(given or ['draft_cost'])[0].replace('_', '-')} goes with --speculative K")
    elif args.acceptance is None:
        raise ValueError("--speculative needs --acceptance (the chance each draft token is accepted)")
    if args.calibrate is not None:
        return run_calibrate(args)
    if args.model is None or args.gpu is None:
        raise ValueError("tokenmill plan needs --model and --gpu")
    if (args.input_len is None) != (args.output_len is None):
        raise ValueError("--input-len and --output-len go together: give both or neither")
    shape = resolve_model(args.model)
    args.weight_dtype = args.weight_dtype or checkpoint_weight_dtype(args.model) or "bf16"
    gpu = gpu_from_args(args.gpu, args)
    if args.input_len is None:
        context = args.context or DEFAULT_CONTEXT
        input_len, decode_context_len = context, context  # a full-context prompt: the worst case
    else:
        context = args.context or args.input_len + args.output_len
        if context < args.input_len + args.output_len:
            raise ValueError(
                f"--context {context} is shorter than --input-len + --output-len "
                f"({args.input_len + args.output_len})"
            )
        input_len, decode_context_len = args.input_len, args.input_len + args.output_len // 2
    deployment = deployment_from_args(shape, gpu, context, args)
    ceilings = ceilings_for(gpu, args.weight_dtype, args.measured)
    plan = build_plan(
        deployment,
        ceilings,
        num_gpus=args.num_gpus or args.tp or 1,
        tp=args.tp,
        batch=args.batch or 1,
        decode_context_len=decode_context_len,
        input_len=input_len,
        max_num_seqs=args.max_num_seqs,
        tpot_s=None if args.tpot_ms is None else args.tpot_ms / 1e3,
    )
    if args.speculative is not None:
        spec = plan_speculative(
            deployment, ceilings, plan.tp, plan.decode.batch, decode_context_len,
            num_speculative_tokens=args.speculative, acceptance=args.acceptance,
            draft_cost=args.draft_cost, measured_verify_cost=args.verify_cost,
        )  # fmt: skip
        plan = plan._replace(speculative=spec)
    chart = write_chart(args.chart, plan, []) if args.chart else None
    if args.json:
        print(json.dumps({**plan_json(plan), "chart": str(chart) if chart else None}, indent=2))
    else:
        print(format_plan(plan))
        if chart:
            print(f"chart: {chart}")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    path: Path = args.calibrate
    result = parse_bench_result(read_bench_json(path), args.batch)
    shape = _named_in_result(args.model, result.model, "model", path, resolve_model)
    args.weight_dtype = args.weight_dtype or checkpoint_weight_dtype(args.model or result.model) or "bf16"
    gpu = _named_in_result(args.gpu, result.gpu, "gpu", path, lambda name: gpu_from_args(name, args))
    context = args.context or result.input_len + result.output_len
    deployment = deployment_from_args(shape, gpu, context, args)
    plan = build_plan(
        deployment,
        ceilings_for(gpu, args.weight_dtype, args.measured),
        num_gpus=args.num_gpus or args.tp or 1,
        tp=args.tp,
        batch=result.batch,
        decode_context_len=result.decode_context_len,
        input_len=result.input_len,
        max_num_seqs=args.max_num_seqs,
        tpot_s=None if args.tpot_ms is None else args.tpot_ms / 1e3,
    )
    rows = calibration_rows(result, plan.decode, plan.prefill)
    measured = [
        ("measured decode", plan.decode.arithmetic_intensity, plan.decode.flops / (result.mean_tpot_ms / 1e3))
    ]
    chart = write_chart(args.chart, plan, measured) if args.chart else None
    if args.json:
        print(
            json.dumps(
                {
                    "result": str(path),
                    "concurrency": result.concurrency,
                    "concurrency_source": result.concurrency_source,
                    "input_len": result.input_len,
                    "output_len": result.output_len,
                    "rows": [row._asdict() for row in rows],
                    "plan": plan_json(plan),
                    "chart": str(chart) if chart else None,
                },
                indent=2,
            )
        )
    else:
        title = (
            f"{path.name}: {shape.name} on {plan.tp} x {gpu.name}, {deployment.weight_dtype} weights, "
            f"{deployment.kv_dtype} KV ({plan.ceilings.source} ceilings)"
        )
        print(format_calibration(title, result, rows))
        if chart:
            print(f"chart: {chart}")
    return 0


def _named_in_result(
    flag_value: str | None, named: str | None, what: str, path: Path, resolve: Callable[[str], T]
) -> T:
    """The --model/--gpu flag wins; otherwise the benchmark result must name something we can resolve."""
    if flag_value is not None:
        return resolve(flag_value)
    if named is None:
        raise ValueError(f"{path.name} does not say which {what} it measured; pass --{what}")
    try:
        return resolve(named)
    except ValueError as exc:
        raise ValueError(
            f"{path.name} names {what} {named!r}, which the planner cannot use ({exc}); pass --{what}"
        ) from exc


def gpu_from_args(name: str, args: argparse.Namespace) -> GpuSpec:
    if name == "custom":
        if args.measured:
            raise ValueError("--measured has no figures for --gpu custom")
        return custom_gpu(args.memory_gb, args.bandwidth_tbs, args.tflops)
    return resolve_gpu(name)


def deployment_from_args(
    shape: ModelShape, gpu: GpuSpec, context: int, args: argparse.Namespace
) -> Deployment:
    return Deployment(
        shape=shape,
        gpu=gpu,
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
        context_len=context,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )


def write_chart(path: Path, plan: Plan, measured: list[tuple[str, float, float]]) -> Path:
    from tokenmill.plan.chart import write_roofline_chart

    gpu = plan.deployment.gpu
    roofs: list[RooflineCeilings] = [plan.ceilings]
    if gpu.name in MEASURED:  # draw the other roof too: the gap between them is the honest error bar
        roofs.append(
            ceilings_for(gpu, plan.deployment.weight_dtype, measured=plan.ceilings.source == "datasheet")
        )
    title = (
        f"{plan.deployment.shape.name} on {plan.tp} x {gpu.name}: {plan.deployment.weight_dtype} weights, "
        f"{plan.deployment.kv_dtype} KV"
    )
    try:
        return write_roofline_chart(path, roofs, [*plan.decode_points, plan.prefill], title, measured)
    except OSError as exc:
        raise ValueError(f"cannot write the chart to {path}: {exc.strerror or exc}") from exc
