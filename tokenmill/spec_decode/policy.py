"""Dynamic speculation by batch size: a step verifies drafts only while the tokens a verify step yields
(tau, measured) are worth more than what it costs over a plain decode step at the running batch and
context (the planner's roofline, on this GPU).

At small batches decode reads the weights and leaves the compute idle, so a verify step of k + 1 tokens
per request costs about one plain step; as the batch grows the step turns compute-bound and its cost
approaches k + 1 plain steps, later the longer the context (reading the KV cache keeps a step
bandwidth-bound). Speculation pays at batch b while tau / (cost(b) + k * draft_cost) stays above
MARGIN; tau is a running average over verifying steps of the tokens their requests got (1 + accepted
drafts), starting from its value at acceptance 0.5. While speculation is off tau is not measured, so where a
verify step is nearly free (its cost within MARGIN of a plain step) one step in PROBE_INTERVAL
speculates anyway and measures it again. Both steps' costs carry STEP_OVERHEAD_S beside their floors."""

from __future__ import annotations

import bisect
import logging

from tokenmill.plan.speculative import tokens_per_verify_step

logger = logging.getLogger("tokenmill")

# Wanted speed-up over plain decode before a step speculates: the roofline leaves out the verify step's
# host work and the sampler's extra rows.
MARGIN = 1.05
# Weight of each verifying step's mean tokens per request in the running tau.
TAU_WEIGHT = 0.2
PROBE_INTERVAL = 16
# What a step costs beyond its roofline floor, whatever its shape: kernel launch gaps and tails, the
# sampler, the host's share (an 8B decode step on an H200: 4.77 ms against a 3.59 ms floor). It pulls
# a small model's verify cost towards 1, as measured, where the bare roofline would put it near k + 1.
STEP_OVERHEAD_S = 1e-3
# Contexts the cost tables are computed at; a step uses the nearest one at or above its mean context.
CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class BatchLimit:
    def __init__(
        self, verify_costs: dict[int, list[float]], num_speculative_tokens: int, draft_cost: float
    ) -> None:
        """verify_costs[context][b - 1]: a verify step's cost over a plain step at batch b."""
        self.k = num_speculative_tokens
        self.draft_cost = draft_cost
        self.contexts = sorted(verify_costs)
        self.costs = [verify_costs[c] for c in self.contexts]
        self.tau = tokens_per_verify_step(self.k, 0.5)
        self.steps_off = 0

    def observe(self, tokens_per_request: float) -> None:
        """A verifying step's mean of 1 + accepted drafts over its verifying requests."""
        self.tau += TAU_WEIGHT * (tokens_per_request - self.tau)

    def _costs(self, context_len: float) -> list[float]:
        index = min(bisect.bisect_left(self.contexts, context_len), len(self.contexts) - 1)
        return self.costs[index]

    def _cost(self, batch: int, context_len: float) -> float:
        """A verify step's cost over a plain one at this batch (the table's last past its end)."""
        costs = self._costs(context_len)
        return costs[min(batch, len(costs)) - 1]

    def pays(self, batch: int, context_len: float) -> bool:
        return self.tau >= MARGIN * (self._cost(batch, context_len) + self.k * self.draft_cost)

    def speculates(self, batch: int, context_len: float) -> tuple[bool, bool]:
        """(whether this step verifies drafts, whether the worker proposes after it); called once per
        step. A probe takes two steps: the one before proposes, the probe verifies."""
        if batch < 1 or self.pays(batch, context_len):
            self.steps_off = 0
            return True, True
        if self._cost(batch, context_len) > MARGIN:
            return False, False
        self.steps_off += 1
        phase = self.steps_off % PROBE_INTERVAL
        return phase == 0, phase == PROBE_INTERVAL - 1

    def limit(self, context_len: float) -> int:
        """The smallest batch that does not speculate at the current tau (past the table: never)."""
        costs = self._costs(context_len)
        for batch in range(1, len(costs) + 1):
            if not self.pays(batch, context_len):
                return batch
        return len(costs) + 1


def batch_limit_for(hf_config, device_name: str, k: int, draft_cost: float, max_batch: int,
                    max_model_len: int, weight_dtype: str = "bf16",
                    kv_dtype: str = "bf16") -> BatchLimit | None:  # fmt: skip
    """The planner's policy for this model on this GPU, or None (no limit) when the planner does not
    know the card or cannot read the model's shape; weight_dtype and kv_dtype as the engine holds them
    (plan/memory.py's names)."""
    from tokenmill.plan.gpus import MEASURED, ceilings_for, resolve_gpu
    from tokenmill.plan.memory import Deployment
    from tokenmill.plan.model_shape import from_hf_config
    from tokenmill.plan.speculative import verify_costs

    try:
        gpu = resolve_gpu(device_name)
        shape = from_hf_config(hf_config.to_dict(), getattr(hf_config, "name_or_path", "") or "model")
    except ValueError as exc:
        logger.info("speculation is not limited by batch size (%s)", exc)
        return None
    ceilings = ceilings_for(gpu, weight_dtype, measured=gpu.name in MEASURED)
    contexts = [c for c in CONTEXTS if c < max_model_len] + [max_model_len]
    deployment = Deployment(
        shape, gpu, weight_dtype=weight_dtype, kv_dtype=kv_dtype, context_len=max_model_len
    )
    costs = {
        context: verify_costs(deployment, ceilings, 1, context, k, max_batch, STEP_OVERHEAD_S)
        for context in contexts
    }
    policy = BatchLimit(costs, k, draft_cost)
    logger.info(
        "speculation off from batch %d at 1k context and tau %.2f (k=%d, %s roofline, draft cost %.3f of "
        "a decode step)", policy.limit(1024), policy.tau, k, gpu.name, draft_cost,
    )  # fmt: skip
    return policy
