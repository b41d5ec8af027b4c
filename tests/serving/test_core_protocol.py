"""The ZMQ messages survive msgpack both ways with their types, and SamplingParams validate on arrival."""

from __future__ import annotations

import msgspec
import pytest

from tokenmill.core.outputs import EngineCoreOutput, TokenLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.serving.core_protocol import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineReady,
    SchedulerStats,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    message_decoder,
    request_decoder,
)

encode = msgspec.msgpack.Encoder().encode


def test_requests_round_trip():
    params = SamplingParams(n=2, temperature=0.5, seed=3, stop=["\n"], logit_bias={7: -2.5}, logprobs=2)
    messages = [
        AddRequest("r1", [1, 2, 3], params, [2], 12.5),
        AbortRequests(["r1", "r2#0"]),
        UtilityCall(4, "reset_prefix_cache"),
        Shutdown(),
    ]
    decoder = request_decoder()
    decoded = [decoder.decode(encode(m)) for m in messages]
    assert decoded == messages
    assert decoded[0].params.logit_bias == {7: -2.5} and isinstance(decoded[0].params, SamplingParams)


def test_outputs_round_trip():
    logprobs = TokenLogprobs(-0.25, 1, [5, 9], [-0.25, -1.5])
    stats = SchedulerStats(3, 1, 0.5, 8, 100, 48, 2, [0.01])
    messages = [
        EngineReady(1024, 512, 16, 49152),
        StepOutputs([EngineCoreOutput("r1", [5], [logprobs], "stop", "\n", 32)], stats),
        UtilityResult(4, True),
        EngineDead("boom", "RuntimeError"),
    ]
    decoder = message_decoder()
    decoded = [decoder.decode(encode(m)) for m in messages]
    assert decoded == messages
    assert isinstance(decoded[1].outputs[0].new_logprobs[0], TokenLogprobs)


def test_invalid_params_are_rejected_on_decode():
    bad = encode(AddRequest("r", [1], SamplingParams(), [], 0.0)).replace(b"\xa1n\x01", b"\xa1n\x00")
    with pytest.raises(msgspec.ValidationError, match="n must be"):
        request_decoder().decode(bad)
