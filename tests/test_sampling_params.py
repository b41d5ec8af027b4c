"""SamplingParams as vLLM scripts build it: vLLM's knobs, spellings and helpers, and a clear error for
the knobs this engine cannot honour (knob-by-knob range errors are in tests/entrypoints/test_llm.py)."""

from __future__ import annotations

import msgspec
import pytest

from tokenmill.sampling_params import (
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from tokenmill.serving.core_protocol import AddRequest


def test_a_temperature_below_a_hundredth_is_raised_to_it_as_vllm_does(caplog):
    assert SamplingParams(temperature=0.001).temperature == 0.01
    assert SamplingParams(temperature=1e-7).temperature == 0.01  # vLLM's too: not greedy
    assert "raised to 0.01" in caplog.text
    assert (
        SamplingParams(temperature=0).temperature == 0 and SamplingParams(temperature=0.5).temperature == 0.5
    )


def test_seed_minus_one_means_no_seed():
    assert SamplingParams(seed=-1).seed is None


def test_from_optional_defaults_only_what_vllm_defaults():
    params = SamplingParams.from_optional(temperature=None, top_p=None, n=None, max_tokens=None, seed=None)
    assert (params.temperature, params.top_p, params.n) == (1.0, 1.0, 1)
    assert params.max_tokens is None  # up to the context, not the default 16
    assert SamplingParams.from_optional(temperature=0.0, stop="x").stop == ["x"]
    assert SamplingParams.from_optional(logit_bias={"7": 250, 8: -3.5}).logit_bias == {7: 100.0, 8: -3.5}
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        SamplingParams.from_optional(logit_bias={"the": 1})


def test_clone_is_deep():
    params = SamplingParams(stop=["a"], logit_bias={5: 1.0})
    clone = params.clone()
    clone.stop.append("b")
    clone.logit_bias[6] = 2.0
    assert clone != params and params.stop == ["a"] and params.logit_bias == {5: 1.0}


def test_guided_decoding_is_the_old_name_of_structured_outputs():
    assert GuidedDecodingParams is StructuredOutputsParams
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert params.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
    assert params.guided_decoding is None
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(
            guided_decoding=GuidedDecodingParams(regex="a+"),
            structured_outputs=StructuredOutputsParams(regex="b+"),
        )


def test_vllm_knobs_that_change_nothing_here_are_taken():
    params = SamplingParams(
        output_kind=RequestOutputKind.FINAL_ONLY,
        extra_args={"custom": 1},
        spaces_between_special_tokens=False,
        best_of=2,
        n=2,
    )
    assert params.output_kind is RequestOutputKind.FINAL_ONLY and params.extra_args == {"custom": 1}


@pytest.mark.parametrize(
    "knobs, knob",
    [
        (dict(best_of=3), "best_of"),
        (dict(bad_words=["darn"]), "bad_words"),
        (dict(stop=["x"], detokenize=False), "stop"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    ],
)
def test_knobs_this_engine_cannot_honour_are_named(knobs, knob):
    with pytest.raises(ValueError, match=knob) as caught:
        SamplingParams(**knobs)
    assert caught.value.param == knob


@pytest.mark.parametrize(
    "knob, value",
    [
        ("temperature", "0.7"),
        ("temperature", float("nan")),
        ("top_p", None),
        ("min_p", float("inf")),
        ("presence_penalty", None),
        ("repetition_penalty", "1"),
        ("n", True),
        ("max_tokens", 5.0),
        ("logprobs", True),
        ("prompt_logprobs", "2"),
        ("best_of", "1"),
        ("stop", 5),
        ("stop_token_ids", 3),
        ("allowed_token_ids", 7),
        ("logit_bias", [1]),
        ("logit_bias", {1: float("nan")}),
        ("logit_bias", {"1": 5.0}),  # SamplingParams.from_optional takes JSON's text keys
    ],
)
def test_a_knob_of_the_wrong_type_is_a_value_error_naming_it(knob, value):
    """Not a TypeError from deep inside a comparison, and no bool taken for 0 or 1, no NaN let through."""
    with pytest.raises(ValueError, match=knob) as caught:
        SamplingParams(**{knob: value})
    assert caught.value.param == knob


def test_numpy_numbers_are_taken_as_pythons():
    np = pytest.importorskip("numpy")
    params = SamplingParams(
        temperature=np.float32(0.5), top_p=np.float16(1), max_tokens=np.int64(7), n=np.int32(2),
        seed=np.uint16(3), logit_bias={np.int64(5): np.float32(-1.5)},
    )  # fmt: skip
    assert (params.temperature, params.top_p, params.max_tokens, params.n, params.seed) == (0.5, 1.0, 7, 2, 3)
    assert type(params.temperature) is float and type(params.max_tokens) is int
    assert params.logit_bias == {5: -1.5} and type(next(iter(params.logit_bias))) is int


def test_unknown_knob_is_a_type_error():
    with pytest.raises(TypeError, match="use_beam_search"):
        SamplingParams(use_beam_search=True)


def test_vllm_knobs_cross_to_the_engine_core():
    params = SamplingParams(
        output_kind=RequestOutputKind.DELTA,
        extra_args={"k": [1]},
        allowed_token_ids=[3, 4],
        truncate_prompt_tokens=5,
        detokenize=False,
    )
    message = AddRequest("r", [1, 2], params, [0], 0.0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=AddRequest).params == params


def test_what_the_prompt_did_with_the_thinking_crosses_to_the_engine_core():
    constraint = StructuredOutputsParams(choice=["yes"], reasoning="qwen3", prompt_thinking="open")
    message = AddRequest("r", [1, 2], SamplingParams(structured_outputs=constraint), [0], 0.0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=AddRequest)
    assert decoded.params.structured_outputs.prompt_thinking == "open"
    with pytest.raises(ValueError, match="prompt_thinking must be one of"):
        StructuredOutputsParams(choice=["yes"], prompt_thinking="opened")


def test_structured_outputs_flags_and_json_options_cross_to_the_engine_core():
    """What crosses to the core must decode there: json_object null (vLLM's default) is false, a flag
    that is no bool is refused here (it had failed the core's decoding, and with it the server)."""
    constraint = StructuredOutputsParams(choice=["yes"], json_object=None)
    assert constraint.json_object is False
    tagged = StructuredOutputsParams(
        structural_tag={"triggers": ["<f="], "structures": []}, whitespace_pattern=" ?",
        disable_additional_properties=True,
    )  # fmt: skip
    for sent in (constraint, tagged):
        message = AddRequest("r", [1, 2], SamplingParams(structured_outputs=sent), [0], 0.0)
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=AddRequest)
        assert decoded.params.structured_outputs == sent
    for flag in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
        with pytest.raises(ValueError, match=f"{flag} must be true or false"):
            StructuredOutputsParams(choice=["yes"], **{flag: "yes"})
