"""Turns engine-core outputs into what callers read: detokenized text, stop strings, logprobs, and one
RequestOutput per user request however many samples (n) it fans out into."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenmill.core.outputs import EngineCoreOutput, TokenLogprobs
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.serving.detokenizer import IncrementalDetokenizer


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The samples of one request differ: each gets its own seed offset, as vLLM does."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


@dataclass
class SampleState:
    """One sample's accumulated output; every emission is a fresh CompletionOutput with its own deltas."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0

    @property
    def text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def snapshot(self, delta_text: str = "", delta_token_ids=(), delta_logprobs=None) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=self.token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            delta_text=delta_text,
            delta_token_ids=list(delta_token_ids),
            delta_logprobs=delta_logprobs,
        )


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    num_cached_tokens: int = 0
    num_finished: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[tuple[str, SamplingParams]]:
        """Register a request; returns the (child request id, params) pairs to hand the engine core."""
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        samples, children = [], []
        for index in range(params.n):
            sample_params = child_params(params, index)
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sample_params)
            samples.append(SampleState(index, sample_params, detokenizer))
            child_id = child_request_id(request_id, index, params.n)
            self.child_to_parent[child_id] = (request_id, index)
            children.append((child_id, sample_params))
        self.parents[request_id] = ParentState(request_id, prompt, list(prompt_token_ids), samples)
        return children

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        return [child_request_id(request_id, s.index, len(parent.samples)) for s in parent.samples]

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the child ids the engine core must abort."""
        children = self.child_ids(request_id)
        for child in children:
            self.child_to_parent.pop(child, None)
        self.parents.pop(request_id, None)
        return children

    def _decode_logprobs(self, logprobs: TokenLogprobs, token_id: int) -> dict[int, Logprob]:
        def text(tid: int) -> str | None:
            return None if self.tokenizer is None else self.tokenizer.decode([tid])

        entry = {token_id: Logprob(logprobs.logprob, logprobs.rank, text(token_id))}
        for rank, (tid, lp) in enumerate(zip(logprobs.top_token_ids, logprobs.top_logprobs), start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, rank, text(tid))
        return entry

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (one RequestOutput per touched request, child ids to abort after a stop string)."""
        deltas: dict[str, dict[int, CompletionOutput]] = {}
        to_abort: list[str] = []
        for core_output in outputs:
            located = self.child_to_parent.get(core_output.request_id)
            if located is None:
                continue  # aborted by the caller meanwhile
            parent = self.parents[located[0]]
            sample = parent.samples[located[1]]
            parent.num_cached_tokens = max(parent.num_cached_tokens, core_output.num_cached_tokens)
            if core_output.prompt_logprobs is not None and parent.prompt_logprobs is None:
                scored = zip(parent.prompt_token_ids[1:], core_output.prompt_logprobs)
                parent.prompt_logprobs = [None] + [self._decode_logprobs(lp, tid) for tid, lp in scored]
            sample.token_ids.extend(core_output.new_token_ids)
            delta_logprobs = None
            if core_output.new_logprobs is not None and sample.logprobs is not None:
                delta_logprobs = []
                for token_id, lp in zip(core_output.new_token_ids, core_output.new_logprobs):
                    entry = self._decode_logprobs(lp, token_id)
                    sample.logprobs.append(entry)
                    delta_logprobs.append(entry)
                    sample.cumulative_logprob += lp.logprob
            finish_reason, stop_reason = core_output.finish_reason, core_output.stop_reason
            delta_text = ""
            if sample.detokenizer is not None:
                past_min_tokens = len(sample.token_ids) >= sample.params.min_tokens
                stop = sample.detokenizer.update(core_output.new_token_ids, check_stop=past_min_tokens)
                if stop is not None:
                    if finish_reason is None:
                        to_abort.append(core_output.request_id)
                    finish_reason, stop_reason = "stop", stop
                delta_text = sample.detokenizer.take_delta(finished=finish_reason is not None)
            if finish_reason is not None:
                sample.finish_reason, sample.stop_reason = finish_reason, stop_reason
                parent.num_finished += 1
                self.child_to_parent.pop(core_output.request_id, None)
            deltas.setdefault(parent.request_id, {})[sample.index] = sample.snapshot(
                delta_text, core_output.new_token_ids, delta_logprobs
            )
        results = []
        for request_id, changed in deltas.items():
            parent = self.parents[request_id]
            results.append(
                RequestOutput(
                    request_id=request_id,
                    prompt=parent.prompt,
                    prompt_token_ids=parent.prompt_token_ids,
                    outputs=[changed.get(s.index) or s.snapshot() for s in parent.samples],
                    finished=parent.finished,
                    num_cached_tokens=parent.num_cached_tokens,
                    prompt_logprobs=parent.prompt_logprobs,
                )
            )
            if parent.finished:
                del self.parents[request_id]
        return results, to_abort


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output standing for two consecutive ones of a request: the later state, the deltas joined."""
    merged = []
    for a, b in zip(earlier.outputs, later.outputs, strict=True):
        logprobs = None
        if a.delta_logprobs is not None or b.delta_logprobs is not None:
            logprobs = (a.delta_logprobs or []) + (b.delta_logprobs or [])
        merged.append(
            dataclasses.replace(
                b,
                delta_text=a.delta_text + b.delta_text,
                delta_token_ids=a.delta_token_ids + b.delta_token_ids,
                delta_logprobs=logprobs,
            )
        )
    return dataclasses.replace(later, outputs=merged)
