"""EngineConfig: every engine knob in one place, validated once at the edge with errors that name the knob."""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

from tokenmill.sampling_params import REASONING_PARSERS

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_RUNNERS = ("auto", "generate", "pooling")
_POOLING_TYPES = ("last", "mean")
_SCHEDULING_POLICIES = ("fcfs", "priority")
QUANTIZATION_METHODS = ("fp8", "int4", "compressed-tensors", "gptq", "awq", "modelopt")
# vLLM's names of its Marlin kernels for the same checkpoints, taken as the formats they read.
QUANTIZATION_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass
class EngineConfig:
    model: str = "default"
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 tokens per step on a GPU, 512 on a CPU
    # Prompt tokens a step may carry while requests are decoding: a wave of new prompts then stretches
    # the running streams' inter-token gaps less. None: up to max_num_batched_tokens.
    max_prefill_tokens_with_decodes: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes of KV cache; overrides gpu_memory_utilization
    num_kv_blocks: int | None = None  # exact block count; overrides both
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False
    # Schedule step N+1 while step N runs on the device. None: on for CUDA, off elsewhere (a CPU step
    # leaves no idle device to hide host work behind), where it still works and is tested.
    async_scheduling: bool | None = None
    max_waiting_requests: int | None = None  # cap on the waiting queue (the server answers 429 past it)
    # vLLM's: "priority" lets a request set its priority (lower runs earlier; the scheduler orders its
    # waiting queue and picks preemption victims by it); "fcfs" refuses any but 0, so arrival order rules.
    scheduling_policy: str = "fcfs"
    # "pooling" serves embeddings (/v1/embeddings) instead of text; "auto" picks it for checkpoints of
    # a bare model (architectures such as Qwen3Model or LlamaModel), else "generate".
    runner: str = "auto"
    # How a pooling runner makes one vector of a prompt's hidden states. None: the model's own
    # sentence-transformers pooling config when it has one, else the last token.
    pooling_type: str | None = None
    # On a GPU, run a few requests of varied lengths and build every dense-prefill plan at start-up, so
    # no request pays for a kernel compile or a cuDNN plan.
    warmup: bool = True
    # Weight quantization of every linear layer: "fp8" quantizes a bf16/fp32 checkpoint at load
    # (e4m3 weights, per-channel scales; activations per token at run time), "int4" to 4-bit groups of
    # 128 (W4A16, round-to-nearest). None: as the checkpoint is (a quantized one is detected).
    quantization: str | None = None
    # "fp8": the KV cache in e4m3 with per-tensor K and V scales (half the bytes of bf16: twice the
    # tokens, half of attention's reads). "auto": the model's dtype.
    kv_cache_dtype: str = "auto"
    # Speculative decoding, as a dict in vLLM's shape ({"method": "ngram", "num_speculative_tokens": 4,
    # ...}; tokenmill.spec_decode.SpeculativeConfig); parsed and checked here. None: off.
    speculative_config: dict | None = None
    # The CPU tier of the prefix cache, in GiB of (pinned) host memory (per tensor-parallel rank, each
    # holding its KV heads' share): full blocks evicted from the device are kept there and copied back
    # on a later prefix hit instead of being recomputed. 0: off.
    kv_offload_gib: float = 0.0
    # Its second tier on local disk: a directory, and the GiB of it to use (per rank). Blocks the CPU tier
    # evicts are written there (one file per rank, removed at exit) and read back into the CPU tier on a
    # later prefix hit. None: off.
    kv_offload_disk: str | None = None
    kv_offload_disk_gib: float = 0.0
    # Prefill/decode disaggregation: "prefill" keeps a finished remote-decode request's blocks and serves
    # them on kv_port; "decode" fetches the KV of requests a prefill peer computed. None: neither.
    kv_role: str | None = None
    kv_port: int = 14579
    kv_transfer_timeout: float = 30.0  # seconds a decode instance waits for a request's KV
    # Ranks the model is split over (heads, MLP widths, vocab): one process per GPU (on a CPU, per rank),
    # rank 0 in the engine core's process (worker/tp_executor.py).
    tensor_parallel_size: int = 1
    # MoE layers under tensor parallelism: each rank holds a share of the experts whole (expert
    # parallelism) instead of a slice of every expert. Attention stays tensor-parallel.
    enable_expert_parallel: bool = False
    # With expert parallelism, how tokens reach the experts. "allreduce": every rank (whose tokens are
    # all the batch's, attention being tensor-parallel) runs its experts' share of every token's picks
    # and the partial outputs are summed; "all_to_all": each rank routes a 1/N share of the tokens,
    # sends each (token, expert) pair to the expert's rank and gets its output back (all_to_all_single
    # both ways), then the shares are all-gathered.
    expert_dispatch: str = "allreduce"
    # How the other tensor-parallel ranks are run: "mp", processes on this machine; "ray", actors on the
    # Ray cluster this process joins (RAY_ADDRESS, or a local one): several machines.
    distributed_executor_backend: str = "mp"
    # Default sampling parameters of requests that leave them unset, as vLLM takes them: "auto", the
    # model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
    # max_new_tokens); "vllm", none of it (neutral defaults); or a directory whose generation_config.json
    # to read instead. override_generation_config's values go on top, whichever it is.
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # A reasoning model's <think>...</think> parser (deepseek_r1, qwen3), as vLLM's LLM takes it: offline,
    # each request's output constraint applies to the answer after the thinking (the server's
    # --reasoning-parser also splits the thinking out of its messages).
    reasoning_parser: str | None = None
    # vLLM's knobs that hold here whatever their value says, taken so that vLLM's command lines run:
    # no code from a checkpoint ever runs (an architecture tokenmill lacks is refused either way), and
    # prompts longer than a step's token budget are always chunked (False, which vLLM can do, is refused).
    trust_remote_code: bool = False
    enable_chunked_prefill: bool | None = None

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = "default"
        self.dtype = {
            "fp32": "float32",
            "float": "float32",
            "fp16": "float16",
            "half": "float16",
            "bf16": "bfloat16",
        }.get(self.dtype, self.dtype)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}.")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}.")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}."
            )
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("block_size", self.block_size)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.max_num_batched_tokens is not None:
            _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_prefill_tokens_with_decodes is not None:
            _positive("max_prefill_tokens_with_decodes", self.max_prefill_tokens_with_decodes)
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if not isinstance(self.kv_offload_gib, (int, float)) or self.kv_offload_gib < 0:
            raise ValueError(f"kv_offload_gib must be a number of GiB >= 0, got {self.kv_offload_gib!r}.")
        if self.kv_role not in (None, "prefill", "decode"):
            raise ValueError(f"kv_role must be prefill or decode, got {self.kv_role!r}.")
        if not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_port must be a TCP port, got {self.kv_port!r}.")
        if not self.kv_transfer_timeout > 0:
            raise ValueError(f"kv_transfer_timeout must be > 0 seconds, got {self.kv_transfer_timeout!r}.")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        self.seed = int(self.seed)
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be mp or ray, got {self.distributed_executor_backend!r}."
            )
        if self.expert_dispatch not in ("allreduce", "all_to_all"):
            raise ValueError(
                f"expert_dispatch must be allreduce or all_to_all, got {self.expert_dispatch!r}."
            )
        if self.expert_dispatch != "allreduce" and not self.enable_expert_parallel:
            raise ValueError(
                "expert_dispatch all_to_all is how expert parallelism dispatches: it needs "
                "enable_expert_parallel."
            )
        if self.tensor_parallel_size > 1 and self.kv_role:
            raise ValueError("kv_role does not work with tensor_parallel_size > 1 yet; leave one out.")
        if not isinstance(self.kv_offload_disk_gib, (int, float)) or self.kv_offload_disk_gib < 0:
            raise ValueError(
                f"kv_offload_disk_gib must be a number of GiB >= 0, got {self.kv_offload_disk_gib!r}."
            )
        if self.kv_offload_disk is not None:
            if not self.kv_offload_gib:
                raise ValueError(
                    "kv_offload_disk is the CPU tier's second tier: it needs kv_offload_gib > 0."
                )
            if not self.kv_offload_disk_gib:
                raise ValueError("kv_offload_disk needs kv_offload_disk_gib > 0 (the GiB of it to use).")
            if not os.path.isdir(self.kv_offload_disk) or not os.access(self.kv_offload_disk, os.W_OK):
                raise ValueError(
                    f"kv_offload_disk must be a writable directory, got {self.kv_offload_disk!r}."
                )
        elif self.kv_offload_disk_gib:
            raise ValueError("kv_offload_disk_gib sizes the disk tier: give kv_offload_disk a directory.")
        if self.kv_offload_gib and not self.enable_prefix_caching:
            raise ValueError("kv_offload_gib is a tier of the prefix cache: it needs enable_prefix_caching.")
        utilization = self.gpu_memory_utilization
        if (
            not isinstance(utilization, numbers.Real)
            or isinstance(utilization, bool)
            or not 0 < utilization <= 1
        ):
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}."
            )
        if self.max_waiting_requests is not None:
            _positive("max_waiting_requests", self.max_waiting_requests)
        if self.scheduling_policy not in _SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {_SCHEDULING_POLICIES}, got {self.scheduling_policy!r}."
            )
        if self.quantization is not None:
            self.quantization = self.quantization.lower()
            self.quantization = QUANTIZATION_ALIASES.get(self.quantization, self.quantization)
            if self.quantization not in QUANTIZATION_METHODS:
                raise ValueError(
                    f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}."
                )
        self.kv_cache_dtype = {"fp8_e4m3": "fp8"}.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}.")
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(self.generation_config, "generation_config.json")
        ):
            raise ValueError(
                "generation_config must be auto (the model's generation_config.json), vllm (no model "
                f"defaults) or a directory holding a generation_config.json, got {self.generation_config!r}."
            )
        if self.override_generation_config is not None and not isinstance(
            self.override_generation_config, dict
        ):
            raise ValueError(
                'override_generation_config must be a dict such as {"temperature": 0.5}, got '
                f"{self.override_generation_config!r}."
            )
        if self.enable_chunked_prefill is False:
            raise ValueError(
                "enable_chunked_prefill=False is not supported: prompts longer than max_num_batched_tokens "
                "are always chunked; drop the option (or --no-enable-chunked-prefill)."
            )
        if self.runner not in _RUNNERS:
            raise ValueError(f"runner must be one of {_RUNNERS}, got {self.runner!r}.")
        if self.speculative_config is not None:
            from tokenmill.spec_decode import SpeculativeConfig

            spec = SpeculativeConfig.parse(self.speculative_config)
            self.speculative_config = spec  # type: ignore[assignment]
            if self.runner == "pooling":
                raise ValueError("speculative_config applies to generation, not to runner='pooling'.")
            draft_tp = spec.draft_tensor_parallel_size if spec is not None else None
            if draft_tp not in (None, self.tensor_parallel_size):
                raise ValueError(
                    f"speculative_config draft_tensor_parallel_size {draft_tp} is not supported: the "
                    f"drafter runs on the target's ranks (tensor_parallel_size {self.tensor_parallel_size}); "
                    "leave it out or set it to that."
                )
        if self.pooling_type is not None:
            self.pooling_type = self.pooling_type.lower()
            if self.pooling_type not in _POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {_POOLING_TYPES}, got {self.pooling_type!r}.")


def _positive(knob: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{knob} must be a positive integer, got {value!r}.")
