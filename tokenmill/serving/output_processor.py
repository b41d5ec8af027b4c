"""Turns engine-core outputs into what callers read: detokenized text, stop strings, logprobs, and one
RequestOutput per user request however many samples (n) it fans out into."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
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
    # With stop strings, logprob entries wait here with their token's text offset until that text is
    # emitted; the entries of tokens inside a stop string cut from the text are never reported.
    held_logprobs: list[tuple[int, dict[int, Logprob]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0

    @property
    def text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def snapshot(
        self, delta_text: str = "", delta_token_ids: list[int] | None = None, delta_logprobs=None
    ) -> CompletionOutput:
        """An output for this sample now; delta_token_ids is taken as given (the caller's fresh list).
        The cumulative lists are copies: an output a caller holds never changes under it."""
        return CompletionOutput(
            self.index,
            self.text,
            self.token_ids.copy(),
            self.cumulative_logprob,
            None if self.logprobs is None else self.logprobs.copy(),
            self.finish_reason,
            self.stop_reason,
            delta_text,
            [] if delta_token_ids is None else delta_token_ids,
            delta_logprobs,
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
    pooled: bytes | None = None
    error: str | None = None  # why the engine failed it (EngineCoreOutput.error)
    # Only the finished request's output is wanted (the offline LLM's generate, as vLLM's FINAL_ONLY):
    # no output is built for its steps before.
    final_only: bool = False

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        final_only: bool = False,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a request; returns the (child request id, params) pairs to hand the engine core.
        final_only: process() returns this request's output once, when it has finished (the same output
        as without it at that step), and none before."""
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        samples, children = [], []
        for index in range(params.n):
            sample_params = child_params(params, index)
            detokenizer = None
            if self.tokenizer is not None and params.detokenize:
                detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sample_params)
            samples.append(SampleState(index, sample_params, detokenizer))
            child_id = child_request_id(request_id, index, params.n)
            self.child_to_parent[child_id] = (request_id, index)
            children.append((child_id, sample_params))
        self.parents[request_id] = ParentState(
            request_id, prompt, list(prompt_token_ids), samples, final_only=final_only
        )
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

    def _decode_logprobs(
        self, logprobs: TokenLogprobs, token_id: int, detokenize: bool = True
    ) -> dict[int, Logprob]:
        def text(tid: int) -> str | None:
            return None if self.tokenizer is None or not detokenize else self.tokenizer.decode([tid])

        entry = {token_id: Logprob(logprobs.logprob, logprobs.rank, text(token_id))}
        for rank, (tid, lp) in enumerate(zip(logprobs.top_token_ids, logprobs.top_logprobs), start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, rank, text(tid))
        return entry

    @staticmethod
    def _release_logprobs(
        sample: SampleState, entries: list[dict[int, Logprob]], finish_reason: str | None, stop: str | None
    ) -> list[dict[int, Logprob]]:
        """The held entries whose token's text has been emitted; at a stop string, those whose text
        starts before the cut (the rest belonged to the stop string and are dropped)."""
        detokenizer = sample.detokenizer
        assert detokenizer is not None and detokenizer.token_starts is not None
        starts = detokenizer.token_starts[len(sample.token_ids) - len(entries) :]
        sample.held_logprobs.extend(zip(starts, entries))
        if finish_reason is not None and stop is None:
            limit = None  # a stop token or a length cut: every token counts
        else:
            limit = len(detokenizer.output_text) if finish_reason is not None else detokenizer.num_emitted
        released = []
        while sample.held_logprobs and (limit is None or sample.held_logprobs[0][0] < limit):
            released.append(sample.held_logprobs.pop(0)[1])
        if finish_reason is not None:
            sample.held_logprobs.clear()
        return released

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (one RequestOutput per touched request, child ids to abort after a stop string).
        This runs for every token of every stream: keep it lean."""
        # Per touched request, its samples' deltas of this step, made into outputs only where emitted.
        deltas: dict[str, dict[int, tuple[SampleState, str, list[int], list | None]]] = {}
        to_abort: list[str] = []
        child_to_parent, parents = self.child_to_parent, self.parents
        for core_output in outputs:
            located = child_to_parent.get(core_output.request_id)
            if located is None:
                continue  # aborted by the caller meanwhile
            parent = parents[located[0]]
            sample = parent.samples[located[1]]
            new_token_ids = core_output.new_token_ids
            if core_output.num_cached_tokens > parent.num_cached_tokens:
                parent.num_cached_tokens = core_output.num_cached_tokens
            if core_output.prompt_logprobs is not None and parent.prompt_logprobs is None:
                scored = zip(parent.prompt_token_ids[1:], core_output.prompt_logprobs)
                detokenize = sample.params.detokenize
                parent.prompt_logprobs = [None] + [
                    self._decode_logprobs(lp, tid, detokenize) for tid, lp in scored
                ]
            if core_output.pooled is not None:
                parent.pooled = core_output.pooled
            if core_output.error is not None:
                parent.error = core_output.error
            sample.token_ids.extend(new_token_ids)
            delta_logprobs = None
            if core_output.new_logprobs is not None and sample.logprobs is not None:
                delta_logprobs = []
                for token_id, lp in zip(new_token_ids, core_output.new_logprobs):
                    delta_logprobs.append(self._decode_logprobs(lp, token_id, sample.params.detokenize))
                    sample.cumulative_logprob += lp.logprob
            finish_reason, stop_reason = core_output.finish_reason, core_output.stop_reason
            delta_text = ""
            detokenizer = sample.detokenizer
            stop = None
            if detokenizer is not None:
                past_min_tokens = len(sample.token_ids) >= sample.params.min_tokens
                # A stop token or EOS that ended the request is not part of its text (vLLM's rule).
                on_token = (
                    finish_reason == "stop"
                    and bool(new_token_ids)
                    and (
                        isinstance(stop_reason, int)
                        or (stop_reason is None and new_token_ids[-1] in self.eos_token_ids)
                    )
                )
                last_in_text = not on_token or sample.params.include_stop_str_in_output
                stop = detokenizer.update(
                    new_token_ids, check_stop=past_min_tokens, last_in_text=last_in_text
                )
                if stop is not None:
                    if finish_reason is None:
                        to_abort.append(core_output.request_id)
                    finish_reason, stop_reason = "stop", stop
                delta_text = detokenizer.take_delta(finished=finish_reason is not None)
            if delta_logprobs is not None:
                if detokenizer is not None and detokenizer.token_starts is not None:
                    delta_logprobs = self._release_logprobs(sample, delta_logprobs, finish_reason, stop)
                sample.logprobs.extend(delta_logprobs)  # type: ignore[union-attr]
            if finish_reason is not None:
                sample.finish_reason, sample.stop_reason = finish_reason, stop_reason
                parent.num_finished += 1
                del child_to_parent[core_output.request_id]
            changed = deltas.get(parent.request_id)
            if changed is None:
                changed = deltas[parent.request_id] = {}
            changed[sample.index] = (sample, delta_text, new_token_ids, delta_logprobs)
        results = []
        for request_id, changed in deltas.items():
            parent = parents[request_id]
            samples = parent.samples
            finished = parent.num_finished == len(samples)
            if parent.final_only and not finished:
                continue
            if len(samples) == 1:
                completions = [s.snapshot(text, ids, lps) for s, text, ids, lps in changed.values()]
            else:
                completions = []
                for s in samples:
                    delta = changed.get(s.index)
                    completions.append(s.snapshot(*delta[1:]) if delta is not None else s.snapshot())
            results.append(
                RequestOutput(
                    request_id,
                    parent.prompt,
                    parent.prompt_token_ids,
                    completions,
                    finished,
                    parent.num_cached_tokens,
                    parent.prompt_logprobs,
                    parent.pooled,
                    parent.error,
                )
            )
            if finished:
                del parents[request_id]
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
