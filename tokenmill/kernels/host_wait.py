"""A stream that waits for the host: one program spins on a counter in pinned host memory until the host
has written a given value there, so the work queued behind it on the stream (a copy of data the host is
still writing, the kernels that read it) runs once that data is in, without the host waiting to queue
it. The engine queues a grammar step's masked sampling this way while its masks are being filled: the
wait and the masking in one kernel (apply_bitmask_from_host), each program reading its request's mask
straight from the pinned buffer the host fills.

While a wait is pending, some host calls block until it ends (measured on the H200: a device allocation
that reaches cudaMalloc, and the first launch of a kernel whose module is not loaded yet); the thread
that writes the counter must not need anything such a call holds (torch's ops let the GIL go). As a
safety net the wait gives up after two seconds and writes 1 to counter[1], which the caller reads
as a failure."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.bitmask import MASK_BLOCK, mask_row

# Nanoseconds (the device's global timer) before the wait gives up.
TIMEOUT_NS = 2_000_000_000


@triton.jit
def _now(like):
    # %globaltimer: nanoseconds; the operand only gives the result its shape
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _wait(counter, target, timeout_ns):
    """Spin until counter[0] >= target or timeout_ns have passed; whether it was reached. A volatile load
    is a relaxed load at system scope: each one reads the host's memory afresh."""
    value = tl.load(counter, volatile=True)
    zero = tl.full([], 0, tl.int32)
    start = _now(zero)
    waited = start - start
    while (value < target) & (waited < timeout_ns):
        value = tl.load(counter, volatile=True)
        waited = _now(zero) - start
    if value < target:
        tl.store(counter + 1, 1)
    return value >= target


# Not specialised on its values (Triton compiles a variant for 1 and for multiples of 16 otherwise).
@triton.jit(do_not_specialize=["target", "timeout_ns"])
def _wait_kernel(counter, target, timeout_ns):
    _wait(counter, target, timeout_ns)


@triton.jit(do_not_specialize=["target", "timeout_ns"])
def _wait_then_mask_kernel(
    logits, stride_logits, rows, mask, stride_mask, vocab, words, counter, target, timeout_ns, staging,
    STAGED: tl.constexpr, WORDS_PAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program r: the wait, then -inf at logits row rows[r] wherever mask row r (int32 words in pinned
    host memory: bit j of word i for token 32 i + j; tokens past its last word are forbidden) has a 0 bit.
    The words are read over the bus with volatile loads (not from a cache line an earlier step's read of
    the same buffer left), after a system-scope fence (not before the counter said they are in)."""
    if _wait(counter, target, timeout_ns):
        tl.inline_asm_elementwise(
            "fence.acq_rel.sys; mov.u32 $0, 0;", "=r,r", [tl.full([], 0, tl.int32)], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        row = tl.load(rows + r).to(tl.int64)
        if STAGED:
            # The row's words over the bus in one round trip (every load in flight at once) into device
            # memory, read there block by block: read over the bus block by block, each block's loads
            # wait for it in turn.
            word = tl.arange(0, WORDS_PAD)
            bits = tl.load(mask + r * stride_mask + word, mask=word < words, volatile=True)
            staged_row = staging + r * stride_mask
            tl.store(staged_row + word, bits, mask=word < words)
            tl.debug_barrier()
            mask_row(logits + row * stride_logits, staged_row, vocab, words, BLOCK, False, True)
        else:
            mask_row(logits + row * stride_logits, mask + r * stride_mask, vocab, words, BLOCK, True)


def wait_for_host(counter: torch.Tensor, target: int) -> None:
    """Queue on the current stream a wait until counter[0] (int64 [2], in pinned host memory, written
    only by the host and only upwards) is at least `target`; counter[1] becomes 1 if it gives up."""
    _wait_kernel[(1,)](counter, target, TIMEOUT_NS, num_warps=1)


def apply_bitmask_from_host(
    logits: torch.Tensor,
    rows: torch.Tensor,
    bitmask: torch.Tensor,
    counter: torch.Tensor,
    target: int,
    staging: torch.Tensor | None = None,
) -> None:
    """Queue on the current stream, in one launch: the wait of wait_for_host(counter, target), then
    kernels/bitmask.py's masking of logits [R, V] at rows [N] (int64, on the device) from bitmask [N, W]
    (int32, in pinned host memory), read where the host wrote it (no copy to queue). staging (int32 on
    the device, at least [N, W] with bitmask's row stride; under STAGED_MASKS): each row comes over in
    one round trip into it first. If the wait gives up, the logits are left unmasked (and counter[1]
    says so)."""
    if rows.numel() == 0:
        return
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1 and bitmask.dtype == torch.int32
    staged = STAGED_MASKS and staging is not None
    if staged:
        assert staging.dtype == torch.int32 and staging.stride(0) == bitmask.stride(0)
        assert staging.shape[0] >= bitmask.shape[0]
    _wait_then_mask_kernel[(rows.numel(),)](
        logits, logits.stride(0), rows, bitmask, bitmask.stride(0), logits.shape[1], bitmask.shape[1],
        counter, target, TIMEOUT_NS, staging if staged else bitmask, STAGED=staged,
        WORDS_PAD=triton.next_power_of_2(bitmask.shape[1]) if staged else 1, BLOCK=MASK_BLOCK, num_warps=4,
    )  # fmt: skip


# Whether the masking kernel copies each mask row into device memory in one round trip before masking
# (apply_bitmask_from_host's staging), rather than reading it over the bus a block of words at a time.
STAGED_MASKS = True
