"""A stream that waits for the host: one program spins on a counter in pinned host memory until the host
has written a given value there, so the work queued behind it on the stream (a copy of data the host is
still writing, the kernels that read it) runs once that data is in, without the host waiting to queue
it. The engine queues a grammar step's masked sampling this way before its masks are filled."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _wait_kernel(counter, target):
    # A volatile load is a relaxed load at system scope: each one reads the host's memory afresh.
    value = tl.load(counter, volatile=True)
    while value < target:
        value = tl.load(counter, volatile=True)


def wait_for_host(counter: torch.Tensor, target: int) -> None:
    """Queue on the current stream a wait until counter[0] (int64, in pinned host memory, written only
    by the host and only upwards) is at least `target`."""
    assert counter.is_pinned() and counter.dtype == torch.int64
    _wait_kernel[(1,)](counter, target, num_warps=1)
