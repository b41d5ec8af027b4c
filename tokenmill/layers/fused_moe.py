"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, each a gated
SiLU MLP, and the token's output is their outputs weighted by the router. The experts' weights are held
stacked, gate and up fused: w13 [experts, 2 * intermediate, hidden], w2 [experts, hidden, intermediate],
loaded from per-expert checkpoint tensors (`expert_params_mapping`).

The experts run in the kernel set's fused_moe: on a GPU kernels/fused_moe.py (tokens sorted by expert,
grouped GEMMs, fixed shapes: CUDA graphs hold it); elsewhere the torch reference, whose shapes follow
the routing (a model built with it is not `graph_safe`)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import distributed
from tokenmill.kernels import Kernels, get_kernels
from tokenmill.layers.linear import ShardId, divide

# The checkpoint's per-expert projections and where they land: (our parameter, its name, part).
_EXPERT_PROJECTIONS = (("w13", "gate_proj", "gate"), ("w13", "up_proj", "up"), ("w2", "down_proj", "down"))


def expert_params_mapping(num_experts: int) -> list[tuple[str, str, ShardId]]:
    """Stacked-parameter entries for load_model_weights: `.experts.E.gate_proj.weight` becomes shard
    "gate:E" of `.experts.w13`, and so on (a checkpoint's own naming, Mixtral's w1/w3/w2, is renamed to
    these by its model)."""
    return [
        (f".experts.{ours}", f".experts.{expert}.{theirs}.weight", f"{part}:{expert}")
        for expert in range(num_experts)
        for ours, theirs, part in _EXPERT_PROJECTIONS
    ]


class Experts(nn.Module):
    """The stacked expert weights and their loader. With tensor parallelism every rank holds every
    expert, sliced along the intermediate width: rank r its slice of gate, of up and of down's columns.
    With expert parallelism (distributed.expert_parallel) rank r holds experts [r * E / N, (r+1) * E / N)
    whole instead. Either way the ranks' outputs sum to the layer's (an all-reduce)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = distributed.tp_size(), distributed.tp_rank()
        self.num_experts = num_experts
        if distributed.expert_parallel() and self.tp_size > 1:
            self.num_local = divide(num_experts, self.tp_size, "num_experts")
            self.sliced = False
        else:
            self.num_local = num_experts
            self.sliced = self.tp_size > 1
            intermediate_size = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.first_expert = self.tp_rank * self.num_local if self.num_local != num_experts else 0
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(
            torch.empty(self.num_local, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(self.num_local, hidden_size, intermediate_size), requires_grad=False
        )
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        """One expert's projection ("gate:E", "up:E", "down:E"), or the whole stacked tensor (None); an
        expert another rank holds is passed over."""
        if shard_id is None:
            target = param.data
        else:
            part, expert = str(shard_id).split(":")
            local = int(expert) - self.first_expert
            if not 0 <= local < self.num_local:
                return
            target = param.data[local]
            size, start = self.intermediate_size, self.tp_rank * self.intermediate_size
            if part == "down":  # [hidden, intermediate]: this rank's columns
                loaded_weight = loaded_weight.narrow(1, start, size) if self.sliced else loaded_weight
            else:  # [intermediate, hidden]: this rank's rows, into the gate or the up half
                loaded_weight = loaded_weight.narrow(0, start, size) if self.sliced else loaded_weight
                target = target[:size] if part == "gate" else target[size:]
        if target.shape != loaded_weight.shape:
            raise ValueError(
                f"shape {tuple(loaded_weight.shape)} does not match the expected {tuple(target.shape)}"
            )
        target.copy_(loaded_weight)


class FusedMoE(nn.Module):
    """Router and experts of one MoE layer. renormalize: the top-k routing weights are rescaled to sum
    to 1 (Mixtral always; Qwen3-MoE when its config's norm_topk_prob says so)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        kernels: Kernels | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be between 1 and {num_experts}, got {top_k}.")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size  # before any TP split
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.kernels = kernels or get_kernels()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k] (in x's dtype): a softmax over all
        experts in fp32, the k largest kept (the kernel set's topk_softmax)."""
        return self.kernels.topk_softmax(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held = self.experts
        if held.num_local != self.num_experts and distributed.expert_dispatch() == "all_to_all":
            return self.forward_all_to_all(x)
        experts, weights = self.route(x)
        if held.num_local != self.num_experts:  # expert parallel: the pairs of other ranks' experts
            local = experts - held.first_expert  # go to the kernels' "no expert here", num_local
            elsewhere = (local < 0) | (local >= held.num_local)
            experts, weights = local.masked_fill(elsewhere, held.num_local), weights.masked_fill(elsewhere, 0)
        return distributed.all_reduce(self.kernels.fused_moe(x, held.w13, held.w2, experts, weights))

    def forward_all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallelism by dispatch: this rank routes its share of the tokens (every rank holds
        all of them), sends each (token, expert) pair's row to the rank holding the expert, runs the
        pairs it receives through its experts, sends the outputs back, sums each token's k, and
        all-gathers the shares. The split sizes are read on the host (no CUDA graph)."""
        held, size, rank = self.experts, distributed.tp_size(), distributed.tp_rank()
        share = -(-x.shape[0] // size)
        mine = x[rank * share : (rank + 1) * share]
        experts, weights = self.route(mine)
        flat_experts = experts.reshape(-1)
        owner = flat_experts // held.num_local
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=size)
        recv_counts = distributed.all_to_all(send_counts, [1] * size, [1] * size)
        sent, received = send_counts.tolist(), recv_counts.tolist()
        rows = distributed.all_to_all(mine[order // self.top_k], received, sent)
        # Each pair's expert (local to its rank) and weight, as one float tensor (ids are exact in fp32).
        local = (flat_experts[order] - owner[order] * held.num_local).to(torch.float32)
        meta = torch.stack([local, weights.reshape(-1)[order].float()], dim=1)
        meta = distributed.all_to_all(meta, received, sent)
        if rows.shape[0]:
            pair_experts, pair_weights = meta[:, :1].long(), meta[:, 1:].to(x.dtype)
            rows = self.kernels.fused_moe(rows, held.w13, held.w2, pair_experts, pair_weights)
        back = distributed.all_to_all(rows, sent, received)
        out = torch.zeros(share, x.shape[1], dtype=x.dtype, device=x.device)
        out.index_add_(0, order // self.top_k, back)
        return distributed.all_gather(out, dim=0)[: x.shape[0]]
