"""The packed-fp16 4-bit GEMV (kernels/gemv_f16x2.py) on activations made into its pairs ahead, once for
all of its programs, instead of in each step of each program (where they move between threads through
shared memory: 12 barriers a step at gate+up's tile against 2 here). The pairs come from
pack_activations (a launch of its own: skinny_gemm.GEMV4_PACKED_X) or from the launch before, which
writes them beside its output (norm.rms_norm_packed, activation.silu_and_mul_packed; GemvFusion.packed_x,
layers/fused_linear.py's "packed"). Candidates, off until timed."""

from __future__ import annotations

import torch
import triton

from tokenmill.kernels import GemvFusion, PackedActivations, gemv_f16x2, pdl, skinny_gemm


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
    once for all of a GEMV's programs: w4a16_gemv_packed_x loads the pairs straight into its weight
    tiles' layout (a candidate: the kernel as it is moves them between threads through shared memory in
    every step)."""
    x2 = skinny_gemm.as_rows(x)
    m, k = x2.shape
    packed = empty_packed(m, k, x2.dtype, x.device)
    pairs, down, sums = packed.pairs, packed.down, packed.sums
    words = triton.cdiv(k, 8)
    if m:
        block_w = 128
        gemv_f16x2._pack_activations_kernel[(m, triton.cdiv(words, block_w))](
            x2, pairs, down, sums, k, x2.stride(0), pairs.stride(0), down.stride(0), BLOCK_W=block_w,
            ASM=not skinny_gemm._INTERPRETED, num_warps=4, **pdl.launch_args(x2),
        )  # fmt: skip
    return packed


def w4a16_gemv_packed_x(
    xp: PackedActivations,
    w_packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: skinny_gemm.SkinnyConfig | None = None,
    fusion: GemvFusion | None = None,
) -> torch.Tensor:
    """w4a16_skinny's packed-fp16 kernel on pre-made activations (pack_activations; up to GEMV4_ROWS
    rows): [rows, N] in the activations' dtype, `fusion`'s store parts (residual, silu_mul) done as
    there. Groups of a multiple of 32 values and tiles of a multiple of 4 words (one scale a 4 words, as
    the pairs were made)."""
    m, k = xp.pairs.shape[0], xp.k
    n = w_packed.shape[0]
    if not skinny_gemm.packed_kernel_takes(xp.dtype, m):
        raise ValueError(f"w4a16_gemv_packed_x takes {m} rows; skinny_gemm.GEMV4_ROWS allows fewer")
    config = config or skinny_gemm.default_config(1, n, k, 4, xp.pairs.device)
    block_w = config.block_k // 8
    if not skinny_gemm._packs(group_size, block_w):
        raise ValueError("w4a16_gemv_packed_x takes groups of a multiple of 32 values and block_k of 32")
    if fusion is not None and (fusion.norm_weight is not None or fusion.packed_x is not None):
        raise ValueError("w4a16_gemv_packed_x takes the fusion's store parts only (its x is packed already)")
    fused = skinny_gemm.fused_args(fusion, xp.pairs, n, config, bias)
    like = torch.empty(m, 0, dtype=xp.dtype, device=xp.pairs.device)
    zero_arg = zero if zero is not None else scale
    even = k % 8 == 0 and skinny_gemm._even(k // 8, block_w, config)

    def launch(out: torch.Tensor, grid: tuple[int, int]) -> None:
        gemv_f16x2.w4a16_gemv_f16x2_kernel[grid](
            xp.pairs, w_packed, scale, zero_arg, out, xp_down=xp.down,
            xp_sums=xp.sums, N=n, K=k, stride_xm=xp.pairs.stride(0), stride_wn=w_packed.stride(0),
            stride_sn=scale.stride(0), stride_zn=zero.stride(0) if zero is not None else 0,
            stride_om=out.stride(0), stride_dm=xp.down.stride(0), GROUP=group_size,
            HAS_ZERO=zero is not None, ROWS=m, BLOCK_N=config.block_n, BLOCK_W=block_w, SUB=4,
            SPLIT_K=config.split_k, EVEN_K=even, UNROLL=config.unroll, ASM=not skinny_gemm._INTERPRETED,
            PREFETCH=config.prefetch and even, EARLY=skinny_gemm.GEMV_EARLY and config.prefetch and even,
            XPACKED=True, **fused.args, num_warps=config.num_warps, num_stages=config.num_stages,
            **pdl.launch_args(xp.pairs, skinny_gemm.GEMV4_PDL),
        )  # fmt: skip

    return skinny_gemm.launch_over_rows(like, m, n, config, launch, bias, fused)
