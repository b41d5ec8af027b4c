"""Kernel dispatch: the Triton kernels on CUDA when triton imports, the torch references elsewhere.
A model chooses its set once, when it is built, and its layers keep it: no lookup in a forward pass.

TOKENMILL_ATTENTION_BACKEND=torch|triton forces one set on every device (triton on a CPU needs
TRITON_INTERPRET=1); it is read when a model is built. The Triton modules are imported only when
chosen, so this package imports without triton.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from tokenmill.kernels import reference

BACKEND_ENV = "TOKENMILL_ATTENTION_BACKEND"
_BACKENDS = ("torch", "triton")


class Kernels(NamedTuple):
    """One backend's kernels; each has the signature of its namesake in tokenmill.kernels.reference."""

    backend: str
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_and_write_kv_cache: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    rms_norm_quant: Callable[..., tuple[QuantizedRows, torch.Tensor | None]]
    silu_and_mul_quant: Callable[..., QuantizedRows]
    fused_moe: Callable[..., torch.Tensor]
    topk_softmax: Callable[..., tuple[torch.Tensor, torch.Tensor]]


class StepRotary(NamedTuple):
    """What paged_attention needs to rotate a step's query and key itself and store its key and value
    (the attention layer's rotary and KV store folded into its launch): the tokens' positions [T], the
    rotary cos/sin cache [positions, head_dim] (cos, then sin), the step's unrotated key and its value
    [T, kv_heads, head_dim] and the tokens' cache slots [T] (-1: none)."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor


class GemvFusion(NamedTuple):
    """Work a decode-sized linear layer does in its one-row GEMV's stores instead of in a launch of its
    own (kernels/gemv.py's store_row; layers/fused_linear.py asks for it): silu_mul: the output is gate ||
    up (a merged gate/up projection) and silu(gate) * up is stored, half the columns, rounded where the
    separate launches round."""

    silu_mul: bool = False


class RowQuant(NamedTuple):
    """How a linear layer's method quantizes its input a row (token) at a time, for the launch that makes
    that input to do in its stores instead (LinearMethodBase.row_quant): to int8 (else e4m3), each row at
    its largest magnitude, or every row at static_scale (a checkpoint's calibrated per-tensor input
    scale), or (group, e4m3 only) each `group` columns of a row at their own largest magnitude (a power
    of two; the last group of a ragged row as if padded with zeros). quantize: the method's own function,
    (x [R, K], static_scale) -> (values, fp32 scales [R, 1] or [R, ceil(K / group)]), which runs after
    the launch where a kernel set has no fused one."""

    int8: bool
    static_scale: torch.Tensor | None
    quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    group: int | None = None


class QuantizedRows(NamedTuple):
    """Activations already quantized a row at a time as a RowQuant asked (by an RMSNorm's launch or the
    gated activation's), handed to the linear layer in their place: values [R, K] (e4m3 or int8), fp32
    scales [R, 1] (or a group's each, [R, ceil(K / group)]), and the shape and dtype of the activations
    they stand for."""

    values: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype


class ScaledRows(NamedTuple):
    """A W8A8 linear's product handed to the launch after it with its scales not yet applied: values
    [R, N] = x_q w_q^T (cuBLAS's unit-scale product in bf16, whose range fp16's would not hold; fp32 on
    the references), row_scale [R, 1] fp32
    (the activations' per-token scales), col_scale [N] fp32 (the weight's per-channel scales), and the
    dtype of the output they stand for. The launch that reads the product (an RMSNorm's residual add, the
    gated activation) multiplies each value by its row's and column's scale as it loads it, so cuBLAS's
    per-tensor FP8 GEMM (scales 1) serves where its row-wise one picks slow tiles; resolve() is the
    output itself, for everything else."""

    values: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor
    dtype: torch.dtype

    def resolve(self) -> torch.Tensor:
        """The scaled product in `dtype`, rounded once, as the linear would have returned it."""
        return (self.values.float() * self.row_scale * self.col_scale).to(self.dtype)


def resolved(x: torch.Tensor | ScaledRows) -> torch.Tensor:
    """x, or the output a ScaledRows stands for."""
    return x.resolve() if isinstance(x, ScaledRows) else x


def get_kernels(device: torch.device | str | None = None) -> Kernels:
    """The kernels for tensors on `device`, by default the device modules are being built on
    (torch.get_default_device(), set by `with torch.device(...)`)."""
    device = torch.get_default_device() if device is None else torch.device(device)
    return _kernels_for(device.type, os.environ.get(BACKEND_ENV, ""))


@functools.lru_cache(maxsize=16)
def triton_kernel(module: str, name: str) -> Callable | None:
    """tokenmill.kernels.<module>.<name> where triton imports, else None: for the quantized layers,
    whose CUDA path takes a Triton kernel and whose other paths take its reference."""
    if not _triton_available():
        return None
    import importlib

    return getattr(importlib.import_module(f"tokenmill.kernels.{module}"), name)


def env_int(name: str, default: int, allowed: tuple[int, ...] | None = None) -> int:
    """A kernel's integer knob from the environment (read at import): `default` when unset; a value that
    is not an integer, or not one of `allowed`, is a ValueError naming the variable."""
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: give an integer") from None
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name}={text!r}: give one of {', '.join(map(str, allowed))}")
    return value


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The CPU interpreter has no multiprocessors; a nominal count keeps the split paths exercised.
    return 8


def k_splits(tiles: int, k: int, block_k: int, device: torch.device, limit: int) -> int:
    """How many ways a GEMM with `tiles` output tiles splits K (a power of two up to limit): doubled
    until the grid has two programs per SM, while each split keeps at least two blocks of K."""
    split = 1
    while tiles * split < 2 * sm_count(device) and split < limit and k // (block_k * split * 2) >= 2:
        split *= 2
    return split


SKINNY_MAX_ROWS = 16  # activation rows up to which quantized linears take kernels/skinny_gemm.py
GROUPED_MAX_ROWS = 128  # and up to which int8 weight-only ones take its w8a16_grouped (then: dequantized)
FP8_GEMM_MAX_ROWS = 64  # and up to which FP8 W8A8 linears take kernels/fp8_gemm.py, not cuBLAS


def skinny_kernel(x: torch.Tensor, name: str) -> Callable | None:
    """kernels/skinny_gemm.py's `name` when x is a CUDA tensor of at most SKINNY_MAX_ROWS rows (decode's
    shape) and triton imports, else None."""
    if not x.is_cuda or x.numel() > SKINNY_MAX_ROWS * x.shape[-1]:
        return None
    return triton_kernel("skinny_gemm", name)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=8)
def _kernels_for(device_type: str, forced: str) -> Kernels:
    if forced and forced not in _BACKENDS:
        raise ValueError(
            f"{BACKEND_ENV}={forced!r} is not a backend; set it to 'torch' or 'triton', or unset it."
        )
    if forced == "triton" and not _triton_available():
        raise ValueError(
            f"{BACKEND_ENV}=triton but triton is not installed; pip install triton, or unset it."
        )
    backend = forced or ("triton" if device_type == "cuda" and _triton_available() else "torch")
    if backend == "torch":
        return Kernels(
            backend="torch",
            write_kv_cache=reference.write_kv_cache,
            paged_attention=reference.paged_attention,
            rms_norm=reference.rms_norm,
            fused_add_rms_norm=reference.fused_add_rms_norm,
            rotary_embedding=reference.rotary_embedding,
            rotary_and_write_kv_cache=reference.rotary_and_write_kv_cache,
            silu_and_mul=reference.silu_and_mul,
            rms_norm_quant=reference.rms_norm_quant,
            silu_and_mul_quant=reference.silu_and_mul_quant,
            fused_moe=reference.fused_moe,
            topk_softmax=reference.topk_softmax,
        )
    from tokenmill.kernels import activation, attention, fused_moe, kv_cache, norm, rotary

    return Kernels(
        backend="triton",
        write_kv_cache=kv_cache.write_kv_cache,
        paged_attention=attention.paged_attention,
        rms_norm=norm.rms_norm,
        fused_add_rms_norm=norm.fused_add_rms_norm,
        rotary_embedding=rotary.rotary_embedding,
        rotary_and_write_kv_cache=rotary.rotary_and_write_kv_cache,
        silu_and_mul=activation.silu_and_mul,
        rms_norm_quant=norm.rms_norm_quant,
        silu_and_mul_quant=activation.silu_and_mul_quant,
        fused_moe=fused_moe.fused_moe,
        topk_softmax=fused_moe.topk_softmax,
    )
