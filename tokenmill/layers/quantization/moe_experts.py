"""A quantized checkpoint's MoE experts (Qwen3-MoE's `experts.E.gate_proj`, Mixtral's `experts.E.w1`, ...),
dequantized as they load: layers/fused_moe.py's kernels take dense weights only, so each expert
projection's stored tensors (GPTQ's qweight/qzeros/scales/g_idx, compressed-tensors' weight and
weight_scale, ...) are gathered into a one-off linear layer of the checkpoint's scheme, which loads and
checks them as any quantized linear does, and its weight in fp32 goes on to the model under the
projection's `.weight` name. The experts then run in the model dtype: correct, but holding 2-4x the
bytes the checkpoint's experts do (said once, as a warning). Experts the ignore list names pass as
they are.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch

from tokenmill.layers.linear import ColumnParallelLinear, UnquantizedLinearMethod

logger = logging.getLogger(__name__)

# `<module>.experts.<E>.<projection>.<tensor>`: module names as the checkpoint writes them.
_EXPERT_TENSOR = re.compile(r"^(.*\.experts\.\d+\.([^.]+))\.([^.]+)$")
# Projections that map the hidden state to the experts' width (gate, up), and back (down).
_INTO_EXPERT = ("gate_proj", "up_proj", "w1", "w3")
_OUT_OF_EXPERT = ("down_proj", "w2")


def _dense(part: str, tensor: torch.Tensor) -> bool:
    """A `.weight` in a 16- or 32-bit float is stored unquantized, whatever the scheme (an expert the
    checkpoint left out of quantization without listing it: GPTQModel's dynamic skips, for one)."""
    return part == "weight" and tensor.dtype in (torch.float16, torch.bfloat16, torch.float32)


def dequantized_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
    scheme,
    hidden_size: int,
    intermediate_size: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized expert projection's tensors replaced by its dense
    `.weight` (fp32), yielded once all of that projection's tensors are in. `scheme` is the
    checkpoint's (layers/quantization checkpoint_quantization); a projection left incomplete at the
    end is a ValueError naming it and the tensors it lacks."""
    pending: dict[str, ColumnParallelLinear] = {}
    loaded: dict[str, set[str]] = {}
    count = 0
    for name, tensor in weights:
        match = _EXPERT_TENSOR.match(name)
        projection = match.group(2) if match else None
        if projection not in _INTO_EXPERT + _OUT_OF_EXPERT or _dense(match.group(3), tensor):
            yield name, tensor
            continue
        module, part = match.group(1), match.group(3)
        if scheme.is_ignored(module):
            yield name, tensor
            continue
        holder = pending.get(module)
        if holder is None:
            into = projection in _INTO_EXPERT
            rows, columns = (intermediate_size, hidden_size) if into else (hidden_size, intermediate_size)
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
                f"checkpoint tensor {name!r} is not one of a quantized expert's tensors under this "
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
            f"checkpoint is missing quantized expert tensors of {len(pending)} projections, e.g. "
            f"{[f'{module}.{part}' for part in missing]}."
        )
    if count:
        logger.warning(
            "%d quantized MoE expert projections were dequantized as they loaded: the experts run in the "
            "model dtype (the fused MoE kernels take dense weights), holding 2-4x the checkpoint's bytes",
            count,
        )
