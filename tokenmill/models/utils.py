"""Checkpoint tensors into a model's parameters, one loop for every architecture: each tensor goes to its
parameter's weight_loader (which cuts this rank's shard); the names a model fuses into one parameter
are routed by the model's stacked_params_mapping."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from tokenmill.layers.sharding import ShardId, check_dtype

# (our fused parameter's name part, the checkpoint's name part, shard id), e.g. (".qkv_proj", ".q_proj", "q").
StackedParamsMapping = Sequence[tuple[str, str, ShardId]]


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
    """For a parameter every rank holds whole: a copy, once the shapes agree."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape {tuple(loaded_weight.shape)} does not match the expected {tuple(param.shape)}"
        )
    check_dtype(param.dtype, loaded_weight)
    param.data.copy_(loaded_weight)


def load_model_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: StackedParamsMapping = (),
    skip_substrs: Sequence[str] = (),
) -> None:
    """Load (checkpoint name, tensor) pairs. A ValueError names a tensor that matches no parameter, a
    tensor of the wrong shape or kind of dtype, or the tensors the checkpoint lacks; names containing any
    of `skip_substrs` are passed over, and so is an all-zero bias of a layer built without one."""
    params = dict(model.named_parameters())
    loaded_shards: dict[str, set[ShardId]] = defaultdict(set)
    for name, tensor in weights:
        if any(part in name for part in skip_substrs):
            continue
        param_name, shard_id = name, None
        for fused_part, checkpoint_part, stacked_shard_id in stacked_params_mapping:
            if checkpoint_part in name:
                param_name, shard_id = name.replace(checkpoint_part, fused_part), stacked_shard_id
                break
        param = params.get(param_name)
        if param is None and name.endswith(".bias") and not tensor.any():
            # GPTQ-for-LLaMa and early AutoGPTQ wrote a zero bias beside every quantized linear, biased in
            # the architecture or not: nothing to add.
            continue
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}.")
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            weight_loader(param, tensor, shard_id)
        except ValueError as error:
            raise ValueError(f"checkpoint tensor {name!r}: {error}.") from None
        loaded_shards[param_name].add(shard_id)
    missing = [
        checkpoint_name
        for param_name in params
        for checkpoint_name in _unloaded(param_name, loaded_shards[param_name], stacked_params_mapping)
    ]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}.")


def _unloaded(
    param_name: str, loaded: set[ShardId], stacked_params_mapping: StackedParamsMapping
) -> list[str]:
    """The checkpoint names still owed to `param_name`; a fused parameter loaded whole (shard id None)
    owes none."""
    if None in loaded:
        return []
    shards = [
        (fused, part, shard_id) for fused, part, shard_id in stacked_params_mapping if fused in param_name
    ]
    if not shards:
        return [param_name]
    return [param_name.replace(fused, part) for fused, part, shard_id in shards if shard_id not in loaded]


@contextlib.contextmanager
def building_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Modules constructed inside get their parameters on `device` in `dtype`."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default_dtype)
