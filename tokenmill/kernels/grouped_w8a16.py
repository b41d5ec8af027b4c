"""GPTQ's 8-bit groups (and INT8 weight-only, per channel: one group of K columns) for up to
GROUPED_MAX_ROWS rows of activations: kernels/skinny_dot.py's w8a16_group_dequant_kernel, each int8
tile less its group's zero point times its scale in registers before one accumulating tl.dot, with
the tiles grouped_config picks by rows and shape. Past those rows the layers dequantize the weight
(kernels/dequant8.py) for cuBLAS. The reference is kernels/quant_reference.py's dequantize_8bit_groups
before a matmul."""

from __future__ import annotations

import math

import torch
import triton

from tokenmill.kernels import SKINNY_MAX_ROWS as MAX_ROWS
from tokenmill.kernels import k_splits, pdl, skinny_dot, sm_count
from tokenmill.kernels.skinny_gemm import SkinnyConfig, as_rows, dot_precision, launch_over_rows


def grouped_config(
    m: int, n: int, k: int, group_size: int, block_m: int, device: torch.device
) -> SkinnyConfig:
    """w8a16_grouped's tiles for m rows of a [n, k] weight. Up to 32 rows: 32 columns a program, three
    stages, K split to fill the SMs (an H100 sweep of 2026-12-06, Llama-3.1-8B's linears: gate+up 64.0 ->
    54.6 us at one row against 64 columns and two stages). Past 32 rows, the sweep of bench_quant_gemm.py
    --grouped-sweep at 64 and 128 rows on an H100 (2026-12-06; us against the first rule's): a wide
    weight (gate+up) as the dot's first operand over 128 columns, or 64 and a block of 128 rows (97 ->
    87, 180 -> 108); a long K (down) that, over 64 columns in four splits, or 32 in two and a block of
    128 rows (85 -> 58, 150 -> 77); a narrow weight (O) below. The rest (QKV) by the first rule."""
    block_k = math.gcd(group_size, 128)
    if m > 32 and block_k == 128:
        if n >= 16384:
            if m <= 64:
                return SkinnyConfig(128, 128, 1, num_warps=4, num_stages=3, swap_ab=True)
            return SkinnyConfig(64, 128, 1, num_warps=4, num_stages=3, block_m=128, swap_ab=True)
        if k >= 8192:
            if m <= 64:
                return SkinnyConfig(64, 128, 4, num_warps=4, num_stages=3, swap_ab=True)
            return SkinnyConfig(32, 128, 2, num_warps=4, num_stages=3, block_m=128)
        if triton.cdiv(n, 32) <= sm_count(device):
            # Where a block of rows' programs are one wave (O's 128): no K split, four stages, blocks of 128
            # rows past 64 (31 -> 22 us at 64 rows, 47 -> 26 at 128). Not QKV's 192 programs: 50 us in
            # blocks of 128 and 58 at four stages in blocks of 64 against the first rule's 41 at 128 rows
            # (three stages leave room for three programs an SM, all 384 in one wave), 31 against 30 at 64.
            return SkinnyConfig(32, 128, 1, num_warps=4, num_stages=4, block_m=128 if m > 64 else 0)
    tiles = triton.cdiv(n, 32) * triton.cdiv(max(m, 1), block_m)
    return SkinnyConfig(32, block_k, k_splits(tiles, k, block_k, device, limit=16), num_warps=4, num_stages=3)


def w8a16_grouped(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype, W = (w_q - zero) * scale by row and group: w_q int8
    [N, K], scale [N, groups], zero int8 [N, groups] or None; group_size a multiple of 16 (tl.dot's
    least K), the K tile a power of two dividing it. Rows go 16, 32 or 64 to a program (config.block_m
    where it names one; a third grid dimension past them), so that every weight tile is read once for
    each block of rows. The layers send it up to GROUPED_MAX_ROWS rows."""
    x2 = as_rows(x)
    m = x2.shape[0]
    n, k = w_q.shape
    block_m = MAX_ROWS if m <= MAX_ROWS else 32 if m <= 32 else 64
    if group_size % 16:
        raise ValueError(f"w8a16_grouped takes groups of a multiple of 16 columns, got {group_size}")
    if config is None:
        config = grouped_config(m, n, k, group_size, block_m, x.device)
    if group_size % config.block_k:
        raise ValueError(f"w8a16_grouped: block_k {config.block_k} does not divide the group {group_size}")
    block_m = config.block_m or block_m
    zero_arg = zero if zero is not None else scale

    def launch(out: torch.Tensor, grid: tuple[int, int]) -> None:
        skinny_dot.w8a16_group_dequant_kernel[(*grid, triton.cdiv(m, block_m))](
            x2, w_q, scale, zero_arg, out, m, n, k, x2.stride(0), w_q.stride(0), scale.stride(0),
            zero.stride(0) if zero is not None else 0, out.stride(0),
            GROUP=group_size, HAS_ZERO=zero is not None, ONE_GROUP=group_size >= k, BLOCK_M=block_m,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k, SWAP_AB=config.swap_ab,
            PRECISION=dot_precision(x), num_warps=config.num_warps, num_stages=config.num_stages,
            **pdl.launch_args(x2),
        )  # fmt: skip

    return launch_over_rows(x, m, n, config, launch, bias)
