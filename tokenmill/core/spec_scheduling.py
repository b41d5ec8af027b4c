"""The scheduler's side of speculative decoding: whether a step verifies drafts and whether the worker
proposes after it, which drafts each decode verifies, the KV slots past a step's tokens that a
model-based proposer writes into, and the acceptance counters the metrics read."""

from __future__ import annotations

from tokenmill.core.request import Request
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.policy import BatchLimit

# Dynamic speculation: the weight of a verifying step's acceptance in a request's running average, and
# how often (in decode steps) a request whose average fell below the minimum tries drafts again.
ACCEPTANCE_WEIGHT = 0.3
PROBE_INTERVAL = 8


class SpecScheduling:
    def __init__(
        self, speculation: SpeculativeConfig | None, policy: BatchLimit | None, max_model_len: int
    ) -> None:
        """policy: when speculation stops paying as the batch grows (spec_decode/policy.py), unless the
        config fixes disable_by_batch_size."""
        self.enabled = speculation is not None
        self.max_model_len = max_model_len
        # Drafts are verified only at positions below the speculative config's own max_model_len.
        draft_max_model_len = speculation.max_model_len if speculation else None
        if draft_max_model_len is not None and draft_max_model_len > max_model_len:
            raise ValueError(
                f"speculative_config max_model_len ({draft_max_model_len}) is larger than the target's "
                f"max_model_len ({max_model_len}); leave it out or make it at most that."
            )
        self.draft_max_model_len = draft_max_model_len or max_model_len
        # Dynamic speculation (SpeculativeConfig's disable_by_batch_size and min_acceptance), and the
        # slots allocated past a step's tokens for drafts the worker writes into the KV cache before the
        # next step (a model-based proposer; never past max_model_len).
        self.disable_by_batch_size = speculation.disable_by_batch_size if speculation else None
        self.min_acceptance = speculation.min_acceptance if speculation else 0.0
        self.lookahead = speculation.lookahead if speculation else 0
        self.policy = policy if speculation and speculation.disable_by_batch_size is None else None
        # Whether the last scheduled step speculates: the engine core then waits for its tokens before
        # planning the next (whose drafts they decide) instead of overlapping it.
        self.active = self.enabled
        # Steps that verified drafts, drafts verified, drafts accepted, and accepted drafts by position
        # (index 0: the first draft of a step).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []
        self._step_verified = self._step_accepted = 0  # this step's verifying requests, for the policy

    def reset_counters(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = []

    def decide(self, running: list[Request]) -> tuple[bool, bool]:
        """(whether this step verifies drafts, whether the worker proposes after it): never without a
        speculative config; else below disable_by_batch_size, or as the policy finds it pays (and a step
        before one of its probes proposes). A step that proposes runs synchronously (active)."""
        if not self.enabled:
            return False, False
        if self.disable_by_batch_size is not None:
            verifying = proposing = len(running) < self.disable_by_batch_size
        elif self.policy is not None and running:
            context = sum(r.num_computed_tokens for r in running) / len(running)
            verifying, proposing = self.policy.speculates(len(running), context)
        else:
            verifying = proposing = True
        self.active = proposing
        return verifying, proposing

    def with_lookahead(self, request: Request, num_new: int, start: int | None = None) -> int:
        """num_new tokens from `start` (the computed ones by default), plus the drafting lookahead."""
        if not self.lookahead:
            return num_new
        end = (request.num_computed_tokens if start is None else start) + num_new
        return num_new + max(0, min(self.lookahead, self.max_model_len - end))

    def drafts(self, request: Request, num_wanted: int, budget: int) -> list[int]:
        """The request's drafts this step verifies: only for a decode with nothing in flight, and only as
        many as the step budget, max_model_len (the speculative config's, if smaller) and max_tokens
        leave room for after the target's own token."""
        drafts = request.spec_token_ids
        if not drafts or num_wanted != 1 or request.num_output_placeholders or request.grammar is not None:
            return []
        if request.spec_acceptance < self.min_acceptance:
            # Drafts have not been paying for this request: one verifying step now and then, to notice
            # when its text starts copying again.
            request.spec_steps_off += 1
            if request.spec_steps_off % PROBE_INTERVAL:
                return []
        room = min(len(drafts), budget - 1, self.draft_max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return drafts[: max(room, 0)]

    def begin_update(self) -> None:
        """A step's outputs are about to be taken in."""
        self._step_verified = self._step_accepted = 0

    def accepted(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verifying step of `request` accepted num_accepted of its num_drafts drafts."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self._step_verified += 1
        self._step_accepted += num_accepted
        per_position = self.accepted_per_position
        per_position.extend([0] * (num_drafts - len(per_position)))
        for position in range(num_accepted):
            per_position[position] += 1
        rate = num_accepted / num_drafts
        request.spec_acceptance += ACCEPTANCE_WEIGHT * (rate - request.spec_acceptance)

    def end_update(self) -> None:
        """The step's outputs are in: the policy learns the tokens its verifying requests gained."""
        if self._step_verified and self.policy is not None:
            self.policy.observe(1 + self._step_accepted / self._step_verified)
