"""After start-up warm-up, a Triton kernel variant met for the first time is logged by name: the server
log then says which specialization a request paid a compile for."""

from __future__ import annotations

import logging
import random

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles only on a GPU")
def test_a_variant_met_after_warm_up_is_logged_with_its_name(caplog):
    import triton
    import triton.language as tl
    from triton import knobs

    from tokenmill.serving.warmup import report_late_compiles

    # A variant this process has not met: a random constexpr is part of its specialization.
    constant = random.randrange(1 << 20)

    @triton.jit
    def add_constant(x, n, BLOCK: tl.constexpr, CONSTANT: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(x + offsets, tl.load(x + offsets, mask=offsets < n) + CONSTANT, mask=offsets < n)

    hooks = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        report_late_compiles()
        x = torch.zeros(40, device="cuda")
        with caplog.at_level(logging.WARNING, logger="tokenmill"):
            add_constant[(1,)](x, 40, BLOCK=64, CONSTANT=constant)
            add_constant[(1,)](x, 40, BLOCK=64, CONSTANT=constant)  # met before: silent
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = hooks
    lines = [r.getMessage() for r in caplog.records if "after warm-up" in r.getMessage()]
    assert len(lines) == 1 and "add_constant" in lines[0], lines
    assert float(x[0]) == 2 * constant
