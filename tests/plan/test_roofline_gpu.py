"""The roofline held against a measured run: a plain-torch Llama-3.1-8B-shaped forward (random bf16 weights,
CUDA-graphed decode, flash SDPA) on the card must never beat the planned floor, and batch-1 decode must
come within reach of it. Set PLAN_GPU_REPORT=path.json to keep the measured table."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from tokenmill.plan.catalogue import MODELS
from tokenmill.plan.gpus import ceilings_for, resolve_gpu
from tokenmill.plan.memory import Deployment
from tokenmill.plan.roofline import decode_point, prefill_point

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = MODELS["llama-3.1-8b"]
DECODE_CASES = [(1, 512), (32, 2048), (256, 1024)]  # (batch, cached tokens per sequence)
PREFILL_LEN = 4096


def make_weights(device: torch.device) -> dict[str, list[torch.Tensor] | torch.Tensor]:
    hidden, heads, kv_heads, head_dim = (
        SHAPE.hidden_size,
        SHAPE.num_attention_heads,
        SHAPE.num_kv_heads,
        SHAPE.head_dim,
    )

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16) * 0.02

    layers = range(SHAPE.num_layers)
    return {
        "qkv": [linear((heads + 2 * kv_heads) * head_dim, hidden) for _ in layers],
        "o": [linear(hidden, heads * head_dim) for _ in layers],
        "gate_up": [linear(2 * SHAPE.intermediate_size, hidden) for _ in layers],
        "down": [linear(hidden, SHAPE.intermediate_size) for _ in layers],
        "lm_head": linear(SHAPE.vocab_size, hidden),
    }


def forward(
    x: torch.Tensor, weights: dict, caches: list[tuple[torch.Tensor, torch.Tensor]] | None
) -> torch.Tensor:
    """x: [tokens, hidden]. With caches: one decode token per sequence attending to the cache; without:
    one causal prompt. Returns the logits of the last token of each sequence."""
    heads, kv_heads, head_dim = SHAPE.num_attention_heads, SHAPE.num_kv_heads, SHAPE.head_dim
    tokens = x.shape[0]
    for layer in range(SHAPE.num_layers):
        h = F.rms_norm(x, (SHAPE.hidden_size,))
        q, k, v = F.linear(h, weights["qkv"][layer]).split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
        )
        if caches is None:
            q = q.view(1, tokens, heads, head_dim).transpose(1, 2)
            k = k.view(1, tokens, kv_heads, head_dim).transpose(1, 2)
            v = v.view(1, tokens, kv_heads, head_dim).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k_cache, v_cache = caches[layer]
            q = q.view(tokens, heads, 1, head_dim)
            attn = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
        x = x + F.linear(attn.transpose(1, 2).reshape(tokens, heads * head_dim), weights["o"][layer])
        gate, up = F.linear(F.rms_norm(x, (SHAPE.hidden_size,)), weights["gate_up"][layer]).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, weights["down"][layer])
    last = x if caches is not None else x[-1:]
    return F.linear(F.rms_norm(last, (SHAPE.hidden_size,)), weights["lm_head"])


def median_time_s(run, iterations: int) -> float:
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def time_decode(weights: dict, batch: int, context_len: int, device: torch.device) -> float:
    cache_shape = (batch, SHAPE.num_kv_heads, context_len, SHAPE.head_dim)
    # K and V apart: one shared tensor would let the V reads hit in L2 behind the K reads.
    caches = [
        tuple(torch.randn(cache_shape, device=device, dtype=torch.bfloat16) for _ in range(2))
        for _ in range(SHAPE.num_layers)
    ]
    x = torch.randn(batch, SHAPE.hidden_size, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward(x, weights, caches)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(x, weights, caches)
    seconds = median_time_s(graph.replay, iterations=20)
    del graph, caches
    torch.cuda.empty_cache()
    return seconds


def test_measured_forward_never_beats_the_floor():
    device = torch.device("cuda")
    gpu = resolve_gpu(torch.cuda.get_device_name())
    deployment = Deployment(SHAPE, gpu)
    datasheet = ceilings_for(gpu, "bf16", measured=False)
    torch.manual_seed(0)
    weights = make_weights(device)
    rows = []
    for batch, context_len in DECODE_CASES:
        planned = decode_point(deployment, datasheet, 1, batch, context_len)
        measured = time_decode(weights, batch, context_len, device)
        rows.append(("decode", batch, context_len, measured, planned.floor_s, planned.bound))
    prompt = torch.randn(PREFILL_LEN, SHAPE.hidden_size, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        forward(prompt, weights, None)
        measured = median_time_s(lambda: forward(prompt, weights, None), iterations=5)
    planned = prefill_point(deployment, datasheet, 1, PREFILL_LEN)
    rows.append(("prefill", 1, PREFILL_LEN, measured, planned.floor_s, planned.bound))

    report = [
        dict(
            phase=phase,
            batch=batch,
            context_len=context_len,
            measured_s=measured,
            floor_s=floor,
            bound=bound,
            fraction_of_roofline=floor / measured,
        )
        for phase, batch, context_len, measured, floor, bound in rows
    ]
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": report}, indent=2))
    if os.environ.get("PLAN_GPU_REPORT"):
        with open(os.environ["PLAN_GPU_REPORT"], "w") as handle:
            json.dump(
                {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": report}, handle
            )
    for row in report:
        assert row["measured_s"] >= row["floor_s"], f"faster than physics allows: {row}"
    assert report[0]["fraction_of_roofline"] > 0.5, "batch-1 decode far below its bandwidth floor"
