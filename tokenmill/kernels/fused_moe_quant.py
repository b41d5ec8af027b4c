"""The fused MoE's grouped GEMM over experts kept quantized (kernels/quant_reference.py's QuantExperts):
FP8 (e4m3) weights with per-channel or [128, 128]-block scales, INT8 weights with per-channel scales
(the FP8 path: a byte a value, widened the same way), and INT4 W4A16 weights in groups, with or without
zero points. kernels/fused_moe.py's fused_moe calls it for such weights; its reference is
kernels/reference.py's fused_moe, which dequantizes first.

Each program loads its expert's weight tile quantized (a byte or half a byte a value), widens it in
registers to the activations' dtype and accumulates in fp32. Where one group spans K (FP8 per channel,
INT4 per row) the scale multiplies the accumulator after the K loop (e4m3 and the 4-bit integers are
exact in bf16 and fp16); else BLOCK_K divides the group and each tile is dequantized, (q - zero) * its
group's scale, rounded to the activations' dtype as the reference dequantizes (scaling each tile's
product instead needs a second accumulator: it spilled at the large tiles on sm_90).

INT4 tiles are unpacked as kernels/w4a16_mma.py unpacks them (two PTX instructions a pair of values,
straight into 16-bit floats, no integer conversion) and zero-pointed and scaled in that dtype: q - zero
is exact there and (q - zero) * scale is one rounding of an exact product, the reference's value. (They
had been unpacked to int32 with a shift and mask a value, widened to fp32, scaled and narrowed: 2-3x
slower than bf16 experts at every batch on the H200, docs/performance.md.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8_quant import TL_DTYPES
from tokenmill.kernels.fused_moe import block_pairs, store_pairs
from tokenmill.kernels.interpreter import INTERPRETED
from tokenmill.kernels.quant_reference import PACK, QuantExperts
from tokenmill.kernels.w4a16_mma import natural_order, nibble_planes


@triton.jit
def _quant_grouped_gemm(
    a,
    w,
    scale,
    zero,
    out,
    pairs,
    block_experts,
    num_padded,
    pair_weights,
    N,
    K,
    num_pairs,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    TOP_K: tl.constexpr,
    A_BY_TOKEN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    GROUP_K: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    A_DTYPE: tl.constexpr,
    W_DTYPE: tl.constexpr,
    SCALE_IN_W_DTYPE: tl.constexpr,
    ASM: tl.constexpr,
    BF16: tl.constexpr,
):
    """kernels/fused_moe.py's _grouped_gemm with w[expert] = (q - zero) * scale, q read quantized; the
    zero points share the scales' strides."""
    if tl.program_id(0) * BLOCK_M >= tl.load(num_padded):
        return
    expert, pair, valid, row, rn, n_ok = block_pairs(
        pairs, block_experts, N, num_pairs, TOP_K, A_BY_TOKEN, BLOCK_M, BLOCK_N
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_expert = w + expert * stride_we
    w_words = w_expert + rn[:, None] * stride_wn  # (INT4: the rows' packed words)
    s_rows = scale + expert * stride_se + rn * stride_sn
    z_rows = zero + expert * stride_se + rn * stride_sn
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        at = tl.load(
            a + row[:, None].to(tl.int64) * stride_am + rk[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        if INT4:  # q (and q - zero: at most 15 in magnitude) exact in the activations' dtype
            wk = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            packed = tl.load(w_words + wk[None, :], mask=n_ok[:, None] & (wk * 8 < K)[None, :], other=0)
            wt = natural_order(nibble_planes(packed, W_DTYPE, ASM, BF16), BLOCK_N, BLOCK_K // 8)
            if HAS_ZERO:
                wt = wt - tl.load(z_rows + k0 // GROUP_K, mask=n_ok, other=0).to(W_DTYPE)[:, None]
        else:
            wt = tl.load(
                w_expert + rn[:, None] * stride_wn + rk[None, :],
                mask=n_ok[:, None] & k_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            if HAS_ZERO:  # int8 groups with zero points (GPTQ 8-bit): q - zero exact in fp32
                wt = wt - tl.load(z_rows + k0 // GROUP_K, mask=n_ok, other=0).to(tl.float32)[:, None]
        if not ONE_GROUP:  # the tile's group scale onto the weight (not the product: no second accumulator)
            s = tl.load(s_rows + k0 // GROUP_K, mask=n_ok, other=0.0)
            if INT4 and SCALE_IN_W_DTYPE:  # one rounding of an exact product: the reference's value
                wt = wt * s.to(W_DTYPE)[:, None]
            else:
                wt = wt.to(tl.float32) * s.to(tl.float32)[:, None]
        acc = tl.dot(at, tl.trans(wt.to(A_DTYPE)), acc, input_precision=PRECISION)
    if ONE_GROUP:
        acc = acc * tl.load(s_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    store_pairs(acc, out, pair, valid, rn, n_ok, pair_weights, stride_om, WEIGHTED)


def tile_k(weight: QuantExperts, block_k: int) -> int:
    """The K tile for `weight`: at most block_k, and a divisor of its group unless one group spans K (a
    scale covers each whole tile). A group that is no multiple of 16 (tl.dot's least K) has no tile: a
    ValueError (layers/fused_moe.py keeps such experts dense)."""
    columns = weight.in_features
    tile = min(block_k, max(16, triton.next_power_of_2(columns)))
    if weight.group_size >= columns:
        return tile
    if weight.group_size % 16:
        raise ValueError(f"group size {weight.group_size} is not a multiple of 16, as the MoE kernel needs")
    while weight.group_size % tile:
        tile //= 2
    return tile


def quant_gemm(a, w: QuantExperts, out, layout, by_token: bool, weighted: bool, config) -> None:
    """kernels/fused_moe.py's _gemm for quantized experts."""
    pairs, block_experts, num_padded, weights, top_k, block_m = layout
    _, n, k = w.shape
    block_n, block_k, num_warps, num_stages = config
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = tile_k(w, block_k)
    assert w.data.shape[2] == (triton.cdiv(k, PACK) if w.int4 else k) and a.shape[1] == k
    # Zero points are read in the scales' dtype: int8 ones, loaded as a [BLOCK_N] vector a group, came out
    # wrong at the small-batch tiles on an H100 (Triton 3.6; 1.8-9.8 off at 1 and 7 tokens, groups of
    # 16, 2026-12-06) and right as int32 or bf16. layers/fused_moe.py holds them so; int8 is converted.
    zero = w.zero if w.zero is not None else w.scale  # (never read without zero points)
    if zero.dtype == torch.int8:
        zero = zero.to(w.scale.dtype)
    # INT4 tiles are unpacked and scaled in the activations' dtype with PTX on the GPU; in fp32 in the
    # interpreter (whose 16-bit floats do no arithmetic) and for fp32 activations: the same values. A
    # tile of two words a row (16 columns: groups of 16, 48, 80, ...) came out wrong from the PTX on an
    # H100 (1.3-1.5 off, 2026-12-06) and right in fp32: such tiles take the fp32 unpacking.
    asm = not INTERPRETED and a.dtype != torch.float32 and (not w.int4 or block_k >= 32)
    w_dtype = a.dtype if asm else torch.float32
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _quant_grouped_gemm[grid](
        a, w.data, w.scale, zero, out, pairs, block_experts, num_padded, weights, n, k, out.shape[0],
        a.stride(0), w.data.stride(0), w.data.stride(1), w.scale.stride(0), w.scale.stride(1), out.stride(0),
        TOP_K=top_k, A_BY_TOKEN=by_token, WEIGHTED=weighted, INT4=w.int4, HAS_ZERO=w.zero is not None,
        GROUP_K=w.group_size, ONE_GROUP=w.group_size >= k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", A_DTYPE=TL_DTYPES[a.dtype],
        W_DTYPE=TL_DTYPES[w_dtype], SCALE_IN_W_DTYPE=w_dtype in (w.scale.dtype, torch.float32), ASM=asm,
        BF16=a.dtype == torch.bfloat16, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
