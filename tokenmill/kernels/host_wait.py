"""A stream that waits for the host: one program spins on a counter in pinned host memory until the host
has written a given value there, so the work queued behind it on the stream (a copy of data the host is
still writing, the kernels that read it) runs once that data is in, without the host waiting to queue
it. The engine queues a grammar step's masked sampling this way while its masks are being filled.

While a wait is pending, some host calls block until it ends (measured on the H200: a device allocation
that reaches cudaMalloc, and the first launch of a kernel whose module is not loaded yet); the thread
that writes the counter must not need anything such a call holds (torch's ops let the GIL go). As a
safety net the wait gives up after two seconds and writes 1 to counter[1], which the caller reads
as a failure."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Nanoseconds (the device's global timer) before the wait gives up.
TIMEOUT_NS = 2_000_000_000


@triton.jit
def _now(like):
    # %globaltimer: nanoseconds; the operand only gives the result its shape
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64, is_pure=False, pack=1
    )


# Not specialised on its values (Triton compiles a variant for 1 and for multiples of 16 otherwise).
@triton.jit(do_not_specialize=["target", "timeout_ns"])
def _wait_kernel(counter, target, timeout_ns):
    # A volatile load is a relaxed load at system scope: each one reads the host's memory afresh.
    value = tl.load(counter, volatile=True)
    zero = tl.full([], 0, tl.int32)
    start = _now(zero)
    waited = start - start
    while (value < target) & (waited < timeout_ns):
        value = tl.load(counter, volatile=True)
        waited = _now(zero) - start
    if value < target:
        tl.store(counter + 1, 1)


def wait_for_host(counter: torch.Tensor, target: int) -> None:
    """Queue on the current stream a wait until counter[0] (int64 [2], in pinned host memory, written
    only by the host and only upwards) is at least `target`; counter[1] becomes 1 if it gives up."""
    _wait_kernel[(1,)](counter, target, TIMEOUT_NS, num_warps=1)
