"""A step on its way from the device: what the model runner launched (Launched), a step that waits for
its grammar masks before sampling (AwaitingGrammar), and the sampled tokens' copy to the host with
everything the step reports (PendingRunnerOutput), read once the engine core asks for the result."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from tokenmill.core.outputs import ModelRunnerOutput, TokenLogprobs
from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.worker.grammar_masks import HostMasks
from tokenmill.worker.input_batch import StepInputs
from tokenmill.worker.sampler import LogprobTensors, Verified, resolve_drafts
from tokenmill.worker.sampling_batch import SamplingBatch

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner
    from tokenmill.worker.spec_verify import VerifyRows


class PendingRunnerOutput:
    """A launched step: sampled tokens (and logprobs) on their way to pinned host memory. result() waits
    for them, the step's one sync, and tells the worker which tokens stopped being pending."""

    def __init__(
        self,
        runner: ModelRunner,
        inputs: StepInputs,
        sampled: torch.Tensor,
        logprobs: LogprobTensors | None,
        logprob_ks: list[int | None],
        prompt_logprobs: dict | None,
        pooled: tuple[list[int], torch.Tensor] | None = None,
        verified: Verified | None = None,
        drafts: list[list[int]] | None = None,
        first_rows: list[int] | None = None,
    ) -> None:
        """pooled: the pooling runner's (rows, one vector per row) for the prompts this step finished.
        verified, drafts and first_rows (each request's first logit row): a step that verified drafts
        (then `sampled` is unused)."""
        self.runner = runner
        self.inputs = inputs
        self.req_ids = inputs.req_ids
        self.samples = inputs.samples
        non_blocking = sampled.is_cuda
        self.sampled = sampled.to("cpu", non_blocking=non_blocking)
        self.verified = None
        self.drafts = drafts
        self.first_rows = first_rows
        if verified is not None:
            self.verified = Verified(*(t.to("cpu", non_blocking=non_blocking) for t in verified))
        self.logprobs = logprobs.to_host(non_blocking) if logprobs is not None else None
        self.logprob_ks = logprob_ks
        self.prompt_logprobs = prompt_logprobs
        self.pooled = None
        if pooled is not None:
            self.pooled = (pooled[0], pooled[1].to("cpu", non_blocking=non_blocking))
        # Whether the step speculates, so the drafter proposes for the next (SchedulerOutput.propose_drafts).
        self.propose_drafts = False
        self.ready = torch.cuda.Event() if non_blocking else None
        if self.ready is not None:
            self.ready.record()
        self._result: ModelRunnerOutput | None = None

    def tokens_in_flight(self) -> tuple[list[str], list[bool], Callable[[], list[int]]] | None:
        """For a grammar fill that takes this step's tokens before the core does: (the rows' request ids,
        whether each row keeps its token, a call for any thread that waits for the tokens, without the
        GIL, and returns one a row). None for a step that verified drafts (several tokens a row)."""
        if self.verified is not None:
            return None

        def tokens() -> list[int]:
            if self.ready is not None:
                self.ready.synchronize()
            return self.sampled.tolist()

        return self.req_ids, self.samples, tokens

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            if self.ready is not None:
                self.ready.synchronize()
            if self.verified is None:
                token_ids = [[t] for t in self.sampled.tolist()]
            else:
                verified = [t.tolist() for t in self.verified]
                token_ids = resolve_drafts(verified, self.drafts, self.first_rows)
            self.runner.input_batch.record_sampled(self.req_ids, self.samples, token_ids)
            prompt_logprobs = None
            if self.prompt_logprobs:
                prompt_logprobs = {
                    request_id: (first, list(map(TokenLogprobs, *(t.tolist() for t in scored))))
                    for request_id, (first, scored) in self.prompt_logprobs.items()
                }
            pooled = None
            if self.pooled is not None:
                pooled = [None] * len(self.req_ids)
                rows, vectors = self.pooled
                for row, vector in zip(rows, vectors.numpy()):
                    pooled[row] = vector.tobytes()  # fp32 from the pooler; little-endian hosts only
            logprobs = None
            if self.logprobs is not None:  # a list per row: one entry per token the row produced
                entries = self.logprobs.tolist(self.logprob_ks)
                if self.verified is None:
                    logprobs = [None if entry is None else [entry] for entry in entries]
                else:  # one entry per logit row: each request's tokens take the entries of their rows
                    logprobs = [
                        None if entries[first] is None else entries[first : first + len(tokens)]
                        for first, tokens in zip(self.first_rows, token_ids)
                    ]
            self._result = ModelRunnerOutput(
                req_ids=self.req_ids,
                sampled_token_ids=[t if keeps else [] for t, keeps in zip(token_ids, self.samples)],
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                pooled=pooled,
                spec_token_ids=self.runner.propose(self.req_ids, self.samples, self.propose_drafts),
            )
        return self._result


class Launched(NamedTuple):
    """A step whose forward pass is on the device, up to its logits."""

    scheduler_output: SchedulerOutput
    inputs: StepInputs
    sampling_batch: SamplingBatch
    logits: torch.Tensor
    rows: VerifyRows | None  # a verifying step's logit rows
    prompt_logprobs: dict | None
    grammar_rows: torch.Tensor | None = None  # the constrained requests' logit rows, staged by prepare


class AwaitingGrammar:
    """A launched step that samples under grammars: with_grammar(masks) applies them and samples. The
    core fills the masks on the host while the device runs the forward pass. On a GPU they go into
    host_masks(words), and with_grammar of those queues the masked sampling at once, the stream waiting
    until the host publishes them."""

    def __init__(self, runner: ModelRunner, step: Launched) -> None:
        self.runner = runner
        self.step = step
        self.inputs = step.inputs

    def with_grammar(self, grammar_bitmask: np.ndarray | HostMasks) -> PendingRunnerOutput:
        """grammar_bitmask: [grammar requests, words] int32 (Scheduler.grammar_bitmask), or the
        HostMasks (from host_masks) that the host publishes once filled: the device waits for them."""
        return self.runner._sample(self.step, grammar_bitmask)

    def host_masks(self, words: int) -> HostMasks | None:
        """Pinned memory for the step's masks ([grammar requests, words] int32), which the device can
        wait for; None where it cannot (a CPU). Fill and publish them, or the step never samples."""
        if self.runner.device.type != "cuda":
            return None
        return self.runner.grammar_masks.host_masks(len(self.step.scheduler_output.grammar_req_ids), words)
