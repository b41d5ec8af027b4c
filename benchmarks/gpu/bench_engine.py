"""GPU benchmarks of the whole engine on dummy weights, each printed and written as JSON:
  ceilings    measured copy bandwidth and bf16 matmul rate (the roofline)
  decode      batch-1 decode, Llama-3.1-8B shape, 128-token prompt, 256 new tokens
  prefill     TTFT of one 8,192-token prompt, Llama-3.1-8B shape
  throughput  256 requests, lengths uniform in 100..1024 (nano-vllm's workload), ours and the peer
  speculative batch-1 decode with the replay proposer (an earlier greedy run's tokens as drafts, k=4),
              every draft right and a share corrupted: tok/s against plain decode, the verify step's
              cost against a plain step, and the speed-up the planner predicts from the acceptance
Usage: python benchmarks/gpu/bench_engine.py MODE [--shape NAME] [--out FILE] [options]"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import (  # noqa: E402
    decode_expert_bytes,
    decode_weight_bytes,
    kv_bytes_per_token,
    planned_decode_step,
    prefill_flops,
    shape_dir,
    workload_floor,
)

from tokenmill import LLM, SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_time(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats, by CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def ceilings(args) -> dict:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = cuda_time(lambda: dst.copy_(src), 20)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_s = cuda_time(lambda: a @ b, 20)
    return {
        "copy_bandwidth_Bps": 2 * n / copy_s,
        "bf16_matmul_flops": 2 * 8192**3 / mm_s,
        "device": torch.cuda.get_device_name(),
    }


def dummy_llm(shape: str, config_overrides: dict | None = None, **options) -> LLM:
    """An engine on random weights of a named shape, ids in and ids out (no tokenizer)."""
    defaults = dict(
        load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, gpu_memory_utilization=0.9
    )
    return LLM(model=shape_dir(shape, **(config_overrides or {})), **{**defaults, **options})


def make_llm(args, **overrides) -> LLM:
    options = dict(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        block_size=args.block_size,
    )
    return dummy_llm(args.shape, json.loads(args.config_overrides), **{**options, **overrides})


def timed_generate(llm: LLM, prompts, params) -> float:
    sync()
    start = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    sync()
    return time.perf_counter() - start


def decode(args) -> dict:
    llm = make_llm(args)
    rng = random.Random(0)
    # --batch requests decode together; distinct prompts, so none is a prefix-cache hit of another.
    prompt = [[rng.randint(0, 10000) for _ in range(args.input_len)] for _ in range(args.batch)]
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    timed_generate(llm, prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # warm-up
    ttft = statistics.median(timed_generate(llm, prompt, first) for _ in range(args.repeats + 2))
    total = statistics.median(timed_generate(llm, prompt, full) for _ in range(args.repeats))
    step_s = (total - ttft) / (args.output_len - 1)
    tok_s = 1 / step_s  # per sequence
    mean_context = args.input_len + args.output_len / 2
    kv_element = 1 if args.kv_cache_dtype == "fp8" else 2
    kv_bytes = kv_bytes_per_token(args.shape) // 2 * kv_element * mean_context * args.batch
    weight_dtype = {"fp8": "fp8", "int4": "int4"}.get(args.quantization or "", "bf16")
    experts = decode_expert_bytes(args.shape, args.batch, weight_dtype)
    bytes_per_step = decode_weight_bytes(args.shape, weight_dtype) + experts + kv_bytes
    plan = planned_decode_step(
        args.shape, args.batch, int(mean_context), args.tensor_parallel_size, weight_dtype,
        "fp8" if args.kv_cache_dtype == "fp8" else "bf16",
    )  # fmt: skip
    return {
        "shape": args.shape,
        "batch": args.batch,
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
        "quantization": args.quantization,
        "decode_step_ms": step_s * 1e3,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "ttft_s": ttft,
        "total_s": total,
        "decode_tok_s": tok_s,
        "bytes_per_step": bytes_per_step,
        "tensor_parallel_size": args.tensor_parallel_size,
        **plan,
        "ratio_to_plan": plan["plan_step_ms"] / (step_s * 1e3),
        "cuda_graphs": llm.engine.runner.decode_graphs is not None,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "attention_backend": os.environ.get("TOKENMILL_ATTENTION_BACKEND", "default"),
    }


def prefill(args) -> dict:
    llm = make_llm(args)
    rng = random.Random(0)
    prompt = [[rng.randint(0, 10000) for _ in range(args.input_len)]]
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    timed_generate(llm, prompt, first)  # warm-up (and Triton compilation)
    times = []
    for _ in range(5):
        llm.engine.scheduler.kv.reset_prefix_cache()
        times.append(timed_generate(llm, prompt, first))
    ttft = statistics.median(times)
    flops = prefill_flops(args.shape, args.input_len)
    return {
        "shape": args.shape,
        "input_len": args.input_len,
        "ttft_s": ttft,
        "flops": flops,
        "achieved_flops": flops / ttft,
        "attention_backend": os.environ.get("TOKENMILL_ATTENTION_BACKEND", "default"),
    }


def workload(seed: int, count: int):
    """nano-vllm's benchmark requests: random ids below 10000, lengths uniform in 100..1024."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    return prompts[:count], max_tokens[:count]


def run_ours(args, prompts, max_tokens) -> dict:
    llm = make_llm(args)
    # Warm-up at full length: every prompt once with a few tokens, so kernel variants are compiled.
    warm = SamplingParams(max_tokens=16, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=warm, use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    results = {}
    for label, count in (("subset", args.peer_requests), ("all", len(prompts))):
        seconds = timed_generate(llm, prompts[:count], params[:count])
        results[label] = {
            "requests": count,
            "output_tokens": sum(max_tokens[:count]),
            "seconds": seconds,
            "output_tok_s": sum(max_tokens[:count]) / seconds,
        }
    del llm
    return results


def run_peer(args, prompts, max_tokens) -> dict:
    """Hugging Face transformers' continuous batching on the same requests (paged|sdpa attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(shape_dir(args.shape))
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="paged|sdpa"
        )
    model.eval()
    generation_config = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max(max_tokens),
        eos_token_id=-1,
        pad_token_id=0,
    )
    manager = model.init_continuous_batching(generation_config=generation_config)
    manager.start()
    try:
        sync()
        start = time.perf_counter()
        for i, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=limit)
        done, produced = 0, 0
        while done < len(prompts) and time.perf_counter() - start < args.peer_timeout:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                produced += len(result.generated_tokens)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=10)
    return {
        "requests": len(prompts),
        "finished": done,
        "output_tokens": produced,
        "seconds": seconds,
        "output_tok_s": produced / seconds,
    }


def throughput(args) -> dict:
    prompts, max_tokens = workload(args.seed, args.num_requests)
    result = {"shape": args.shape, "seed": args.seed, "ours": run_ours(args, prompts, max_tokens)}
    torch.cuda.empty_cache()
    if torch.cuda.is_available() and args.tensor_parallel_size == 1 and args.quantization is None:
        # The roofline of the whole workload: its floor of bytes and FLOPs at this card's measured rates.
        card = ceilings(args)
        moved, flops = workload_floor(args.shape, [len(p) for p in prompts], max_tokens)
        floor_s = moved / card["copy_bandwidth_Bps"] + flops / card["bf16_matmul_flops"]
        result["roofline"] = {
            **card,
            "floor_bytes": moved,
            "floor_flops": flops,
            "floor_s": floor_s,
            "roofline_tok_s": sum(max_tokens) / floor_s,
            "ratio_to_roofline": floor_s / result["ours"]["all"]["seconds"],
        }
    if args.peer_requests > 0:
        try:
            result["peer"] = run_peer(args, prompts[: args.peer_requests], max_tokens[: args.peer_requests])
            result["ratio_to_peer"] = (
                result["ours"]["subset"]["output_tok_s"] / result["peer"]["output_tok_s"]
            )
        except Exception as exc:  # the peer failing must not lose our own numbers
            result["peer_error"] = f"{type(exc).__name__}: {exc}"
    return result


def greedy_stable(llm) -> None:
    """Dummy weights whose greedy path no rounding can change: every layer's output projections (o_proj,
    down_proj) scaled by 1e-3 and the embeddings by 50, so the residual stream is the token's embedding,
    and the LM head's row j the embedding of token perm[j], so the next token is a fixed permutation of
    the last with a wide margin. The shapes, and so every kernel and its cost, are the model's. With
    plain dummy weights the top logits are near ties, and a verify step's different rounding moves the
    greedy path off a replayed run within a few tokens (measured: 0.1% of replayed drafts accepted)."""
    model = llm.engine.runner.model
    vocab = model.config.vocab_size
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).to(embed.device)
    with torch.no_grad():
        head[:vocab].copy_(embed[:vocab][perm])
        embed.mul_(50)
        for layer in model.model.layers:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.weight.mul_(1e-3)


def replay_ms(graphs) -> float | None:
    """Device time of one replay of the batch-1 graph (on whatever its buffers hold): the step's GPU cost
    without the host's share."""
    if graphs is None or not torch.cuda.is_available():
        return None
    graph = graphs.graphs[graphs.sizes[0]]
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 20


def step_phases(engines: dict, prompt, params) -> dict:
    """Each engine's step loop with its phases timed in place (profile_host_loop.py's), plus the wait for
    the device inside the wait for tokens: what the host does between the device's steps. The wrappers
    stay on the engines, so this runs after their timed runs."""
    from profile_host_loop import _timed, instrument
    from profile_host_loop import run as phase_run

    synchronize = torch.cuda.Event.synchronize if torch.cuda.is_available() else None
    report = {}
    for name, llm in engines.items():
        seconds = instrument(llm)
        runner = llm.engine.runner
        for graphs in (runner.decode_graphs, runner.verify_graphs):
            if graphs is not None:
                _timed(graphs, "run", "graph inputs copied, replayed (in launch)", seconds)
        _timed(runner, "propose", "propose (in the tokens wait)", seconds)
        if synchronize is not None:

            def timed_sync(event, _seconds=seconds):
                start = time.perf_counter()
                synchronize(event)
                _seconds["device wait (in the tokens wait)"] += time.perf_counter() - start

            torch.cuda.Event.synchronize = timed_sync
        try:
            phase_run(llm, seconds, prompt, params)  # warm: the wrappers' first calls
            report[name] = phase_run(llm, seconds, prompt, params)
        finally:
            if synchronize is not None:
                torch.cuda.Event.synchronize = synchronize
    return report


def speculative(args) -> dict:
    """Batch 1 with the replay proposer (an earlier greedy run's tokens, corrupted at a set rate) on
    greedy-stable dummy weights: tok/s, acceptance, the verify step's cost and the planner's speed-up at
    that cost. Then n-gram with the engine's dynamic speculation against no speculation at batches of
    --spec-batches (random prompts: drafts seldom accepted, so speculation should switch itself off)."""
    from tokenmill.plan.speculative import speedup, tokens_per_verify_step
    from tokenmill.spec_decode import NgramProposer, ReplayProposer

    k = args.num_speculative_tokens
    rng = random.Random(0)
    prompt = [[rng.randint(0, 10000) for _ in range(args.input_len)]]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    # Both engines stay up (the batch comparison uses them again): each takes under half of the memory.
    plain = make_llm(args, gpu_memory_utilization=0.45)
    greedy_stable(plain)
    timed_generate(plain, prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    output = plain.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)[0].outputs[0]
    recorded = (prompt[0], output.token_ids)
    plain_s = statistics.median(timed_generate(plain, prompt, params) for _ in range(args.repeats))
    # The prompt's step (prefill and first token), to take its share out of the per-step figures.
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    plain_ttft = statistics.median(timed_generate(plain, prompt, first) for _ in range(args.repeats + 2))
    plain_step = (plain_s - plain_ttft) / (args.output_len - 1)
    spec = make_llm(
        args, gpu_memory_utilization=0.45, speculative_config={"method": "ngram", "num_speculative_tokens": k}
    )
    greedy_stable(spec)
    spec_ttft = statistics.median(timed_generate(spec, prompt, first) for _ in range(args.repeats + 2))
    result = {
        "k": k,
        "plain_tok_s": args.output_len / plain_s,
        "plain_step_ms": plain_step * 1e3,
        "ttft_ms": {"plain": plain_ttft * 1e3, "speculative": spec_ttft * 1e3},
        "runs": [],
        "batches": [],
    }
    scheduler = spec.engine.scheduler
    for corrupt in (0.0, 0.2, 0.5):
        spec.engine.runner.drafter.proposer = ReplayProposer([recorded], k, corrupt_rate=corrupt, seed=1)
        timed_generate(spec, prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        counters = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        before = [getattr(scheduler.spec, c) for c in counters]
        steps_before = spec.engine.core.num_steps
        times, outputs = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            outputs.append(spec.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False))
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        decode_steps = (spec.engine.core.num_steps - steps_before) / args.repeats - 1  # all but the prompt's
        verify_step = (seconds - spec_ttft) / decode_steps
        drafts, proposed, accepted = (getattr(scheduler.spec, c) - b for c, b in zip(counters, before))
        acceptance = accepted / proposed if proposed else 0.0
        # Each verifying step took (seconds / steps per run); a plain step plain_s / output_len.
        verify_cost = (seconds / drafts * args.repeats) / (plain_s / args.output_len) if drafts else None
        result["runs"].append({
            "corrupt_rate": corrupt,
            "acceptance": acceptance,
            "same_tokens_as_plain": all(o[0].outputs[0].token_ids == output.token_ids for o in outputs),
            "tokens_per_verify_step": 1 + accepted / drafts if drafts else None,
            "tok_s": args.output_len / seconds,
            "speedup": plain_s / seconds,
            "verify_step_cost_vs_plain": verify_cost,
            # The same per step with the prompt's step taken out of both runs: what the goal asks.
            "verify_step_ms": verify_step * 1e3,
            "verify_step_vs_plain_step": verify_step / plain_step,
            # The planner's model: each draft accepted with probability a = 1 - corrupt_rate, given the
            # ones before it (the mean of accepted / proposed is a different quantity).
            "planner_tau_at_set_rate": tokens_per_verify_step(k, 1 - corrupt),
            "planner_speedup_at_set_rate": (
                speedup(tokens_per_verify_step(k, 1 - corrupt), verify_cost, k, 0.0) if verify_cost else None
            ),
            "speedup_if_all_accepted": (k + 1) / verify_cost if verify_cost else None,
        })  # fmt: skip
    result["graph_replay_ms"] = {
        "decode_batch1": replay_ms(plain.engine.runner.decode_graphs),
        "verify_batch1": replay_ms(spec.engine.runner.verify_graphs),
    }
    spec.engine.runner.drafter.proposer = ReplayProposer([recorded], k, corrupt_rate=0.0, seed=1)
    result["host_phases"] = step_phases({"plain": plain, "speculative": spec}, prompt, params)
    spec.engine.runner.drafter.proposer = NgramProposer(k, 1, 4)
    for batch in args.spec_batches:
        prompts = [[rng.randint(0, 10000) for _ in range(args.input_len)] for _ in range(batch)]
        row = {"batch": batch}
        for name, llm in (("plain", plain), ("speculative", spec)):
            timed_generate(llm, prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            drafts_before = scheduler.spec.num_drafts
            seconds = statistics.median(timed_generate(llm, prompts, params) for _ in range(args.repeats))
            row[f"{name}_tok_s"] = batch * args.output_len / seconds
            if llm is spec:
                row["verifying_steps"] = (scheduler.spec.num_drafts - drafts_before) / args.repeats
        row["ratio"] = row["speculative_tok_s"] / row["plain_tok_s"]
        result["batches"].append(row)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["ceilings", "decode", "prefill", "throughput", "speculative"])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--config-overrides", default="{}", help="JSON merged into the shape's config")
    parser.add_argument("--out")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--quantization", help="fp8 | int4: online FP8 (W8A8) or INT4 (W4A16) of the dummy weights"
    )
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8")
    parser.add_argument("--block-size", type=int, default=16, help="tokens a KV-cache page")
    parser.add_argument("--dtype", default="auto", help="the model's dtype (float32 for a CPU smoke run)")
    parser.add_argument("--batch", type=int, default=1, help="decode: requests decoding together")
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks (GPUs) the model is split over"
    )
    parser.add_argument("--repeats", type=int, default=3, help="decode: timed runs (medians)")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while step N runs (default: the engine's, on for CUDA)",
    )
    parser.add_argument("--enable-expert-parallel", action="store_true", help="MoE under TP: whole experts")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer-requests", type=int, default=16)
    parser.add_argument("--peer-timeout", type=float, default=120)
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="speculative: k")
    parser.add_argument(
        "--spec-batches",
        type=lambda v: [int(b) for b in v.split(",") if b],
        default=[64, 128],
        help="speculative: batches where dynamic speculation is compared with none (comma-separated)",
    )
    args = parser.parse_args()
    result = {"mode": args.mode, "async_scheduling": args.async_scheduling, **globals()[args.mode](args)}
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
