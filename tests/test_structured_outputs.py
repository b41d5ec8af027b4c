"""Structured outputs on the embedded SmolLM2 (a real model, CPU): what it writes under a JSON schema
validates against the schema, under a regex fullmatches it, under a choice is a member, under a Lark
grammar parses; constrained and unconstrained requests share batches; a grammar that allows everything
changes nothing; bad constraints are ValueErrors naming the field."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import pytest

from tests.schemas import PERSON
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm():
    # fp32: the comparisons with unconstrained runs are exact (bf16 rounds differently across batch
    # shapes and prefix-cache hits).
    return LLM("default", max_model_len=2048, max_num_batched_tokens=256, dtype="float32")


def chat(llm, content: str, params: SamplingParams | list[SamplingParams], n: int = 1) -> list[str]:
    messages = [[{"role": "user", "content": content}]] * n
    return [o.outputs[0].text for o in llm.chat(messages, params, use_tqdm=False)]


def test_json_schema_with_nested_objects_arrays_and_enums(llm) -> None:
    """Greedy and sampled (seeded) requests under the schema, beside unconstrained ones in the same steps:
    every constrained output parses and validates; the unconstrained ones are what they are alone."""
    constrained = SamplingParams(max_tokens=400, temperature=0, structured_outputs={"json": PERSON})
    sampled = [
        SamplingParams(max_tokens=400, temperature=0.9, seed=s, structured_outputs={"json": PERSON})
        for s in range(3)
    ]
    free = SamplingParams(max_tokens=40, temperature=0)
    prompt = "Describe a user of our website as JSON."
    alone = chat(llm, prompt, free)
    texts = chat(llm, prompt, [constrained, *sampled, free], n=5)
    for text in texts[:4]:
        jsonschema.validate(json.loads(text), PERSON)
    assert texts[4] == alone[0]


def test_requests_that_leave_no_token_allowed_end_and_the_engine_serves_on(llm) -> None:
    """allowed_token_ids outside the constraint's tokens after its first, or only EOS while min_tokens bans
    it: every logit of the row is -inf. Such a request ends (token 0 breaks its grammar, or is SmolLM2's
    EOS) and the requests beside it and after it are answered as alone. allowed_token_ids outside the
    constraint's first tokens is refused at once."""
    tokenizer = llm.get_tokenizer()
    maybe = tokenizer.encode("maybe", add_special_tokens=False)
    (yes,) = tokenizer.encode("yes", add_special_tokens=False)  # "yesno": "yes", "no"
    eos = [tokenizer.eos_token_id]
    refused = SamplingParams(allowed_token_ids=maybe, structured_outputs={"choice": ["yes", "no"]})
    with pytest.raises(ValueError, match="allowed_token_ids holds none of the tokens the output constraint"):
        llm.generate(["Is water wet?"], refused, use_tqdm=False)
    stuck = [
        SamplingParams(max_tokens=8, temperature=1.0, allowed_token_ids=[yes],
                       structured_outputs={"choice": ["yesno"]}),
        SamplingParams(max_tokens=8, temperature=1.0, allowed_token_ids=eos, min_tokens=3, logprobs=1),
    ]  # fmt: skip
    free = SamplingParams(max_tokens=12, temperature=0)
    alone = chat(llm, "Is water wet?", free)
    texts = chat(llm, "Is water wet?", [*stuck, free], n=3)
    assert texts[2] == alone[0]
    assert chat(llm, "Is water wet?", free) == alone


def test_special_tokens_texts_in_a_constraint_are_written_as_text(llm) -> None:
    """A constraint's fixed text holding a special token's text: llguidance's tokenizer made it that token,
    which the grammar then refused; the answer ended there, "stop" and broken. Written as text now."""
    tokenizer = llm.get_tokenizer()
    special = set(tokenizer.all_special_ids)
    schema = {"type": "object", "properties": {"tag": {"const": "end<|im_end|>"}}, "required": ["tag"]}
    params = [
        {"choice": ["A<|im_end|>", "B<|im_end|>"]},
        {"json": schema},
        {"regex": r"ok<\|im_start\|>[0-9]"},
        {"choice": ["a<repo_name>b"]},
        {"grammar": 'start: "x" "<|endoftext|>" "y"'},
    ]
    outs = llm.generate(
        ["Answer:"] * len(params),
        [SamplingParams(max_tokens=30, temperature=0, structured_outputs=p) for p in params],
        use_tqdm=False,
    )
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("A<|im_end|>", "B<|im_end|>")
    assert json.loads(texts[1]) == {"tag": "end<|im_end|>"}
    assert re.fullmatch(r"ok<\|im_start\|>[0-9]", texts[2])
    assert texts[3:] == ["a<repo_name>b", "x<|endoftext|>y"]
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and not special & set(out.outputs[0].token_ids), out


def test_a_constraint_no_text_meets_is_refused(llm) -> None:
    for constraint in ({"regex": r"[^\s\S]"}, {"grammar": "start: A\nA: /[a]/ & /[b]/"}):
        with pytest.raises(ValueError, match="no text satisfies the constraint"):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=constraint), use_tqdm=False)


def test_a_grammar_that_fails_midway_fails_its_request(llm, monkeypatch) -> None:
    """llguidance refusing a token its own mask let through (what the special tokens' texts did, made
    to happen again here on the tokenizer without the fix) fails the request, not a "stop" that looks
    complete; the engine serves on."""
    from tokenmill.grammar_tokenizers import GrammarTokenizers

    monkeypatch.setattr(GrammarTokenizers, "for_grammar", lambda self, text: self.fast)
    constraint = {"choice": ["q<file_sep>z"]}  # not compiled before in this module
    params = SamplingParams(max_tokens=10, temperature=0, structured_outputs=constraint)
    (out,) = llm.generate(["Answer:"], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "abort"
    # q, then <file_sep> as one token, which the grammar refused.
    assert out.outputs[0].token_ids[1] == llm.get_tokenizer().convert_tokens_to_ids("<file_sep>")
    assert out.error.startswith("structured_outputs: the grammar failed with the answer's first 2 tokens")
    (after,) = llm.generate(["Answer:"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert after.outputs[0].finish_reason == "length"


def test_regex_choice_grammar_and_json_object(llm) -> None:
    params = [
        SamplingParams(
            max_tokens=30, temperature=0.7, seed=1, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,4}"}
        ),
        SamplingParams(
            max_tokens=10, temperature=0, structured_outputs={"choice": ["Paris", "London", "Rome"]}
        ),
        SamplingParams(
            max_tokens=40,
            temperature=0,
            structured_outputs={
                "grammar": 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no" | /[0-9]+/'
            },
        ),  # fmt: skip
        SamplingParams(
            max_tokens=80, temperature=0, structured_outputs=StructuredOutputsParams(json_object=True)
        ),
    ]
    texts = chat(llm, "What is the capital of France?", params, n=4)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", texts[0])
    assert texts[1] in ("Paris", "London", "Rome")  # greedy by token: "L" outweighs "Paris" here
    assert re.fullmatch(r"The answer is (yes|no|[0-9]+)\.", texts[2])
    assert isinstance(json.loads(texts[3]), dict)


def test_a_completed_grammar_ends_its_request_with_the_token_that_completed_it(llm) -> None:
    """The grammar takes in a step's tokens on the helper that fills the next step's masks, so a grammar
    completed by token N is seen complete when step N+1's tokens come in: the request ends at N all the
    same, N+1's token dropped, whatever EOS would do (ignored here) and however much max_tokens allows."""
    choice, digits = {"choice": ["red", "green"]}, {"regex": "[0-9]{5}"}
    params = [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, structured_outputs=choice),
        SamplingParams(max_tokens=30, temperature=0.9, seed=4, ignore_eos=True, structured_outputs=digits),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
    ]
    messages = [[{"role": "user", "content": "Pick a colour, then a number."}]] * 3
    outputs = [o.outputs[0] for o in llm.chat(messages, params, use_tqdm=False)]
    assert outputs[0].text in ("red", "green") and re.fullmatch("[0-9]{5}", outputs[1].text)
    tokenizer = llm.get_tokenizer()
    for output in outputs[:2]:
        assert output.finish_reason == "stop"
        assert tokenizer.decode(output.token_ids) == output.text  # no token past the grammar's end
    assert len(outputs[2].token_ids) == 30 and outputs[2].finish_reason == "length"


def test_n_sequences_each_follow_the_grammar(llm) -> None:
    params = SamplingParams(
        n=3, max_tokens=12, temperature=1.0, seed=7, structured_outputs={"regex": "(yes|no)!{1,3}"}
    )
    output = llm.chat([{"role": "user", "content": "Say yes or no."}], params, use_tqdm=False)[0]
    assert len(output.outputs) == 3
    assert all(re.fullmatch("(yes|no)!{1,3}", o.text) for o in output.outputs)


def test_a_grammar_that_allows_everything_changes_nothing(llm) -> None:
    prompt = "Write one sentence about the sea."
    llm.engine.scheduler.kv.reset_prefix_cache()
    free = chat(llm, prompt, SamplingParams(max_tokens=30, temperature=0))
    llm.engine.scheduler.kv.reset_prefix_cache()
    anything = chat(
        llm, prompt, SamplingParams(max_tokens=30, temperature=0, structured_outputs={"regex": "(?s:.*)"})
    )
    assert anything == free


def test_bad_constraints_name_the_field(llm) -> None:
    cases = [
        ({"regex": "a("}, "structured_outputs regex"),
        ({"json": {"type": "objectx"}}, "structured_outputs json"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs grammar"),
    ]
    for constraint, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate("x", SamplingParams(structured_outputs=constraint), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        SamplingParams(structured_outputs={"choice": []})
    # The engine keeps serving.
    assert (
        chat(
            llm, "Hi", SamplingParams(max_tokens=5, temperature=0, structured_outputs={"choice": ["a", "b"]})
        )[0]
        in "ab"
    )


def test_without_a_tokenizer_constraints_are_refused() -> None:
    llm = LLM("default", max_model_len=256, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(
            prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(structured_outputs={"regex": "a"})
        )


def test_masks_are_filled_after_the_forward_pass_is_launched(llm) -> None:
    """The core launches a constrained step, then picks its matchers, whose masks a helper thread fills
    (on a GPU the forward pass runs meanwhile, and the loop goes on: the next step is scheduled and its
    inputs prepared); the step's sampling, and so the next launch, wait for the fill, nothing else
    does."""
    core = llm.engine.core
    events = []
    launch, grammar_fill = core.executor.launch, core.scheduler.grammar_fill

    def launched(prepared):
        events.append(("launch", bool(prepared.scheduler_output.grammar_req_ids)))
        return launch(prepared)

    def fill_later(out, into=None, in_flight=None):
        events.append(("masks", len(out.grammar_req_ids)))
        fill = grammar_fill(out, into, in_flight)

        def fill_and_note(*args):
            mask = fill(*args)
            events.append(("filled", threading.current_thread().name.startswith("tokenmill-masks")))
            return mask

        return fill_and_note

    core.executor.launch, core.scheduler.grammar_fill = launched, fill_later
    try:
        params = SamplingParams(max_tokens=6, temperature=0, structured_outputs={"regex": "[a-z]{6}"})
        (text,) = chat(llm, "Name a fruit.", params)
    finally:
        core.executor.launch, core.scheduler.grammar_fill = launch, grammar_fill
    assert re.fullmatch("[a-z]{6}", text)
    steps = len(events) // 3
    assert steps >= 2 and events == [("launch", True), ("masks", 1), ("filled", True)] * steps


def test_async_scheduling_with_grammars_writes_what_the_synchronous_loop_writes(llm) -> None:
    """With async scheduling a constrained step's forward pass is launched before the tokens of the step
    in flight are taken in; its masks are filled after them. Mixed batches (greedy and seeded sampling
    under grammars that end at different steps, unconstrained requests beside them) write exactly what
    the synchronous loop writes, and every constrained step but the first overlaps the one before."""
    overlapped = LLM(
        "default", max_model_len=2048, max_num_batched_tokens=256, dtype="float32", async_scheduling=True
    )
    params = [
        SamplingParams(max_tokens=300, temperature=0, structured_outputs={"json": PERSON}),
        SamplingParams(max_tokens=300, temperature=0.9, seed=3, structured_outputs={"json": PERSON}),
        SamplingParams(max_tokens=20, temperature=0.8, seed=5, structured_outputs={"regex": "[a-z ]{3,12}"}),
        SamplingParams(max_tokens=10, temperature=0, structured_outputs={"choice": ["red", "green"]}),
        SamplingParams(max_tokens=25, temperature=0),
        SamplingParams(max_tokens=8, temperature=1.0, seed=9),
    ]
    prompt = "Describe a user of our website."
    llm.engine.scheduler.kv.reset_prefix_cache()
    expected = chat(llm, prompt, params, n=len(params))
    core = overlapped.engine.core
    events = []
    launch, update, grammar_fill = (
        core.executor.launch,
        core.scheduler.update_from_output,
        core.scheduler.grammar_fill,
    )
    core.executor.launch = lambda prepared: events.append("launch") or launch(prepared)
    core.scheduler.update_from_output = lambda *a: events.append("update") or update(*a)
    straight = []  # whether each fill took the tokens of the step in flight from its output

    def fill(out, into=None, in_flight=None):
        events.append("masks")
        straight.append(in_flight is not None)
        return grammar_fill(out, into, in_flight)

    core.scheduler.grammar_fill = fill
    assert chat(overlapped, prompt, params, n=len(params)) == expected
    jsonschema.validate(json.loads(expected[0]), PERSON)
    # Each constrained step: launched, then its masks begun (the helper takes the tokens of the step
    # before it from that step's output), then that step taken in.
    overlaps = "".join(e[0] for e in events).count("lmu")
    assert overlaps > 20 and overlaps == events.count("masks") - 1
    assert sum(straight) == overlaps


def test_masks_the_device_waits_for_give_the_tokens_of_masks_given_before_sampling(monkeypatch) -> None:
    """On a GPU a grammar step's sampling is queued before its masks are filled, behind a wait on the
    device (AwaitingGrammar.host_masks; kernels/host_wait.py). The same engine path on the CPU (forced
    here; the sampling waits on the host instead) writes what the masks given before sampling write."""
    from tokenmill.worker.grammar_masks import HostMasks
    from tokenmill.worker.step_output import AwaitingGrammar

    params = [
        SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": PERSON}),
        SamplingParams(max_tokens=20, temperature=0.8, seed=5, structured_outputs={"regex": "[a-z ]{3,12}"}),
        SamplingParams(max_tokens=10, temperature=0, structured_outputs={"choice": ["red", "green"]}),
        SamplingParams(max_tokens=12, temperature=0),
    ]
    prompt = "Describe a user of our website."
    overlapped = LLM(
        "default", max_model_len=2048, max_num_batched_tokens=256, dtype="float32", async_scheduling=True
    )
    expected = chat(overlapped, prompt, params, n=len(params))
    published = []
    publish = HostMasks.publish
    monkeypatch.setattr(HostMasks, "publish", lambda self: published.append(self.target) or publish(self))
    monkeypatch.setattr(
        AwaitingGrammar,
        "host_masks",
        lambda self, words: self.runner.grammar_masks.host_masks(
            len(self.step.scheduler_output.grammar_req_ids), words
        ),
    )
    overlapped.engine.scheduler.kv.reset_prefix_cache()
    assert chat(overlapped, prompt, params, n=len(params)) == expected
    assert len(published) > 10 and published == sorted(published)


def test_a_constraint_in_use_by_many_requests_is_dealt_over_its_families() -> None:
    """Copies of one compiled matcher take turns at its lexer, so requests live at once are dealt over up
    to max_families compilations of their constraint (one used by a request at a time stays at one);
    the masks, grouped by family for llguidance's threads, land in each request's own row; finished
    (None) matchers allow everything, stopped ones EOS alone (llguidance's own row for them)."""
    import numpy as np

    from tokenmill.loader import resolve_model
    from tokenmill.structured_outputs import StructuredOutputs

    source = resolve_model("default")
    structured = StructuredOutputs(source.load_tokenizer, 49152, mask_threads=2, max_families=3)
    constraint = StructuredOutputsParams(json=PERSON)
    handed = [structured.matcher(constraint) for _ in range(7)]
    families = [family for _, family in handed]
    assert families[:3] == families[3:6] and len(set(families)) == 3 and families[6] == families[0]
    assert len(structured.compiled(constraint).roots) == 3
    for _ in range(5):  # one request at a time: the family is released before the next one comes
        single, family = structured.matcher(StructuredOutputsParams(regex="[0-9]+"))
        structured.release(family)
    single, family = structured.matcher(StructuredOutputsParams(regex="[0-9]+"))
    assert (
        family not in families
        and len(structured.compiled(StructuredOutputsParams(regex="[0-9]+")).roots) == 1
    )
    structured.release(families[1])  # a family with the fewest live copies is dealt next
    assert structured.matcher(constraint)[1] == families[1]
    matchers = [m for m, _ in handed]
    tokenizer = source.load_tokenizer()
    for i, m in enumerate(matchers):  # different states: a prefix of the same JSON each
        assert m.consume_tokens(
            tokenizer.encode('{"name": "Ada Lovelace"', add_special_tokens=False)[: i + 1]
        )
    stopped, _ = structured.matcher(StructuredOutputsParams(choice=["x"]))
    assert stopped.consume_tokens(tokenizer.encode("x", add_special_tokens=False)) and stopped.is_stopped()
    rows = [matchers[5], None, single, matchers[0], stopped, *matchers[1:5], matchers[6]]
    grouped = structured.fill_bitmask(
        rows, [families[5], -1, family, families[0], 0, *families[1:5], families[6]]
    )
    assert (grouped == structured.fill_bitmask(rows)).all()
    eos_only = np.zeros(structured.words, np.int32)
    eos_only[tokenizer.eos_token_id // 32] = 1 << (tokenizer.eos_token_id % 32)
    for row, m in enumerate(rows):
        if m is None:
            assert (grouped[row] == -1).all()
        elif m.is_stopped():
            assert (grouped[row] == eos_only).all()
        else:
            assert grouped[row].tobytes() == m.compute_bitmask()[: structured.words * 4]
    with pytest.raises(ValueError, match="mask_threads"):
        StructuredOutputs(source.load_tokenizer, 49152, mask_threads=0)
    with pytest.raises(ValueError, match="max_families"):
        StructuredOutputs(source.load_tokenizer, 49152, max_families=0)
    assert np.unique(grouped[[0, 3]], axis=0).shape[0] == 2  # two states, two masks


def test_the_fill_hands_each_matcher_its_tokens_in_order() -> None:
    """Tokens waiting for a fill (taken in by the core, or claimed from the step in flight, rows read once
    its tokens are in) reach their matchers in order before the masks are computed; a matcher with two
    waiting tokens (llguidance's parallel consume refuses a matcher named twice) gets both."""
    import numpy as np

    from tokenmill.loader import resolve_model
    from tokenmill.structured_outputs import StructuredOutputs

    source = resolve_model("default")
    structured = StructuredOutputs(source.load_tokenizer, 49152, mask_threads=2)
    ids = source.load_tokenizer().encode("abcabcabc", add_special_tokens=False)
    constraint = StructuredOutputsParams(regex="(abc)+")
    first, second, third = (structured.matcher(constraint)[0] for _ in range(3))
    consume = [(first, ids[0]), (second, ids[0]), (first, ids[1])]
    calls = []
    fill = structured.bitmask_fill(
        [first, second, third],
        consume=consume,
        claimed=(lambda: calls.append("tokens") or [ids[2], -1], [(third, 0)]),
    )
    mask = fill(lambda: calls.append("consumed"))
    assert calls == ["tokens", "consumed"]
    reference = structured.matcher(constraint)[0]
    for count, matcher in ((2, first), (1, second), (1, third)):
        expected = reference.deep_copy()
        assert expected.consume_tokens(ids[:count] if matcher is not third else [ids[2]])
        row = [first, second, third].index(matcher)
        assert mask[row].tobytes() == expected.compute_bitmask()[: structured.words * 4]
    assert not any(m.is_error() for m in (first, second, third)) and np.any(mask != 0)


def test_families_follow_the_requests_live_at_once(llm, monkeypatch) -> None:
    """The engine releases a request's family when it ends: a constraint used one request at a time
    keeps one compilation, three at once get three; and the compilations kept over every constraint
    are bounded (least recently used constraints go first)."""
    import tokenmill.structured_outputs as so

    structured = llm.engine.core.scheduler.structured
    constraint = {"regex": "(red|green|blue)[0-9]"}
    params = SamplingParams(max_tokens=4, temperature=0, structured_outputs=constraint)
    for _ in range(3):
        chat(llm, "A colour and a digit.", params)
    compiled = structured.compiled(StructuredOutputsParams(**constraint))
    assert len(compiled.roots) == 1 and compiled.live == [0]
    texts = chat(llm, "A colour and a digit.", params, n=3)
    assert all(re.fullmatch("(red|green|blue)[0-9]", t) for t in texts)
    assert len(compiled.roots) == 3 and compiled.live == [0, 0, 0]
    monkeypatch.setattr(so, "_MAX_COMPILED", structured.num_compiled + 1)
    held = [structured.matcher(StructuredOutputsParams(regex=f"[a-z]{{{k}}}"))[1] for k in (2, 3)]
    assert structured.num_compiled <= so._MAX_COMPILED
    for family in held:
        structured.release(family)


def test_bench_reports_the_fill_and_the_loops_waits(llm) -> None:
    """bench throughput's figures come from the engine's own counters: steps that needed masks and their
    fill time, and the loop's waits per step."""
    from tokenmill.bench.offline import loop_stats, structured_stats

    core = llm.engine.core
    fills, steps = core.scheduler.grammar_mask_steps, core.num_steps
    params = SamplingParams(max_tokens=6, temperature=0, structured_outputs={"regex": "[0-9]{6}"})
    texts = chat(llm, "Six digits.", params, n=2)
    assert all(re.fullmatch("[0-9]{6}", t) for t in texts)
    masked = structured_stats(llm)
    # A digit a token (SmolLM2's tokenizer splits numbers): a masked step per token.
    assert core.scheduler.grammar_mask_steps - fills >= 6 and masked["mask_ms_per_step"] > 0
    loop = loop_stats(llm)
    assert loop is not None and loop["steps"] == core.num_steps >= steps + 6
    assert loop["ms_per_step_on_tokens"] > 0 and loop["ms_per_step_on_masks"] >= 0


def test_offline_chat_with_tools_and_a_named_call(llm) -> None:
    """LLM.chat(tools=...) describes the tools to a template that has no place for them; a grammar from
    the tool's parameters makes the answer its arguments."""
    city = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
    params = SamplingParams(
        max_tokens=40, temperature=0, structured_outputs={"json": weather["function"]["parameters"]}
    )
    output = llm.chat(
        [{"role": "user", "content": "Weather in Oslo?"}], params, tools=[weather], use_tqdm=False
    )[0]
    assert "<tools>" in output.prompt and "get_weather" in output.prompt
    assert isinstance(json.loads(output.outputs[0].text)["city"], str)


def test_grammars_under_preemption_write_the_same_with_async_scheduling() -> None:
    """Preempted constrained requests keep their tokens and grammars: with async scheduling the helper
    takes each step's tokens from the step in flight ("claimed", Request.grammar_claimed) unless the
    request left the next step (preempted), when they reach the grammar through the core instead. Both
    loops write the same, every output fits its constraint, and the cache is empty after."""
    prompts = [[int(t) for t in np.random.default_rng(i).integers(100, 40000, 30 + 7 * i)] for i in range(5)]
    letters, code = {"regex": "[a-z]{24}"}, {"regex": "[0-9]{3}-[a-z]{9}"}
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, structured_outputs=letters),
        SamplingParams(max_tokens=40, temperature=0.9, seed=4, structured_outputs=code),
        SamplingParams(max_tokens=30, temperature=0, structured_outputs={"choice": ["alpha beta", "gamma"]}),
        SamplingParams(max_tokens=40, temperature=0.8, seed=7, structured_outputs={"json": PERSON}),
        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
    ]
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(
            "default", dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=64,
            max_model_len=128, async_scheduling=async_scheduling,
        )  # fmt: skip
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        results[async_scheduling] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]
        scheduler = llm.engine.scheduler
        assert scheduler.num_preemptions > 0
        assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks
        texts = [o.outputs[0].text for o in outputs]
        assert re.fullmatch("[a-z]{24}", texts[0]) and re.fullmatch("[0-9]{3}-[a-z]{9}", texts[1])
        assert texts[2] in ("alpha beta", "gamma")
    assert results[True] == results[False]


@pytest.mark.parametrize(
    ("schema", "accepted", "refused"),
    [
        (  # allOf: one object of two parts, closed to the names of both
            {
                "allOf": [
                    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
                ]
            },
            ['{"a": 1, "b": 2}'],
            ['{"a": 1, "b": 2, "c": 3}', '{"a": 1}'],
        ),
        (  # properties beside alternatives that list their own: each alternative holds the parent's too
            {
                "type": "object",
                "properties": {"kind": {"enum": ["x", "y"]}},
                "required": ["kind"],
                "anyOf": [
                    {"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                    {"properties": {"y": {"type": "boolean"}}, "required": ["y"]},
                ],
            },
            ['{"kind": "x", "x": 3}', '{"kind": "y", "y": true}'],
            ['{"kind": "x", "x": 3, "z": 1}', '{"kind": "x"}'],
        ),
        (  # a definition used as an allOf part, beside properties of the object using it
            {
                "$defs": {
                    "Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
                },
                "allOf": [{"$ref": "#/$defs/Base"}],
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
            },
            ['{"id": 1, "name": "a"}'],
            ['{"id": 1, "name": "a", "extra": 0}'],
        ),
        (  # alternatives alone are closed each to its own names (pydantic's unions)
            {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]},
            ['{"a": 1}'],
            ['{"a": 1, "b": 2}'],
        ),
    ],
)
def test_composed_schemas_are_closed_as_one_object(schema, accepted, refused) -> None:
    """Objects made of parts (allOf; properties beside anyOf alternatives with their own) are closed to
    the names of all their parts, not each part to its own names (which no object could satisfy)."""
    from tokenmill.loader import resolve_model
    from tokenmill.structured_outputs import StructuredOutputs

    source = resolve_model("default")
    tokenizer = source.load_tokenizer()
    structured = StructuredOutputs(source.load_tokenizer, 49152, mask_threads=1, max_families=1)
    root = structured.compiled(StructuredOutputsParams(json=schema)).roots[0]

    def complete(text: str) -> bool:
        matcher = root.deep_copy()
        ids = tokenizer.encode(text, add_special_tokens=False)
        return (
            matcher.validate_tokens(ids) == len(ids)
            and matcher.consume_tokens(ids)
            and matcher.is_accepting()
        )

    assert all(complete(text) for text in accepted)
    assert not any(complete(text) for text in refused)


def test_a_grammar_after_thinking_leaves_the_thinking_free(monkeypatch) -> None:
    """StructuredOutputsParams.reasoning: while the model thinks its rows allow everything and its tokens
    are not the grammar's; from the token that ends the thinking on, the rows are the grammar's as if
    nothing came before. deepseek_r1 starts inside the thinking; under qwen3 the first token may open it
    (its row: the grammar's and the opening tag). Tokens reach the gates as pending (consume) or from the
    step in flight (claimed)."""
    from dataclasses import replace

    from tokenmill.loader import resolve_model
    from tokenmill.structured_outputs import AfterThinking, StructuredOutputs

    source = resolve_model("default")
    tokenizer = source.load_tokenizer()
    (start,), (end,) = (tokenizer.encode(t, add_special_tokens=False) for t in ("<", ">"))  # stand-ins
    (one,), (letter,) = (tokenizer.encode(t, add_special_tokens=False) for t in ("1", "a"))
    monkeypatch.setattr(StructuredOutputs, "thinking_tags", lambda self: (start, end))
    structured = StructuredOutputs(source.load_tokenizer, 49152, mask_threads=2, max_families=1)
    params = StructuredOutputsParams(regex="[0-9]{3}")

    def row(matcher, tokens=(), claimed=()) -> np.ndarray:
        fill = structured.bitmask_fill(
            [matcher], consume=[(matcher, t) for t in tokens],
            claimed=(lambda: list(claimed), [(matcher, 0)]) if claimed else None,
        )  # fmt: skip
        return fill()[0].copy()

    def allowed(mask_row: np.ndarray, token: int) -> bool:
        return bool((mask_row.view(np.uint32)[token >> 5] >> np.uint32(token & 31)) & 1)

    plain = structured.matcher(params)[0]
    fresh = row(plain)
    thinker = structured.matcher(replace(params, reasoning="deepseek_r1"))[0]
    assert isinstance(thinker, AfterThinking) and thinker.thinking
    assert (row(thinker) == -1).all()
    assert (row(thinker, [letter, start]) == -1).all() and not thinker.is_stopped()  # still thinking
    assert (row(thinker, claimed=[end]) == fresh).all() and not thinker.thinking
    after_one = row(plain, [one])
    assert (row(thinker, [one]) == after_one).all()
    assert (row(thinker, [one, one]) == row(plain, [one, one])).all()
    assert thinker.is_stopped() == plain.is_stopped()

    qwen3 = structured.matcher(replace(params, reasoning="qwen3"))[0]
    first = row(qwen3)
    assert allowed(first, start) and not allowed(fresh, start)
    first.view(np.uint32)[start >> 5] &= ~np.uint32(1 << (start & 31))
    assert (first == fresh).all()
    assert (row(qwen3, [start]) == -1).all() and (row(qwen3, [letter, end]) == fresh).all()
    answering = structured.matcher(replace(params, reasoning="qwen3"))[0]
    assert (row(answering, claimed=[one]) == after_one).all() and not allowed(after_one, start)
    monkeypatch.setattr(StructuredOutputs, "thinking_tags", lambda self: None)  # a model that does not think
    assert not isinstance(structured.matcher(replace(params, reasoning="qwen3"))[0], AfterThinking)


def test_the_prompt_decides_whether_the_grammar_waits(monkeypatch) -> None:
    """StructuredOutputsParams.prompt_thinking: a chat template that opened the thinking starts the output
    inside it under qwen3 too (its rows allow everything until `</think>`, with no `<think>` to wait for);
    one that closed it leaves no thinking under deepseek_r1 either: the grammar's from the first token."""
    from dataclasses import replace

    from tokenmill.loader import resolve_model
    from tokenmill.structured_outputs import AfterThinking, StructuredOutputs

    source = resolve_model("default")
    tokenizer = source.load_tokenizer()
    (start,), (end,) = (tokenizer.encode(t, add_special_tokens=False) for t in ("<", ">"))  # stand-ins
    (one,), (letter,) = (tokenizer.encode(t, add_special_tokens=False) for t in ("1", "a"))
    monkeypatch.setattr(StructuredOutputs, "thinking_tags", lambda self: (start, end))
    structured = StructuredOutputs(source.load_tokenizer, 49152, mask_threads=2, max_families=1)
    params = StructuredOutputsParams(regex="[0-9]{3}")
    fresh = structured.fill_bitmask([structured.matcher(params)[0]])[0].copy()

    opened = structured.matcher(replace(params, reasoning="qwen3", prompt_thinking="open"))[0]
    assert isinstance(opened, AfterThinking)
    assert (structured.fill_bitmask([opened])[0] == -1).all()
    for token in (letter, one, end):  # thinking, then its end
        assert opened.consume_token(token)
    assert (structured.fill_bitmask([opened])[0] == fresh).all()

    closed = structured.matcher(replace(params, reasoning="deepseek_r1", prompt_thinking="closed"))[0]
    assert not isinstance(closed, AfterThinking)
    assert (structured.fill_bitmask([closed])[0] == fresh).all()
    assert not closed.consume_token(letter)  # the grammar's first token, not a thinking's


def test_allowed_token_ids_are_checked_against_what_may_come_first_under_a_reasoning_parser() -> None:
    """Where the output starts inside the thinking, anything may come first; where the model may open it
    (qwen3, a template that says nothing), `<think>` or the constraint's first tokens; where the template
    closed it, the constraint's first tokens alone."""
    from dataclasses import replace

    from tokenmill.loader import resolve_model
    from tokenmill.serving.input_processor import InputProcessor

    tokenizer = resolve_model("default").load_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    think, a = tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("a")
    processor = InputProcessor(tokenizer, 1024, 49216)
    constraint = StructuredOutputsParams(json={"type": "object"})

    def check(allowed: list[int], **thinking) -> None:
        params = SamplingParams(allowed_token_ids=allowed)
        params.structured_outputs = replace(constraint, **thinking)
        processor.check_structured(params)

    refused = "allowed_token_ids holds none of the tokens the output constraint allows first"
    for thinking in ({}, {"reasoning": "qwen3", "prompt_thinking": "closed"}, {"reasoning": "qwen3"}):
        with pytest.raises(ValueError, match=refused):
            check([a], **thinking)
    check([think], reasoning="qwen3")  # the model opens the thinking
    check([a], reasoning="deepseek_r1")  # its output starts inside the thinking
    check([a], reasoning="qwen3", prompt_thinking="open")
    with pytest.raises(ValueError, match=refused):
        check([think], reasoning="qwen3", prompt_thinking="closed")
