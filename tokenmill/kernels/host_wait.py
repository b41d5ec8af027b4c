"""A stream that waits for the host: one program spins on a counter in pinned host memory until the host
has written a given value there, so the work queued behind it on the stream (a copy of data the host is
still writing, the kernels that read it) runs once that data is in, without the host waiting to queue
it. The engine queues a grammar step's masked sampling this way while its masks are being filled.

While a wait is pending, the host must not block on the device in a call that keeps the GIL (measured
on the H200: a device allocation that reaches cudaMalloc blocks until the wait ends; torch lets the GIL
go there, `Tensor.is_pinned()` does not), or the thread that would write the counter never runs. As a
safety net the wait gives up after about two seconds and writes 1 to counter[1], which the caller reads
as a failure."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Polls before the wait gives up: each one a read across PCIe (~1 us), so a few seconds in all.
MAX_POLLS = 1 << 21


@triton.jit
def _wait_kernel(counter, target, max_polls):
    # A volatile load is a relaxed load at system scope: each one reads the host's memory afresh.
    value = tl.load(counter, volatile=True)
    polls = 0
    while (value < target) & (polls < max_polls):
        value = tl.load(counter, volatile=True)
        polls += 1
    if value < target:
        tl.store(counter + 1, 1)


def wait_for_host(counter: torch.Tensor, target: int) -> None:
    """Queue on the current stream a wait until counter[0] (int64 [2], in pinned host memory, written
    only by the host and only upwards) is at least `target`; counter[1] becomes 1 if it gives up."""
    _wait_kernel[(1,)](counter, target, MAX_POLLS, num_warps=1)
