"""A quantized checkpoint's MoE experts (Qwen3-MoE's `experts.E.gate_proj`, Mixtral's `experts.E.w1`, ...)
as they load. Each expert projection's stored tensors (GPTQ's qweight/qzeros/scales/g_idx,
compressed-tensors' weight and weight_scale, ...) are gathered into a one-off linear layer of the
checkpoint's scheme, which loads and checks them as any quantized linear does (and repacks GPTQ, AWQ and
compressed-tensors' 4-bit tensors into int4.py's one layout); then they go on to the model under the
projection's `.weight` name:

- kept quantized (a StoredExpert, layers/fused_moe.py's ExpertFormat) where the fused MoE kernel
  runs the scheme (`expert_format`): FP8 or INT8 per channel or per tensor (compressed-tensors, AutoFP8), FP8
  in blocks (fine-grained `weight_block_size`, compressed-tensors FP8_BLOCK), INT4 W4A16 groups of a
  multiple of 16 columns or one per row, with or without zero points (GPTQ without desc_act, AWQ,
  compressed-tensors pack-quantized without actorder), GPTQ 8-bit's int8 groups with zero points;
- else dequantized, its weight in fp32: the experts then run in the model dtype, holding 2-4x the
  checkpoint's bytes (said once, as a warning).

Experts and routers the ignore list names pass as they are; a router it left quantized is dequantized.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

from tokenmill.layers.fused_moe import ExpertFormat, StoredExpert
from tokenmill.layers.linear import ColumnParallelLinear, UnquantizedLinearMethod
from tokenmill.layers.quantization.fp8_block import Fp8BlockLinearMethod
from tokenmill.layers.quantization.gptq_awq import GptqAwqLinearMethod
from tokenmill.layers.quantization.int4 import Int4W4A16LinearMethod
from tokenmill.layers.quantization.per_row_scaled import (
    CompressedTensorsFp8LinearMethod,
    CompressedTensorsInt8LinearMethod,
)

logger = logging.getLogger(__name__)

# `<module>.experts.<E>.<projection>.<tensor>`: module names as the checkpoint writes them.
_EXPERT_TENSOR = re.compile(r"^(.*\.experts\.\d+\.([^.]+))\.([^.]+)$")
# Projections that map the hidden state to the experts' width (gate, up), and back (down).
_INTO_EXPERT = ("gate_proj", "up_proj", "w1", "w3")
_OUT_OF_EXPERT = ("down_proj", "w2")
# The router (Qwen3-MoE's mlp.gate, Mixtral's block_sparse_moe.gate), where an ignore list left it in.
_ROUTER_TENSOR = re.compile(r"^(.*\.(?:mlp|block_sparse_moe)\.gate)\.([^.]+)$")


class MoeShape(NamedTuple):
    hidden_size: int
    intermediate_size: int  # one expert's, before any tensor-parallel split
    num_experts: int


def _quantized_module(name: str, shape: MoeShape) -> tuple[str, str, int, int] | None:
    """(module, tensor, rows, columns) of an expert projection's or a router's checkpoint tensor."""
    match = _EXPERT_TENSOR.match(name)
    if match is not None and match.group(2) in _INTO_EXPERT:
        return match.group(1), match.group(3), shape.intermediate_size, shape.hidden_size
    if match is not None and match.group(2) in _OUT_OF_EXPERT:
        return match.group(1), match.group(3), shape.hidden_size, shape.intermediate_size
    match = _ROUTER_TENSOR.match(name)
    if match is not None:
        return match.group(1), match.group(2), shape.num_experts, shape.hidden_size
    return None


def _dense(part: str, tensor: torch.Tensor) -> bool:
    """A bias, or a `.weight` in a 16- or 32-bit float, is stored unquantized whatever the scheme (an
    expert the checkpoint left out of quantization without listing it: GPTQModel's dynamic skips)."""
    dense = tensor.dtype in (torch.float16, torch.bfloat16, torch.float32)
    return part == "bias" or (part == "weight" and dense)


def expert_format(scheme) -> ExpertFormat | None:
    """The layout the checkpoint's experts are kept in, or None where the MoE kernel does not run its
    scheme (they are dequantized): input columns in an order of their own, or groups that are not a
    multiple of 16 columns (tl.dot's least K tile)."""
    method = scheme.linear_method()
    if isinstance(method, CompressedTensorsInt8LinearMethod):  # int8, a scale per row: FP8's layout
        return ExpertFormat(int4=False, group_size=0, int8=True)
    if isinstance(method, CompressedTensorsFp8LinearMethod):
        return ExpertFormat(int4=False, group_size=0)
    if isinstance(method, Fp8BlockLinearMethod):
        fmt = ExpertFormat(int4=False, group_size=method.block_k)
    elif isinstance(method, Int4W4A16LinearMethod) and method.group_order is None:
        fmt = ExpertFormat(int4=True, group_size=max(method.group_size, 0), zero_points=not method.symmetric)
    elif isinstance(method, GptqAwqLinearMethod) and not scheme.desc_act:  # 4 or 8 bits, zero points
        group = max(method.group_size, 0)
        fmt = ExpertFormat(int4=method.bits == 4, group_size=group, zero_points=True, int8=method.bits == 8)
    else:
        return None
    return None if fmt.group_size % 16 else fmt


def _stored(holder: ColumnParallelLinear, module: str) -> StoredExpert:
    """A loaded one-off layer's tensors in ExpertFormat's layout."""
    method = holder.quant_method
    if getattr(holder, "input_order", None) is not None:
        raise ValueError(
            f"{module}: its g_idx orders the input columns by group (desc_act), which the MoE kernel does "
            "not take, but quantization_config.desc_act is false"
        )
    if isinstance(method, CompressedTensorsFp8LinearMethod):
        return StoredExpert(holder.weight.data, holder.weight_scale.data, None)
    if isinstance(method, Fp8BlockLinearMethod):
        scale = getattr(holder, method.scale_name).data
        rows = scale.repeat_interleave(holder.fp8_block_n, dim=0)[: holder.weight.shape[0]]
        return StoredExpert(holder.weight.data, rows.contiguous(), None)
    if isinstance(method, GptqAwqLinearMethod):
        return StoredExpert(holder.qweight.data, holder.scales.data, holder.qzeros.data)
    zero = getattr(holder, "weight_zero_point", None)
    return StoredExpert(
        holder.weight_packed.data, holder.weight_scale.data, None if zero is None else zero.data
    )


def experts_as_loaded(
    weights: Iterable[tuple[str, torch.Tensor]], scheme, shape: MoeShape, fmt: ExpertFormat | None
) -> Iterator[tuple[str, torch.Tensor | StoredExpert]]:
    """The checkpoint's tensors with each quantized expert projection's tensors replaced by one
    `.weight`: a StoredExpert where `fmt` (expert_format) keeps the experts quantized, else the dense
    weight (fp32), as a quantized router's always; yielded once all of that module's tensors are in.
    `scheme` is the checkpoint's (layers/quantization checkpoint_quantization); a module left
    incomplete at the end is a ValueError naming it and the tensors it lacks."""
    pending: dict[str, ColumnParallelLinear] = {}
    loaded: dict[str, set[str]] = {}
    count = 0
    for name, tensor in weights:
        found = _quantized_module(name, shape)
        if found is None or _dense(found[1], tensor) or scheme.is_ignored(found[0]):
            yield name, tensor
            continue
        module, part, rows, columns = found
        holder = pending.get(module)
        if holder is None:
            holder = ColumnParallelLinear(
                columns, rows, bias=False, tp_size=1, tp_rank=0, params_dtype=torch.float32,
                quant_method=scheme.linear_method(),
            )  # fmt: skip
            if isinstance(holder.quant_method, UnquantizedLinearMethod):  # a KV-scales-only scheme
                yield name, tensor
                continue
            pending[module], loaded[module] = holder, set()
        param = dict(holder.named_parameters()).get(part)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {name!r} is not one of a quantized MoE module's tensors under this "
                f"checkpoint's quantization_config (expected {sorted(dict(holder.named_parameters()))})."
            )
        try:
            param.weight_loader(param, tensor, None)
        except ValueError as error:
            raise ValueError(f"checkpoint tensor {name!r}: {error}.") from None
        loaded[module].add(part)
        if loaded[module] == set(dict(holder.named_parameters())):
            holder.quant_method.after_loading(holder)
            if fmt is not None and _EXPERT_TENSOR.match(name):
                yield f"{module}.weight", _stored(holder, module)
            else:
                yield f"{module}.weight", holder.quant_method.dequantize(holder)
                count += 1
            del pending[module], loaded[module]
    if pending:
        module = next(iter(pending))
        missing = sorted(set(dict(pending[module].named_parameters())) - loaded[module])
        raise ValueError(
            f"checkpoint is missing quantized expert tensors of {len(pending)} modules, e.g. "
            f"{[f'{module}.{part}' for part in missing]}."
        )
    if count:
        logger.warning(
            "%d quantized MoE modules (experts' projections, routers) were dequantized as they loaded: they "
            "run in the model dtype (the fused MoE kernels do not run this scheme), holding 2-4x the "
            "checkpoint's bytes",
            count,
        )
