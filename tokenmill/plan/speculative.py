"""Speculative decoding on the roofline: how many tokens a verify step yields at a given acceptance, what
that step costs next to a plain decode step, the speed-up that follows, and the batch from which
speculation stops paying (where the step turns compute-bound and verifying k drafts costs k+1 steps)."""

from __future__ import annotations

from typing import NamedTuple

from tokenmill.plan.gpus import RooflineCeilings
from tokenmill.plan.memory import Deployment
from tokenmill.plan.roofline import RooflinePoint, decode_point, smallest_batch


class SpeculativePlan(NamedTuple):
    num_speculative_tokens: int  # k drafts per verify step
    acceptance: float  # probability that each draft is accepted, given the ones before it were
    tokens_per_step: float  # expected tokens a verify step yields (tau)
    verify: RooflinePoint  # the verify step at the plan's batch
    verify_cost: float  # verify step / plain decode step at that batch
    verify_cost_source: str  # "roofline", or "measured" when given
    draft_cost: float  # one draft token's cost, as a fraction of a plain decode step (0: n-gram)
    speedup: float  # decode tok/s with speculation / without, at the plan's batch
    break_even_batch: int | None  # the smallest batch where the roofline speed-up falls below 1


def tokens_per_verify_step(num_speculative_tokens: int, acceptance: float) -> float:
    """tau = (1 - a^(k+1)) / (1 - a): the accepted prefix of the k drafts plus the token the verify step
    samples itself, each draft accepted with probability a (Leviathan et al., 2023)."""
    k, a = num_speculative_tokens, acceptance
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def speedup(tokens_per_step: float, cost: float, num_speculative_tokens: int, draft_cost: float) -> float:
    """Tokens per unit of plain-decode time: tau over the verify step's cost (in plain decode steps) plus
    the k drafts' proposal."""
    return tokens_per_step / (cost + num_speculative_tokens * draft_cost)


def verify_step(
    deployment: Deployment,
    ceilings: RooflineCeilings,
    tp: int,
    batch: int,
    context_len: int,
    k: int,
    overhead_s: float = 0.0,
) -> tuple[RooflinePoint, float]:
    """The verify step at `batch` and its floor over a plain decode step's floor, each plus overhead_s
    (what any step costs beyond its floor)."""
    verify = decode_point(deployment, ceilings, tp, batch, context_len, tokens_per_seq=k + 1)
    plain = decode_point(deployment, ceilings, tp, batch, context_len)
    return verify, (verify.floor_s + overhead_s) / (plain.floor_s + overhead_s)


def plan_speculative(
    deployment: Deployment,
    ceilings: RooflineCeilings,
    tp: int,
    batch: int,
    context_len: int,
    *,
    num_speculative_tokens: int,
    acceptance: float,
    draft_cost: float = 0.0,
    measured_verify_cost: float | None = None,
) -> SpeculativePlan:
    if num_speculative_tokens <= 0:
        raise ValueError(f"--speculative must be positive, got {num_speculative_tokens}")
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"--acceptance is a probability in [0, 1], got {acceptance}")
    if draft_cost < 0:
        raise ValueError(f"--draft-cost must be 0 or more, got {draft_cost}")
    if measured_verify_cost is not None and measured_verify_cost <= 0:
        raise ValueError(f"--verify-cost must be positive, got {measured_verify_cost}")
    k = num_speculative_tokens
    tau = tokens_per_verify_step(k, acceptance)
    verify, cost = verify_step(deployment, ceilings, tp, batch, context_len, k)
    if measured_verify_cost is not None:
        cost = measured_verify_cost

    # The verify cost only grows with the batch (the step drifts from bandwidth- to compute-bound), so
    # once speculation stops paying it never pays again.
    def pays(b: int) -> bool:
        return speedup(tau, verify_step(deployment, ceilings, tp, b, context_len, k)[1], k, draft_cost) >= 1.0

    return SpeculativePlan(
        num_speculative_tokens=k,
        acceptance=acceptance,
        tokens_per_step=tau,
        verify=verify,
        verify_cost=cost,
        verify_cost_source="roofline" if measured_verify_cost is None else "measured",
        draft_cost=draft_cost,
        speedup=speedup(tau, cost, k, draft_cost),
        break_even_batch=smallest_batch(lambda b: not pays(b)),
    )


def verify_costs(
    deployment: Deployment,
    ceilings: RooflineCeilings,
    tp: int,
    context_len: int,
    k: int,
    max_batch: int,
    overhead_s: float = 0.0,
) -> list[float]:
    """verify_step's cost ratio for batches 1..max_batch (index b-1)."""
    return [
        verify_step(deployment, ceilings, tp, b, context_len, k, overhead_s)[1]
        for b in range(1, max_batch + 1)
    ]
