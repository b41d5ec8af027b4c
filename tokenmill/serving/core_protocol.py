"""The messages between the API processes and the engine-core process: msgspec Structs sent as msgpack,
one ZMQ frame each. Requests flow in on one socket per API process, step outputs and replies flow back on
another; with several API processes (`--api-server-count`) each message in names its sender's index, and
the core answers each on that sender's own output socket."""

from __future__ import annotations

from typing import Any

import msgspec

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.sampling_params import SamplingParams

# ---- API process -> engine core ---------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float  # time.monotonic() in the API process (the clock is shared across processes)
    client_index: int = 0  # which API process sent it and gets its outputs
    # Disaggregation: hold the blocks for a decode peer when finished (prefill instance), or take over
    # from a prefill peer: [its first token id, its KV address, its request id] (decode instance).
    remote_decode: bool = False
    remote_prefill: list | None = None
    cache_salt: str | None = None  # mixed into its first block's hash: no prefix sharing across salts
    priority: int = 0  # lower runs earlier (the priority scheduling policy; else always 0)


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str  # one of core_process.UTILITY_METHODS
    client_index: int = 0


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreRequest = AddRequest | AbortRequests | UtilityCall | Shutdown

# ---- engine core -> API process ---------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    pooling_type: str | None = None  # set when the core runs the pooling runner (embeddings)


class SchedulerStats(msgspec.Struct, array_like=True):
    """The core's state after a step. Every API process gets its own requests' outputs; only API process 0
    gets every step's stats (the others get them with their outputs), and only it records them."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by live requests
    num_used_blocks: int  # blocks held by live requests; cached-but-free prefix blocks are not counted
    prefix_cache_queries: int  # cumulative tokens looked up
    prefix_cache_hits: int  # cumulative tokens found
    num_preemptions: int  # cumulative
    queue_times: list[float]  # seconds waited by each request first scheduled in this step
    # Speculative decoding, cumulative: steps that verified drafts, drafts, accepted drafts, and
    # accepted drafts by position in their step.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)
    # The prefix cache's CPU tier, cumulative: tokens served from it, blocks and bytes each way, and
    # the host time spent issuing the copies.
    offload_hits: int = 0
    offload_saved_blocks: int = 0
    offload_loaded_blocks: int = 0
    offload_bytes_saved: int = 0
    offload_bytes_loaded: int = 0
    offload_seconds: float = 0.0
    # Its disk tier, cumulative: tokens read back from it (counted in offload_hits too), blocks and bytes
    # written to it (spilled) and read from it.
    offload_disk_hits: int = 0
    offload_spilled_blocks: int = 0
    offload_disk_read_blocks: int = 0
    offload_bytes_spilled: int = 0
    offload_bytes_disk_read: int = 0
    # Prefill/decode disaggregation, cumulative: requests whose KV was sent (prefill) or received
    # (decode), its bytes, and the time spent on them.
    kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


class UtilityResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    result: Any


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    error: str
    error_type: str  # "ValueError" for a bad configuration, else the exception's class name


CoreMessage = EngineReady | StepOutputs | UtilityResult | EngineDead


def request_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreRequest)


def message_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreMessage)
