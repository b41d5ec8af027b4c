"""bf16 linears on a CPU through oneDNN with weights reordered once, at load, into its blocked layout:
F.linear hands oneDNN a plain row-major weight and pays the reorder on every call. On this project's
2-core AMX VM the packed call ran 1.4-2.2x faster at decode and prefill shapes of SmolLM2 (16 x 576 x
3,072: 139 -> 73 us; the 49,152-wide LM head: 2.15 -> 1.38 ms) with bit-identical results. fp32 is left
to F.linear: there the packed call reorders the sums (not bit-identical) and is slower for one row."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.linear import LinearBase, UnquantizedLinearMethod


def _ops_available() -> bool:
    """oneDNN's packed linear, and bf16 support for it on this CPU (AVX512-BW or newer; an AVX2-only CPU
    keeps F.linear, which converts around the matmul instead of failing)."""
    mkldnn = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")):
        return False
    supported = getattr(mkldnn, "_is_mkldnn_bf16_supported", None)
    return hasattr(mkldnn, "_linear_pointwise") and supported is not None and bool(supported())


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with W as _reorder_linear_weight left it."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(x2, packed_weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


class CpuPackedLinearMethod(UnquantizedLinearMethod):
    """An unquantized linear whose `weight` holds oneDNN's layout (same shape, dtype and bytes)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return packed_linear(x, layer.weight, bias)


def pack_cpu_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Reorder the weights of every unquantized linear and of the LM head for oneDNN, on a CPU in bf16;
    returns how many were packed (0 elsewhere). Each packed weight replaces the plain one (an opaque
    oneDNN tensor that only this module's matmul reads); a tied LM head gets a packed copy of its own,
    since the embedding keeps gathering rows of the plain table."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not _ops_available():
        return 0
    from tokenmill.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    count = 0
    tables = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    }
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LinearBase) and type(module.quant_method) is UnquantizedLinearMethod:
                module.weight = _packed_parameter(module.weight)
                module.quant_method = CpuPackedLinearMethod()
                count += 1
            elif isinstance(module, ParallelLMHead):
                tied = id(module.weight) in tables
                if tied:
                    module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.data, None)
                else:
                    module.weight = _packed_parameter(module.weight)
                    module.packed_weight = module.weight
                count += 1
    return count


def _packed_parameter(weight: nn.Parameter) -> nn.Parameter:
    """The weight in oneDNN's opaque layout, replacing the plain one (same shape, dtype and bytes)."""
    return nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.data, None), requires_grad=False)
