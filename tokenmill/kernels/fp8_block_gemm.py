"""Triton block-scaled FP8 GEMM (fine-grained FP8 checkpoints: DeepSeek-V3, Qwen3-FP8): y = x W^T with
x in e4m3 with one scale per token and per block of K columns, W in e4m3 with one scale per block of
(block_n rows x block_k columns). Each program walks K one scale block at a time (BLOCK_K = block_k),
multiplies the e4m3 tiles on FP8 tensor cores (fp32 accumulation), and applies the two scales to the
partial sum. Its reference is kernels/quant_reference.py's fp8_block_gemm, of the same
signature."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_block_kernel(
    a,
    a_scale,
    w,
    w_scale,
    out,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    FP8_DOT: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        at = tl.load(a + rm[:, None] * stride_am + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if FP8_DOT:
            part = tl.dot(at, tl.trans(wt))
        else:  # e4m3 is exact in fp32: the interpreter and pre-Hopper paths multiply there
            part = tl.dot(at.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
        sa = tl.load(a_scale + rm * stride_asm + kb, mask=m_ok, other=0.0)
        sw = tl.load(w_scale + (rn // SCALE_ROWS) * stride_wsn + kb, mask=n_ok, other=0.0)
        acc += part * sa[:, None] * sw[None, :]
    o_mask = m_ok[:, None] & n_ok[None, :]
    tl.store(out + rm[:, None] * stride_om + rn[None, :], acc.to(out.dtype.element_ty), mask=o_mask)


@functools.lru_cache(maxsize=8)
def has_fp8_mma(device: torch.device) -> bool:
    """FP8 tensor cores: compute capability 8.9 (Ada) and up."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_block_gemm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a_q e4m3 [M, K] with a_scale fp32 [M, ceil(K/block_k)]; w_q e4m3 [N, K] with w_scale fp32
    [ceil(N/block_n), ceil(K/block_k)]. Returns [M, N] in out_dtype."""
    m, k = a_q.shape
    n = w_q.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    if m == 0:
        return out
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"the weight's column block ({block_k}) must be a power of two of 16 or more")
    # Tiles of 64 rows; each row finds its own scale block, so tiles need not align with them.
    tile_m, tile_n = (16 if m <= 16 else 64), 64
    fp8_dot = a_q.is_cuda and has_fp8_mma(a_q.device)
    grid = (triton.cdiv(m, tile_m), triton.cdiv(n, tile_n))
    _fp8_block_kernel[grid](
        a_q, a_scale.contiguous(), w_q, w_scale.contiguous(), out, m, n, k,
        a_q.stride(0), a_scale.stride(0), w_q.stride(0), w_scale.stride(0), out.stride(0),
        BLOCK_M=tile_m, BLOCK_N=tile_n, BLOCK_K=block_k, SCALE_ROWS=block_n,
        FP8_DOT=fp8_dot, num_warps=4,
    )  # fmt: skip
    return out
