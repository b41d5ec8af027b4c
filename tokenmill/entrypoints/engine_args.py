"""Command-line options for every EngineConfig knob (--max-model-len for max_model_len, ...), generated
from the dataclass so the CLI never drifts from the config; shared by serve, generate, chat and bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from collections.abc import Callable, Collection

from tokenmill.config import EngineConfig

_HELP = {
    "reasoning_parser": "deepseek_r1 | qwen3: output constraints apply to the answer after the model's "
    "<think>...</think>",
    "model": "'default' (the embedded SmolLM2-135M-Instruct), a Hugging Face model directory or a .gguf file",
    "tokenizer": "tokenizer directory or .gguf file, if not the model's own",
    "load_format": "auto | safetensors | gguf | dummy (random weights of the model's shape, for benchmarks)",
    "dtype": "auto | float32 (float) | float16 (half) | bfloat16 (auto: the model's dtype on GPU; on a "
    "CPU bf16 where it multiplies bf16 natively (AMX, AVX512-BF16), else float32)",
    "device": "auto | cpu | cuda | cuda:N",
    "max_model_len": "context length in tokens, e.g. 4096, 32k (32,000) or 32K (32,768) (default: the "
    "model's own)",
    "max_num_seqs": "most requests in one running batch",
    "max_num_batched_tokens": "token budget of one engine step (default: 8192 on a GPU, 512 on a CPU)",
    "max_prefill_tokens_with_decodes": "prompt tokens a step may carry while requests are decoding, which "
    "bounds the pause a wave of new prompts puts in running streams (default: the whole step budget)",
    "block_size": "tokens per KV-cache block",
    "enable_prefix_caching": "share the KV blocks of identical prompt prefixes between requests",
    "kv_cache_memory": "bytes of KV cache, e.g. 4GiB or 512MiB (overrides --gpu-memory-utilization)",
    "num_kv_blocks": "exact number of KV-cache blocks (overrides both memory options)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use, KV cache included",
    "seed": "seed of the engine's random state (per-request seeds are separate)",
    "tensor_parallel_size": "ranks the model is split over, one process (and GPU) each",
    "distributed_executor_backend": "mp (tensor-parallel ranks as processes on this machine) | ray (as "
    "Ray actors across the machines of a Ray cluster)",
    "enable_expert_parallel": "MoE models: each rank holds a share of the experts whole instead of a "
    "slice of every expert",
    "expert_dispatch": "with --enable-expert-parallel: allreduce (each rank runs its experts' share of "
    "every token's picks, partial outputs summed) | all_to_all (each rank routes a share of the tokens, "
    "sends each pick to its expert's rank and back with all-to-all, then all-gathers)",
    "skip_tokenizer_init": "do not load a tokenizer; prompts must then be token ids",
    "enforce_eager": "run the model eagerly on GPU (no CUDA graphs)",
    "async_scheduling": "schedule the next step while the current one runs (default: on for CUDA only)",
    "max_waiting_requests": "cap on requests waiting for their first token; the server answers 429 past it",
    "scheduling_policy": "fcfs (requests run in arrival order; a request's priority other than 0 is refused) "
    "| priority (a request's priority orders the waiting queue, lower first, and picks preemption victims)",
    "runner": "auto | generate | pooling (embeddings at /v1/embeddings; auto: pooling for bare-model "
    "checkpoints such as Qwen3Model)",
    "warmup": "on a GPU, meet every kernel variant and cuDNN plan at start-up, before any request",
    "quantization": "fp8: quantize the checkpoint's linear weights to FP8 at load (per-channel scales, "
    "activations per token; FP8 tensor cores on Ada/Hopper, an exact emulation on a CPU); int4: 4-bit "
    "groups of 128, activations in the model dtype (W4A16, round-to-nearest). A quantized "
    "checkpoint (compressed-tensors, GPTQ, AWQ, fine-grained FP8, Model Optimizer FP8) is detected from its "
    "config.json and needs no flag (its name, or vLLM's gptq_marlin / awq_marlin, is taken too)",
    "kv_cache_dtype": "auto | fp8: the KV cache in FP8 (e4m3) holds twice the tokens and halves attention's "
    "reads; scales 1.0 unless the checkpoint has them",
    "pooling_type": "last | mean, for the pooling runner (default: the model's sentence-transformers "
    "config, else last)",
    "kv_offload_gib": "GiB of host memory for a CPU tier of the prefix cache: blocks evicted from the device "
    "are copied there and back on a later prefix hit instead of being recomputed (default: 0, off)",
    "kv_offload_disk": "a directory for the CPU tier's second tier on local disk: blocks the CPU tier "
    "evicts are written there and read back on a later prefix hit (needs --kv-offload-gib and "
    "--kv-offload-disk-gib)",
    "kv_offload_disk_gib": "GiB of --kv-offload-disk to use, per tensor-parallel rank",
    "kv_role": "prefill/decode disaggregation: prefill (compute prompts for decode peers and serve their KV "
    "on --kv-port) or decode (take over requests a prefill peer computed; see --kv-peer)",
    "kv_port": "with --kv-role prefill: the TCP port decode peers fetch KV from",
    "kv_transfer_timeout": "with --kv-role decode: seconds to wait for a request's KV before failing it",
    "generation_config": "auto | vllm | DIR: default sampling parameters of requests that leave them unset "
    "(temperature, top_p, top_k, min_p, repetition_penalty, max_tokens): auto, the model's "
    "generation_config.json; vllm, none of it; DIR, that directory's generation_config.json",
    "override_generation_config": "a JSON object of generation-config values put over those, e.g. "
    '\'{"temperature": 0.5, "max_new_tokens": 512}\'',
    "trust_remote_code": "accepted as vLLM takes it; no code from a checkpoint runs here either way (an "
    "architecture tokenmill does not implement is refused)",
    "enable_chunked_prefill": "accepted as vLLM takes it: prompts over the step budget are always chunked "
    "(--no-enable-chunked-prefill is refused)",
    "speculative_config": "speculative decoding as a JSON object, e.g. "
    '\'{"method": "ngram", "num_speculative_tokens": 4}\' (ngram: drafts from the request\'s own text, '
    "prompt_lookup_min/max tokens matched; greedy output is unchanged, sampled output keeps its "
    "distribution)",
}

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '4G', '1e9' or a plain integer of bytes (binary units either way)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (try 4GiB or 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_token_count(text: str) -> int:
    """A count of tokens as vLLM reads one: 32768, 32k (32,000) or 32K (32,768); decimals with the
    decimal suffixes only (25.6k)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kmgtKMGT])\s*", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a count of tokens: {text!r} (try 4096, 32k or 32K)"
            ) from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: no decimals with a binary suffix ({suffix}); did you mean {number}{suffix.lower()}?"
        )
    return int(number) * _BINARY[suffix]


def parse_json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({error})") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


_PARSERS: dict[str, Callable[[str], object]] = {
    "kv_cache_memory": parse_bytes,
    "max_model_len": parse_token_count,
    "max_num_batched_tokens": parse_token_count,
    "speculative_config": parse_json_object,
    "override_generation_config": parse_json_object,
}


def _value_type(annotation: object) -> type:
    """The one concrete type of a field, `int | None` giving int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (concrete,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return concrete
    return annotation  # type: ignore[return-value]


_ALIASES = {"tensor_parallel_size": ("-tp",)}  # vLLM's short forms


def add_engine_args(parser: argparse.ArgumentParser, exclude: Collection[str] = ()) -> None:
    """Add one option per EngineConfig field (minus `exclude`), defaulting to the dataclass defaults."""
    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name in exclude:
            continue
        flag = "--" + field.name.replace("_", "-")
        flags = [flag, *_ALIASES.get(field.name, ())]
        kind = _value_type(hints[field.name])
        help_text = _HELP.get(field.name, field.name)
        if kind is bool:
            group.add_argument(
                *flags,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=help_text,
            )
        else:
            group.add_argument(
                *flags,
                dest=field.name,
                type=_PARSERS.get(field.name, kind),
                default=field.default,
                metavar=field.name.upper(),
                help=help_text if field.default is None else f"{help_text} (default: {field.default})",
            )


def engine_config_from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    """Build the EngineConfig back from parsed options; fields without an option keep their defaults."""
    values = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)
    }
    values.update(overrides)
    return EngineConfig(**values)
