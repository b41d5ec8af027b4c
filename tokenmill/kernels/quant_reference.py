"""Plain-torch references for the quantized GEMMs and their packing: 4-bit weights (GPTQ/AWQ/INT4), FP8
weights, FP8 activations and block-scaled FP8 (kernels/reference.py's rules: the CPU path, and the
ground truth of the Triton kernels, each of the same signature as its kernel)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tokenmill.kernels.reference import FP8_DTYPE, FP8_MAX

# ---- 4-bit weights (layers/quantization/int4.py's layout) ------------------------------------------

PACK = 8  # 4-bit values per int32
_SHIFTS = torch.arange(PACK, dtype=torch.int32) * 4


def unpack_int4(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """int32 [R, ceil(C/8)] -> int8 [R, C] in [-8, 7]."""
    shifts = _SHIFTS.to(packed.device)
    values = (packed[..., None] >> shifts) & 0xF
    return (values.reshape(packed.shape[0], -1)[:, :columns] - 8).to(torch.int8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int8 [R, C] in [-8, 7] -> int32 [R, ceil(C/8)] (the inverse of unpack_int4)."""
    rows, columns = values.shape
    padded = torch.nn.functional.pad(values.to(torch.int64) + 8, (0, -columns % PACK))
    words = (padded.reshape(rows, -1, PACK) << _SHIFTS.to(values.device).long()).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def dequantize_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The [N, K] weight in `dtype`; zero (int8 [N, groups], unpacked) None when symmetric."""
    q = unpack_int4(packed, in_features).to(torch.float32)
    groups = torch.arange(in_features, device=packed.device) // group_size
    if zero is not None:
        q = q - zero.to(torch.float32)[:, groups]
    return (q * scale.to(torch.float32)[:, groups]).to(dtype)


def dequantize_8bit_groups(
    w_q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """8-bit values [N, K] (int8, or e4m3) in groups of group_size columns, each row's group with its scale
    [N, groups] and zero point ([N, groups] or None) -> (q - zero) * scale [N, K] in dtype, computed in
    fp32: GPTQ's 8-bit and INT8 linears, and the 8-bit MoE experts' reference."""
    if scale.shape[1] > 1:  # each column's group (one group broadcasts as it is)
        columns = torch.arange(w_q.shape[1], device=w_q.device) // group_size
        scale, zero = scale[:, columns], zero[:, columns] if zero is not None else None
    values = w_q.float()
    if zero is not None:
        values = values - zero.float()
    return (values * scale.float()).to(dtype)


def w4a16_gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with W dequantized whole into x's dtype; split_k is the Triton
    kernel's hint, unused here."""
    weight = dequantize_int4(w_packed, scale, zero, group_size, x.shape[-1], x.dtype)
    return F.linear(x, weight, bias)


def w8a16_gemm(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: object = None,
) -> torch.Tensor:
    """x [..., K] @ (w_q * w_scale)^T (+ bias) with the FP8 weight w_q [N, K] dequantized (one fp32 scale
    per row) into x's dtype: kernels/skinny_gemm.py's w8a16_skinny; config is its launch hint, unused."""
    weight = (w_q.to(torch.float32) * w_scale.reshape(-1, 1).float()).to(x.dtype)
    return F.linear(x, weight, bias)


# ---- FP8 activations ---------------------------------------------------------------------------------


def quantize_fp8_per_row(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 [R, C], fp32 scales [R, 1]) with x ~= q * scale, each row's amax at 448; or,
    given a per-tensor static_scale (one value: a checkpoint's input scale), every row at that scale."""
    if static_scale is not None:
        scale = static_scale.reshape(1, 1).float().expand(x.shape[0], 1).contiguous()
    else:
        scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


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
    [ceil(N/block_n), ceil(K/block_k)]: both dequantized, multiplied in fp32 on a CPU and in out_dtype
    on a GPU. Returns [M, N] in out_dtype."""
    m, k = a_q.shape
    n = w_q.shape[0]
    dtype = out_dtype if a_q.is_cuda else torch.float32
    a = a_q.to(dtype) * a_scale.to(dtype).repeat_interleave(block_k, dim=1)[:, :k]
    scale = w_scale.to(dtype).repeat_interleave(block_n, dim=0)[:n].repeat_interleave(block_k, dim=1)[:, :k]
    return F.linear(a, w_q.to(dtype) * scale).to(out_dtype)


# ---- Quantized MoE experts (kernels/fused_moe_quant.py's layout) ----------------------------------------


class QuantExperts(NamedTuple):
    """Stacked expert weights [E, N, K] kept quantized: `data` e4m3 [E, N, K] (FP8), int8 [E, N, K]
    (INT8, as FP8 but integers) or int32 [E, N, ceil(K/8)] (INT4, int4.py's packing along K); `scale`
    [E, N, ceil(K/group_size)], one per row and group of group_size input columns (FP8 and INT8 per
    channel: one group, group_size = K; FP8 blocks: each row holds its block's scale); `zero` int8 like
    scale (INT4 with zero points, in [-8, 7] as int4.py keeps them) or None.
    w[e, n, k] = (q - zero) * scale at [e, n, k // group_size]."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data.shape[0], self.data.shape[1], self.in_features)

    @property
    def int4(self) -> bool:
        return self.data.dtype == torch.int32

    def contiguous(self) -> QuantExperts:
        zero = self.zero.contiguous() if self.zero is not None else None
        return self._replace(data=self.data.contiguous(), scale=self.scale.contiguous(), zero=zero)

    def one(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s dense [N, K] weight in `dtype`."""
        zero = self.zero[expert : expert + 1] if self.zero is not None else None
        held = self._replace(
            data=self.data[expert : expert + 1], scale=self.scale[expert : expert + 1], zero=zero
        )
        return held.dequantize(dtype)[0]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense [E, N, K] weights in `dtype` (computed in fp32): the experts' rows as one matrix."""
        experts, rows, columns = self.shape
        flat = lambda t: t.reshape(experts * rows, t.shape[-1])  # noqa: E731
        zero = flat(self.zero) if self.zero is not None else None
        if self.int4:
            dense = dequantize_int4(flat(self.data), flat(self.scale), zero, self.group_size, columns, dtype)
        else:  # e4m3 or int8 under the same group rule (int8 ones may have zero points)
            dense = dequantize_8bit_groups(flat(self.data), flat(self.scale), zero, self.group_size, dtype)
        return dense.reshape(experts, rows, columns)


def quantize_experts_fp8(weight: torch.Tensor) -> QuantExperts:
    """Dense experts [E, N, K] -> e4m3 with one fp32 scale per row (each row's amax at 448): online
    `--quantization fp8` of a MoE model's experts."""
    experts, rows, columns = weight.shape
    q, scale = quantize_fp8_per_row(weight.reshape(experts * rows, columns))
    return QuantExperts(q.reshape(weight.shape), scale.reshape(experts, rows, 1), None, columns, columns)


def quantize_experts_int4(weight: torch.Tensor, group_size: int = 128) -> QuantExperts:
    """Dense experts [E, N, K] -> symmetric round-to-nearest 4-bit groups (scale = the group's largest
    magnitude / 7, in the weight's dtype; the last group may be shorter): online `--quantization int4`,
    as int4.py's quantize_linear_int4 does a linear's weight."""
    experts, rows, columns = weight.shape
    packed, scale = quantize_int4_symmetric(weight.reshape(experts * rows, columns), group_size)
    return QuantExperts(
        packed.reshape(experts, rows, -1), scale.reshape(experts, rows, -1), None, group_size, columns
    )


def quantize_int4_symmetric(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (packed int32 [R, ceil(C/8)], scales [R, groups] in the weight's dtype): symmetric
    round-to-nearest 4-bit groups of group_size columns, scale = the group's largest magnitude / 7 (the
    last group may be shorter). Online `--quantization int4`, of linears and of MoE experts alike."""
    rows, columns = weight.shape
    num_groups = -(-columns // group_size)
    padded = F.pad(weight.float(), (0, num_groups * group_size - columns))
    groups = padded.reshape(rows, num_groups, group_size)
    scale = (groups.abs().amax(dim=-1) / 7).clamp(min=1e-12)
    q = torch.round(groups / scale[..., None]).clamp(-8, 7).to(torch.int8).reshape(rows, -1)[:, :columns]
    return pack_int4(q), scale.to(weight.dtype)
