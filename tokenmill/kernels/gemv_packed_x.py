"""Activations made into the packed-fp16 4-bit GEMV's pairs ahead (kernels/gemv_f16x2.py, XPACKED), once
for all of its programs, instead of in each step of each program (where they move between threads through
shared memory: 12 barriers a step at gate+up's tile against 2 here). The pairs come from
pack_activations (a launch of its own: skinny_gemm.GEMV4_PACKED_X) or from the launch before, which
writes them beside its output (norm.rms_norm_packed, activation.silu_and_mul_packed; GemvFusion.packed_x,
layers/fused_linear.py's "packed"). Candidates, off until timed."""

from __future__ import annotations

import torch
import triton

from tokenmill.kernels import PackedActivations, gemv_f16x2, pdl


def takes(group_size: int, block_w: int) -> bool:
    """Whether the packed-fp16 kernel can load pre-made activations (one scale a 4 words, as they are
    made): groups of a multiple of 32 values, tiles of a multiple of 4 words."""
    return group_size % 32 == 0 and block_w % 4 == 0


def empty_packed(rows: int, k: int, dtype: torch.dtype, device: torch.device) -> PackedActivations:
    """Room for `rows` rows of k activations in dtype, packed."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"packed activations are made from 16-bit ones, not {dtype}")
    words = triton.cdiv(k, 8)
    chunks = triton.cdiv(words, 4)
    return PackedActivations(
        torch.empty(rows, 4 * words, dtype=torch.int32, device=device),
        torch.empty(rows, chunks, dtype=torch.float32, device=device),
        torch.empty(rows, chunks, dtype=torch.float32, device=device),
        k,
        dtype,
    )


def pack_activations(x: torch.Tensor) -> PackedActivations:
    """16-bit x [rows, K] as the packed-fp16 4-bit kernel makes it in each step (with 4 words a scale),
    once for all of a GEMV's programs: given to w4a16_skinny as GemvFusion.packed_x, its kernel loads the
    pairs straight into its weight tiles' layout."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = x2.shape
    packed = empty_packed(m, k, x2.dtype, x.device)
    pairs, down, sums = packed.pairs, packed.down, packed.sums
    words = triton.cdiv(k, 8)
    if m:
        block_w = 128
        gemv_f16x2._pack_activations_kernel[(m, triton.cdiv(words, block_w))](
            x2, pairs, down, sums, k, x2.stride(0), pairs.stride(0), down.stride(0), BLOCK_W=block_w,
            ASM=not gemv_f16x2.INTERPRETED, num_warps=4, **pdl.launch_args(x2),
        )  # fmt: skip
    return packed
