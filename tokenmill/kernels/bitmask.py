"""Triton grammar masking: -inf at every token a request's grammar bitmask forbids, in place, in one
launch (the torch form in structured_outputs.apply_bitmask takes about eight, and a [rows, vocab] int32
temporary)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _apply_bitmask_kernel(logits, stride_logits, rows, mask, stride_mask, vocab, words, BLOCK: tl.constexpr):
    """Program (r, b): mask row r (int32 words, bit j of word i for token 32 i + j) onto logits row
    rows[r], tokens b * BLOCK onwards. Tokens past the mask's last word are forbidden, as llguidance's
    own masking does."""
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(rows + r).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    word = cols // 32
    bits = tl.load(mask + r * stride_mask + word, mask=in_vocab & (word < words), other=0)
    forbidden = ((bits >> (cols % 32)) & 1) == 0
    minus_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(logits.dtype.element_ty)
    tl.store(logits + row * stride_logits + cols, minus_inf, mask=in_vocab & forbidden)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [R, V] in place: at logits row rows[i], -inf wherever bitmask[i] ([W] int32) has a 0 bit.
    rows [N] int64 and bitmask [N, W] int32, on logits' device."""
    if rows.numel() == 0:
        return
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1 and bitmask.dtype == torch.int32
    grid = (rows.numel(), triton.cdiv(logits.shape[1], _BLOCK))
    _apply_bitmask_kernel[grid](
        logits, logits.stride(0), rows, bitmask, bitmask.stride(0), logits.shape[1], bitmask.shape[1],
        BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
