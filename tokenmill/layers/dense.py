"""The unquantized linear product: cuBLAS, or at one 16-bit row on a GPU the one-row Triton GEMV
(kernels/skinny_gemm.py), which reads a wide weight at the card's copy bandwidth where cuBLAS does not."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tokenmill.kernels import skinny_kernel, sm_count, triton_kernel

# TOKENMILL_DENSE_GEMV=0 keeps every unquantized linear on cuBLAS.
DENSE_GEMV = os.environ.get("TOKENMILL_DENSE_GEMV", "1") != "0"


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; at one 16-bit row on a GPU (or up to skinny_gemm.DENSE_ROWS rows), against a weight
    with at least 16 output rows per multiprocessor (no K split needed to fill the GPU),
    kernels/skinny_gemm.py's dense_gemv."""
    if dense_gemv_takes(x, weight):
        return triton_kernel("skinny_gemm", "dense_gemv")(x, weight, bias)
    return F.linear(x, weight, bias)


def dense_gemv_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether dense_linear sends x to kernels/skinny_gemm.py's dense_gemv."""
    if not DENSE_GEMV or x.dtype == torch.float32 or not x.numel():
        return False
    takes = skinny_kernel(x, "dense_gemv_takes")
    wide = weight.shape[0] >= 16 * sm_count(x.device) and weight.stride(1) == 1
    return takes is not None and takes(x.numel() // x.shape[-1]) and wide
