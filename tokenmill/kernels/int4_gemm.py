"""Triton W4A16 GEMM: y = x W^T with W stored as 4-bit integers in groups, in the layout of
compressed-tensors' pack-quantized format (layers/quantization/int4.py): `weight_packed` int32
[N, ceil(K/8)], eight values per word along K, each stored as q + 8; `weight_scale` [N, ceil(K/group)];
optional zero points, unpacked int8 [N, ceil(K/group)]. Its reference is
kernels/quant_reference.py's w4a16_gemm, of the same signature.

The weight is dequantized in registers, tile by tile, and never written out: decode reads a quarter of
the bf16 bytes. Small batches (decode) split K across programs so that a matrix with few output tiles
still fills the GPU; the partial sums meet in an fp32 buffer through atomic adds. The INT4 linears
call it only past the skinny kernel's 16 rows where nothing faster goes: groups that are not a
multiple of 128 values (kernels/w4a16_mma.py's unit) below DEQUANT_ROWS rows, and fp32 activations.

At DEQUANT_ROWS rows and more (prefill, large decode batches) `w4a16_dequant_gemm` writes the whole
weight out in x's dtype (`dequantize`: half a byte read and two written per value) and hands it to
cuBLAS: the GEMM's arithmetic then outweighs that pass, and cuBLAS's tiles beat any of these kernels
there (docs/performance.md, `bench_quant_gemm.py --int4-rows`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import dequant8, gemv, k_splits, skinny_gemm, w4a16_gemv_cuda, w4a16_mma
from tokenmill.kernels.interpreter import INTERPRETED

PACK = 8
MMA_ROWS = w4a16_mma.MAX_ROWS  # activation rows up to which w4a16_mma runs (from 2)
DEQUANT_ROWS = MMA_ROWS + 1  # from here on the weight is dequantized whole for cuBLAS (16-bit activations)


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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_hi
        xt = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        q = load_int4_tile(w_packed + rn[:, None] * stride_wn, k0, k_hi, n_ok, BLOCK_N, BLOCK_K).to(
            tl.float32
        )
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


@triton.jit
def load_int4_tile(w_rows, k0, k_hi, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The 4-bit values (q - 8, int32) [BLOCK_N, BLOCK_K] of columns k0.. of the packed rows `w_rows`
    (pointers [BLOCK_N, 1]), one load per word and eight values out of each; words from k_hi on read 0."""
    wk = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    packed = tl.load(w_rows + wk[None, :], mask=n_ok[:, None] & (wk * 8 < k_hi)[None, :], other=0)
    q = (packed[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
    return tl.reshape(q, (BLOCK_N, BLOCK_K)) - 8


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


@triton.jit
def _dequantize_kernel(
    w_packed,
    scale,
    zero,
    out,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_on,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    ASM: tl.constexpr,
    BF16: tl.constexpr,
):
    """BLOCK_N rows x 8 WORDS values of the weight: w4a16_mma's two-instruction nibble pairs, put back in
    K's order, then (q - zero) * scale."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    n_ok = rn < N
    w_mask = n_ok[:, None] & (rw < tl.cdiv(K, 8))[None, :]
    packed = tl.load(w_packed + rn[:, None] * stride_wn + rw[None, :], mask=w_mask, other=0)
    planes = w4a16_mma.nibble_planes(packed, out.dtype.element_ty, ASM, BF16)
    q = w4a16_mma.natural_order(planes, BLOCK_N, WORDS).to(tl.float32)
    rk = tl.program_id(1) * WORDS * 8 + tl.arange(0, WORDS * 8)
    ok = n_ok[:, None] & (rk < K)[None, :]
    w = dequant8.scale_by_group(q, scale, zero, rn, n_ok, rk, ok, tl.program_id(1) * WORDS * 8, stride_sn,
                                stride_zn, GROUP, WORDS * 8, HAS_ZERO)  # fmt: skip
    tl.store(out + rn[:, None] * stride_on + rk[None, :], w.to(out.dtype.element_ty), mask=ok)


def dequantize(
    w_packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The [N, K] weight in `dtype` (quant_reference.dequantize_int4 in one Triton pass)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int4_gemm.dequantize writes bf16 or fp16, not {dtype}")
    n = w_packed.shape[0]
    out = torch.empty(n, in_features, dtype=dtype, device=w_packed.device)
    block_n, words = 32, 16
    grid = (triton.cdiv(n, block_n), triton.cdiv(triton.cdiv(in_features, PACK), words))
    if n and in_features:
        _dequantize_kernel[grid](
            w_packed, scale, zero if zero is not None else scale, out, n, in_features, w_packed.stride(0),
            scale.stride(0), zero.stride(0) if zero is not None else 0, out.stride(0),
            GROUP=group_size, HAS_ZERO=zero is not None, BLOCK_N=block_n, WORDS=words,
            ASM=not INTERPRETED, BF16=dtype == torch.bfloat16, num_warps=4,
        )  # fmt: skip
    return out


def w4a16_dequant_gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) through the whole weight dequantized into x's dtype, then cuBLAS."""
    weight = dequantize(w_packed, scale, zero, group_size, x.shape[-1], x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


def w4a16_linear(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The INT4 linears' GEMM on a GPU, by activation rows: 2-8 rows of 16-bit activations where its shapes
    allow, the tensor-core GEMV in CUDA C (kernels/w4a16_gemv_cuda.py `takes`); else one row (and up to
    skinny_gemm.GEMV4_ROWS of 16-bit activations), the one-row kernels (skinny_gemm.w4a16_skinny); 2 to
    MMA_ROWS, the tensor-core kernel where the groups allow it (else the skinny kernel); from DEQUANT_ROWS
    on, the weight dequantized whole for cuBLAS; the tiled kernel for what is left (fp32 activations)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if w4a16_gemv_cuda.takes(x, w_packed, scale, zero, group_size):
        return w4a16_gemv_cuda.w4a16_gemv_mma(x, w_packed, scale, zero, group_size, bias)
    if rows >= DEQUANT_ROWS and x.dtype in (torch.bfloat16, torch.float16):
        return w4a16_dequant_gemm(x, w_packed, scale, zero, group_size, bias)
    packed = skinny_gemm.packed_kernel_takes(x.dtype, rows)
    if 2 <= rows <= MMA_ROWS and not packed and w4a16_mma.supports(x, group_size, x.shape[-1]):
        return w4a16_mma.w4a16_mma(x, w_packed, scale, zero, group_size, bias)
    if rows <= skinny_gemm.MAX_ROWS and group_size % PACK == 0:
        return skinny_gemm.w4a16_skinny(x, w_packed, scale, zero, group_size, bias)
    return w4a16_gemm(x, w_packed, scale, zero, group_size, bias)
