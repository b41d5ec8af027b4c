"""A quantized checkpoint's MoE experts (Qwen3-MoE's `experts.E.gate_proj`, Mixtral's `experts.E.w1`, ...),
dequantized as they load: layers/fused_moe.py's kernels take dense weights only, so each expert
projection's stored tensors (GPTQ's qweight/qzeros/scales/g_idx, compressed-tensors' weight and
weight_scale, ...) are gathered into a one-off linear layer of the checkpoint's scheme, which loads and
checks them as any quantized linear does, and its weight in fp32 goes on to the model under the
projection's `.weight` name. The experts then run in the model dtype: correct, but holding 2-4x the
bytes the checkpoint's experts do (said once, as a warning). Experts and routers the ignore list names
pass as they are; a router it left quantized is dequantized the same way.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

from tokenmill.layers.linear import ColumnParallelLinear, UnquantizedLinearMethod

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


def dequantized_experts(
    weights: Iterable[tuple[str, torch.Tensor]], scheme, shape: MoeShape
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized expert projection's (or router's) tensors replaced
    by its dense `.weight` (fp32), yielded once all of that module's tensors are in. `scheme` is the
    checkpoint's (layers/quantization checkpoint_quantization); a module left incomplete at the end is
    a ValueError naming it and the tensors it lacks."""
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
            yield f"{module}.weight", holder.quant_method.dequantize(holder)
            del pending[module], loaded[module]
            count += 1
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
            "run in the model dtype (the fused MoE kernels take dense weights), holding 2-4x the "
            "checkpoint's bytes",
            count,
        )
