"""Triton W4A16 GEMM: y = x W^T with W stored as 4-bit integers in groups, in the layout of
compressed-tensors' pack-quantized format (layers/quantization/int4.py): `weight_packed` int32
[N, ceil(K/8)], eight values per word along K, each stored as q + 8; `weight_scale` [N, ceil(K/group)];
optional zero points, unpacked int8 [N, ceil(K/group)]. Its reference is
kernels/quant_reference.py's w4a16_gemm, of the same signature.

The weight is dequantized in registers, tile by tile, and never written out: decode reads a quarter of
the bf16 bytes. Small batches (decode) split K across programs so that a matrix with few output tiles
still fills the GPU; the partial sums meet in an fp32 buffer through atomic adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import gemv, k_splits

PACK = 8


@triton.jit
def _w4a16_kernel(
    x,
    w_packed,
    scale,
    zero,
    out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_om,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    words = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_hi
        xt = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # One load per word, eight 4-bit values out of each: [BLOCK_N, BLOCK_K / 8] -> [BLOCK_N, BLOCK_K].
        wk = k0 // 8 + words
        packed = tl.load(
            w_packed + rn[:, None] * stride_wn + wk[None, :],
            mask=n_ok[:, None] & (wk * 8 < k_hi)[None, :],
            other=0,
        )
        q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
        q = tl.reshape(q, (BLOCK_N, BLOCK_K)).to(tl.float32) - 8.0
        group = rk // GROUP
        s = tl.load(
            scale + rn[:, None] * stride_sn + group[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
        )
        if HAS_ZERO:
            z = tl.load(
                zero + rn[:, None] * stride_zn + group[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0
            )
            q = q - z.to(tl.float32)
        w = (q * s.to(tl.float32)).to(xt.dtype)
        acc += tl.dot(xt, tl.trans(w), input_precision=PRECISION)
    gemv.store(out, acc, rm, rn, m_ok, n_ok, stride_om, SPLIT_K)


def _config(m: int, n: int, k: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K): decode-sized batches split K until the grid covers the GPU."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    block_k = 64 if k >= 64 else 32
    split_k = 1
    if m <= 16 and device.type == "cuda":
        split_k = k_splits(triton.cdiv(n, block_n), k, block_k, device, limit=16)
    return block_m, block_n, block_k, split_k


def w4a16_gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype; group_size is the scale's span along K."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = w_packed.shape[0]
    block_m, block_n, block_k, default_split = _config(m, n, k, x.device)
    split = split_k or default_split
    if split > 1:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
        _w4a16_kernel[grid](
            x2, w_packed, scale, zero if zero is not None else scale, out, m, n, k,
            x2.stride(0), w_packed.stride(0), scale.stride(0), zero.stride(0) if zero is not None else 0,
            out.stride(0), GROUP=group_size, HAS_ZERO=zero is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
        )  # fmt: skip
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], n)
