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


def test_logprobs_of_a_cut_stop_string_are_not_reported():
    from tokenmill.core.outputs import TokenLogprobs
    from tokenmill.loader.default_model import default_model_path
    from tokenmill.loader.gguf import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    tokens = tokenizer.encode(" The answer is four. STOP and more text", add_special_tokens=False)
    for streamed in (True, False):
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(max_tokens=len(tokens), logprobs=0, stop=[". STOP"])
        processor.add_request("r", None, [1], params)
        deltas, final = [], None
        for token in tokens if streamed else [tokens]:
            batch = [token] if streamed else token
            lps = [TokenLogprobs(-0.5, 1, [t], [-0.5]) for t in batch]
            outputs, _ = processor.process([EngineCoreOutput("r", batch, lps)])
            if outputs:
                final = outputs[0].outputs[0]
                deltas.extend(final.delta_logprobs or [])
            if final is not None and final.finished():
                break
        assert final.text == " The answer is four" and final.finish_reason == "stop"
        reported = [next(iter(entry)) for entry in final.logprobs]
        assert tokenizer.decode(reported) == " The answer is four"  # nothing of ". STOP" or after it
        assert [next(iter(entry)) for entry in deltas] == reported  # streamed deltas agree


def test_a_final_only_request_gives_one_output_the_same_as_its_last_one_without():
    """LLM.generate's requests (final_only): no output until the request has finished, then the output
    the processor gives without final_only at that step; for n=2 too, whose samples end apart (one
    cut by a stop string, the other at its length)."""
    from tokenmill.loader.default_model import default_model_path
    from tokenmill.loader.gguf import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    stopping = tokenizer.encode(" one two. END three", add_special_tokens=False)
    running = tokenizer.encode(" a b c d e f g h", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(running), n=2, stop=[". END"])
    runs = []
    for final_only in (False, True):
        processor = OutputProcessor(tokenizer)
        children = [c for c, _ in processor.add_request("r", None, [1], params, final_only=final_only)]
        emitted = []
        for step, token in enumerate(running):
            finish = "length" if step == len(running) - 1 else None
            batch = [EngineCoreOutput(children[1], [token], finish_reason=finish)]
            if step < len(stopping):
                batch.insert(0, EngineCoreOutput(children[0], [stopping[step]]))
            outputs, _ = processor.process(batch)
            emitted.extend(outputs)
        runs.append(emitted)
    full, final_only_outputs = runs
    assert len(full) == len(running) and not full[0].finished
    assert final_only_outputs == [full[-1]] and full[-1].finished
    assert [o.text for o in full[-1].outputs] == [" one two", " a b c d e f g h"]
