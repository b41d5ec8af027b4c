"""Tensor-parallel state of this process: its rank among tp_size workers and the collectives the layers
call (an all-reduce after each row-parallel linear and the embedding, an all-gather of the LM head's
vocab shards). One process per rank, torch.distributed underneath: NCCL on GPUs, gloo on CPUs. A
process that never called init_tensor_parallel is rank 0 of 1, and every collective is a no-op."""

from __future__ import annotations

import torch
import torch.distributed as dist

_size, _rank = 1, 0
_expert_dispatch: str | None = None


def init_tensor_parallel(
    size: int, rank: int, init_method: str, backend: str, expert_dispatch: str | None = None
) -> None:
    """Join the group of `size` ranks at init_method (tcp://host:port); NCCL's NVLink multicast stays off
    (NCCL_NVLS_ENABLE=0 is the launcher's to set). expert_dispatch, None or how tokens reach the
    experts ("allreduce" or "all_to_all", EngineConfig.expert_dispatch): MoE layers hold whole experts,
    a share of them per rank, instead of a slice of every expert."""
    global _size, _rank, _expert_dispatch
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside 0..{size - 1} (tensor_parallel_size {size}).")
    if size > 1:
        dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank)
    _size, _rank, _expert_dispatch = size, rank, expert_dispatch


def tp_size() -> int:
    return _size


def tp_rank() -> int:
    return _rank


def expert_parallel() -> bool:
    return _expert_dispatch is not None


def expert_dispatch() -> str | None:
    return _expert_dispatch


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks, in place."""
    if _size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' tensors concatenated along dim, in rank order."""
    if _size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Rows of x, in_splits[r] of them for rank r in rank order, sent; out_splits[r] rows from each rank
    received, concatenated in rank order."""
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
    return out


def all_reduce_min(value: int) -> int:
    """The smallest of the ranks' values (KV blocks: every rank must hold the same number)."""
    if _size == 1:
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def destroy() -> None:
    global _size, _rank, _expert_dispatch
    if dist.is_initialized():
        dist.destroy_process_group()
    _size, _rank, _expert_dispatch = 1, 0, None
