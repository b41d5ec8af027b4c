"""The speculative-decoding planner: tau, the verify step on the roofline, the speed-up and the batch
where speculation stops paying."""

from __future__ import annotations

import pytest

from tokenmill.plan.catalogue import MODELS
from tokenmill.plan.gpus import GPUS, ceilings_for
from tokenmill.plan.memory import Deployment
from tokenmill.plan.roofline import decode_point
from tokenmill.plan.speculative import plan_speculative, speedup, tokens_per_verify_step

H200 = GPUS["H200"]
DEPLOYMENT = Deployment(MODELS["llama-3.1-8b"], H200)
DATASHEET = ceilings_for(H200, "bf16", measured=False)


def test_tokens_per_verify_step() -> None:
    assert tokens_per_verify_step(4, 0.0) == 1.0  # nothing accepted: the verify step's own token
    assert tokens_per_verify_step(4, 1.0) == 5.0  # every draft and the bonus token
    assert tokens_per_verify_step(4, 0.7) == pytest.approx(1 + 0.7 + 0.49 + 0.343 + 0.2401)
    assert tokens_per_verify_step(1, 0.5) == pytest.approx(1.5)


def test_verify_reads_the_weights_once_and_multiplies_the_flops() -> None:
    decode = decode_point(DEPLOYMENT, DATASHEET, tp=1, batch=8, context_len=1000)
    verify = decode_point(DEPLOYMENT, DATASHEET, tp=1, batch=8, context_len=1000, tokens_per_seq=5)
    assert (verify.phase, verify.tokens) == ("verify", 40)
    assert verify.flops == pytest.approx(5 * decode.flops)
    # Four more token rows gathered from the input table per sequence: nothing else is read twice.
    assert verify.bytes_moved - decode.bytes_moved == 8 * 4 * DEPLOYMENT.shape.hidden_size * 2


def test_batch_1_pays_about_tau_and_large_batches_stop_paying() -> None:
    spec = plan_speculative(DEPLOYMENT, DATASHEET, 1, 1, 0, num_speculative_tokens=4, acceptance=0.7)
    assert spec.verify_cost == pytest.approx(1.0, abs=0.01)  # bandwidth-bound: 5 tokens cost about 1
    assert spec.speedup == pytest.approx(spec.tokens_per_step / spec.verify_cost)
    stop = spec.break_even_batch
    assert stop is not None and stop > 1

    def at(batch: int) -> float:
        return plan_speculative(
            DEPLOYMENT, DATASHEET, 1, batch, 0, num_speculative_tokens=4, acceptance=0.7
        ).speedup

    assert at(stop - 1) >= 1.0 > at(stop)
    assert at(4 * stop) == pytest.approx(spec.tokens_per_step / 5, rel=0.05)  # compute-bound: cost k + 1


def test_draft_cost_and_a_measured_verify_cost() -> None:
    assert speedup(2.77, 1.0, 4, 0.05) == pytest.approx(2.77 / 1.2)
    spec = plan_speculative(
        DEPLOYMENT, DATASHEET, 1, 1, 512, num_speculative_tokens=4, acceptance=0.7, draft_cost=0.05,
        measured_verify_cost=1.15,
    )  # fmt: skip
    assert spec.verify_cost_source == "measured"
    assert spec.speedup == pytest.approx(tokens_per_verify_step(4, 0.7) / (1.15 + 4 * 0.05))
    never = plan_speculative(
        DEPLOYMENT, DATASHEET, 1, 1, 0, num_speculative_tokens=4, acceptance=0.0, draft_cost=0.1
    )
    assert never.speedup < 1 and never.break_even_batch == 1
