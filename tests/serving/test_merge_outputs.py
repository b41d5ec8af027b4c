"""Merging a request's consecutive outputs (what a stream sends when its consumer fell behind): the later
state, with every delta joined in order, logprobs included, for each of n samples."""

from __future__ import annotations

from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.serving.output_processor import merge_outputs


def output(samples: list[CompletionOutput], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", "p", [1, 2], samples, finished=finished)


def test_deltas_join_and_the_later_state_wins():
    lp = [{5: Logprob(-0.1, 1, "a")}, {6: Logprob(-0.2, 1, "b")}, {7: Logprob(-0.3, 1, "c")}]
    first = output(
        [
            CompletionOutput(
                0, "a", [5], -0.1, lp[:1], delta_text="a", delta_token_ids=[5], delta_logprobs=lp[:1]
            ),
            CompletionOutput(1, "x", [9], delta_text="x", delta_token_ids=[9]),
        ]
    )
    second = output(
        [
            CompletionOutput(
                0, "ab", [5, 6], -0.3, lp[:2], delta_text="b", delta_token_ids=[6], delta_logprobs=lp[1:2]
            ),
            CompletionOutput(1, "x", [9]),  # this sample did not move in the second step
        ]
    )
    third = output(
        [
            CompletionOutput(
                0,
                "abc",
                [5, 6, 7],
                -0.6,
                lp,
                "length",
                delta_text="c",
                delta_token_ids=[7],
                delta_logprobs=lp[2:],
            ),
            CompletionOutput(
                1, "xy", [9, 4], finish_reason="stop", stop_reason=4, delta_text="y", delta_token_ids=[4]
            ),
        ],
        finished=True,
    )
    merged = merge_outputs(merge_outputs(first, second), third)
    assert merged.finished and merged.request_id == "r" and merged.prompt_token_ids == [1, 2]
    a, b = merged.outputs
    assert (a.text, a.token_ids, a.cumulative_logprob, a.finish_reason) == ("abc", [5, 6, 7], -0.6, "length")
    assert (a.delta_text, a.delta_token_ids, a.delta_logprobs) == ("abc", [5, 6, 7], lp)
    assert (b.delta_text, b.delta_token_ids, b.delta_logprobs) == ("xy", [9, 4], None)
    assert (b.finish_reason, b.stop_reason) == ("stop", 4)
    # The inputs are left as they were: a caller may still hold them.
    assert first.outputs[0].delta_token_ids == [5] and second.outputs[0].delta_text == "b"
