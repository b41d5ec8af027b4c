"""The API process's output processor: what it hands out belongs to the caller."""

from __future__ import annotations

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.serving.output_processor import OutputProcessor


def test_an_output_held_by_the_caller_does_not_change_with_later_tokens():
    processor = OutputProcessor(tokenizer=None)
    processor.add_request("r", None, [1, 2, 3], SamplingParams(max_tokens=3))
    held = []
    for token in (7, 8, 9):
        finish = "length" if token == 9 else None
        outputs, _ = processor.process([EngineCoreOutput("r", [token], finish_reason=finish)])
        held.append(outputs[0])
    assert [o.outputs[0].token_ids for o in held] == [[7], [7, 8], [7, 8, 9]]
    assert [o.outputs[0].delta_token_ids for o in held] == [[7], [8], [9]]
    assert held[-1].finished and not held[0].finished
