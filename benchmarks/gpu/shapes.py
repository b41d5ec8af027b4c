"""Public model shapes (from their Hugging Face config.json files) for dummy-weight benchmarks, and the
bytes and FLOPs their rooflines need, taken from the planner so both count the same way."""

from __future__ import annotations

import json
import os
import tempfile

from tokenmill.plan.gpus import ceilings_for, resolve_gpu
from tokenmill.plan.memory import Deployment, weight_bytes
from tokenmill.plan.memory import kv_bytes_per_token as plan_kv_bytes_per_token
from tokenmill.plan.model_shape import ModelShape, from_hf_config
from tokenmill.plan.roofline import attention_flops_per_context_token, decode_point, matmul_flops_per_token

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

SHAPES = {
    "llama-3.1-8b": LLAMA_31_8B,
    "llama-3.1-70b": {
        **LLAMA_31_8B,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    # Mixture of experts: 128 experts, 8 per token, ~3.3B parameters active of 30.5B.
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
}


def shape_dir(name: str, **overrides) -> str:
    """A directory holding only config.json: enough for load_format='dummy'."""
    path = tempfile.mkdtemp(prefix=f"tokenmill-{name}-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**SHAPES[name], **overrides}, f)
    return path


def _plan_shape(name: str) -> ModelShape:
    return from_hf_config(SHAPES[name], name)


def decode_weight_bytes(name: str, weight_dtype: str = "bf16") -> int:
    """Bytes one decode step must read with weights in weight_dtype (bf16, fp8 or int4, the LM head
    kept in bf16 as the engine keeps it): the planner's figure (an untied input table is gathered row by
    row, so it is not counted)."""
    return weight_bytes(_plan_shape(name), weight_dtype).read_every_step


def decode_expert_bytes(name: str, batch: int, weight_dtype: str = "bf16") -> int:
    """Routed-expert bytes a decode step of `batch` tokens reads, on average: per MoE layer the expected
    number of distinct experts among the batch's picks (uniform routing, as random weights route),
    E * (1 - (1 - k/E)^batch). 0 for a dense model."""
    shape = _plan_shape(name)
    if not shape.is_moe:
        return 0
    experts, k = shape.num_experts, shape.num_experts_per_tok
    distinct = experts * (1 - (1 - k / experts) ** batch)
    return int(distinct * weight_bytes(shape, weight_dtype).per_expert_layer * shape.num_moe_layers)


def workload_floor(name: str, prompt_lens: list[int], output_lens: list[int]) -> tuple[int, int]:
    """(bytes, FLOPs) the whole batch's work needs at least, if every prompt is prefilled first and
    every request then decodes together: prefill FLOPs, and per decode step the weights, the experts the
    live requests' picks reach (decode_expert_bytes) and the live requests' KV. A floor: no schedule
    reads less (chunked prefill overlapped with decode hides some of the FLOPs in the bytes' time)."""
    per_token_kv = kv_bytes_per_token(name)
    dense = decode_weight_bytes(name)
    flops = sum(prefill_flops(name, n) for n in prompt_lens)
    total, live = 0, sorted(zip(output_lens, prompt_lens))
    for step in range(max(output_lens)):
        live = [(out, n) for out, n in live if out > step]
        context = sum(n + step for _, n in live)
        total += dense + decode_expert_bytes(name, len(live)) + per_token_kv * context
    return total, flops


def planned_decode_step(
    name: str, batch: int, context_len: int, tp: int = 1, weight_dtype: str = "bf16", kv_dtype: str = "bf16"
) -> dict:
    """What `tokenmill plan` predicts for a decode step (its roofline floor on an H200 at the ceilings
    measured on our cards, per GPU of the TP group), to print beside a measured step."""
    gpu = resolve_gpu("H200")
    deployment = Deployment(_plan_shape(name), gpu, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    point = decode_point(deployment, ceilings_for(gpu, weight_dtype, measured=True), tp, batch, context_len)
    return {"plan_step_ms": point.floor_s * 1e3, "plan_bound": point.bound, "plan_bytes": point.bytes_moved}


def kv_bytes_per_token(name: str) -> int:
    return plan_kv_bytes_per_token(_plan_shape(name), "bf16")


def prefill_flops(name: str, num_tokens: int) -> int:
    """Matmul FLOPs of a prefill with logits for the last token only, plus causal attention."""
    shape = _plan_shape(name)
    body = matmul_flops_per_token(shape, with_lm_head=False)
    lm_head = matmul_flops_per_token(shape) - body
    attention = attention_flops_per_context_token(shape, "prefill") * num_tokens * num_tokens // 2
    return body * num_tokens + attention + lm_head


if __name__ == "__main__":
    # For the serving scripts: `python benchmarks/gpu/shapes.py SHAPE [TOKENIZER_DIR]` prints a dummy-weight
    # model directory of the shape with SmolLM2's vocabulary, and the tokenizer's files copied beside it.
    import shutil
    import sys

    directory = shape_dir(sys.argv[1], vocab_size=49152, bos_token_id=1, eos_token_id=2)
    if len(sys.argv) > 2:
        for name in os.listdir(sys.argv[2]):
            shutil.copy(os.path.join(sys.argv[2], name), directory)
    print(directory)
