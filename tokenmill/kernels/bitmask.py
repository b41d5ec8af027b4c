"""Triton grammar masking: -inf at every token a request's grammar bitmask forbids, in place, in one
launch of a program per row (the torch form in structured_outputs.apply_bitmask takes several launches
and a [rows, vocab] temporary). mask_row is shared with the masking that waits for the host
(host_wait.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MASK_BLOCK = 4096  # tokens a program masks at a time, looping over its row


@triton.jit
def mask_row(
    row, mask_row_ptr, vocab, words, BLOCK: tl.constexpr, VOLATILE: tl.constexpr, L2: tl.constexpr = False
):  # fmt: skip
    """-inf at the logits row `row` (a pointer to its first token) wherever the mask row at mask_row_ptr
    (int32 words, bit j of word i for token 32 i + j) has a 0 bit, BLOCK tokens at a time. Tokens past
    the mask's last word are forbidden, as llguidance's own masking does. VOLATILE: read the words
    afresh from memory (host memory the host rewrites between steps). L2: read them from L2, not from
    this multiprocessor's L1 (words other threads of the program wrote just before)."""
    WORDS: tl.constexpr = BLOCK // 32
    for first in range(0, vocab, BLOCK):
        word = first // 32 + tl.arange(0, WORDS)
        if L2:
            bits = tl.load(mask_row_ptr + word, mask=word < words, other=0, cache_modifier=".cg")
        else:
            bits = tl.load(mask_row_ptr + word, mask=word < words, other=0, volatile=VOLATILE)
        allowed = (bits[:, None] >> tl.arange(0, 32)[None, :]) & 1
        cols = first + tl.arange(0, BLOCK)
        forbidden = tl.reshape(allowed, [BLOCK]) == 0
        minus_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(row.dtype.element_ty)
        tl.store(row + cols, minus_inf, mask=(cols < vocab) & forbidden)


@triton.jit
def _apply_bitmask_kernel(logits, stride_logits, rows, mask, stride_mask, vocab, words, BLOCK: tl.constexpr):
    """Program r: mask row r onto logits row rows[r]."""
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(rows + r).to(tl.int64)
    mask_row(logits + row * stride_logits, mask + r * stride_mask, vocab, words, BLOCK, False)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [R, V] in place: at logits row rows[i], -inf wherever bitmask[i] ([W] int32) has a 0 bit.
    rows [N] int64 and bitmask [N, W] int32, on logits' device."""
    if rows.numel() == 0:
        return
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1 and bitmask.dtype == torch.int32
    _apply_bitmask_kernel[(rows.numel(),)](
        logits, logits.stride(0), rows, bitmask, bitmask.stride(0), logits.shape[1], bitmask.shape[1],
        BLOCK=MASK_BLOCK, num_warps=4,
    )  # fmt: skip
