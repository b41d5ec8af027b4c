"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, each a gated
SiLU MLP, and the token's output is their outputs weighted by the router. The experts' weights are held
stacked, gate and up fused: w13 [experts, 2 * intermediate, hidden], w2 [experts, hidden, intermediate],
loaded from per-expert checkpoint tensors (`expert_params_mapping`).

The experts run in the kernel set's fused_moe: on a GPU kernels/fused_moe.py (tokens sorted by expert,
grouped GEMMs, fixed shapes: CUDA graphs hold it); elsewhere the torch reference, whose shapes follow
the routing (a model built with it is not `graph_safe`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from tokenmill import distributed
from tokenmill.kernels import Kernels, get_kernels
from tokenmill.kernels.quant_reference import PACK, QuantExperts, quantize_experts_fp8, quantize_experts_int4
from tokenmill.kernels.reference import FP8_DTYPE
from tokenmill.layers.sharding import ShardId, check_dtype, divide

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


class ExpertFormat(NamedTuple):
    """How a MoE layer's experts are held quantized (kernels/quant_reference.py's QuantExperts): INT4
    (int4.py's packing), INT8 (int8, a byte a value, as FP8's layout) or FP8 (e4m3); input columns per
    scale (0: one scale per row); zero points (INT4, and GPTQ 8-bit's INT8 groups)."""

    int4: bool
    group_size: int
    zero_points: bool = False
    int8: bool = False


class StoredExpert(NamedTuple):
    """One expert projection as a quantized checkpoint stores it, in ExpertFormat's layout: weight e4m3 or
    int8 [N, K] or int32 [N, ceil(K/8)], scale [N, groups], zero int8 [N, groups] or None."""

    weight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None


_expert_format: contextvars.ContextVar[ExpertFormat | None] = contextvars.ContextVar(
    "expert_format", default=None
)


@contextlib.contextmanager
def experts_held_as(fmt: ExpertFormat | None) -> Iterator[None]:
    """MoE layers built inside hold their experts in `fmt` (None: dense, the model dtype)."""
    token = _expert_format.set(fmt)
    try:
        yield
    finally:
        _expert_format.reset(token)


class Experts(nn.Module):
    """The stacked expert weights and their loader. With tensor parallelism every rank holds every
    expert, sliced along the intermediate width: rank r its slice of gate, of up and of down's columns.
    With expert parallelism (distributed.expert_parallel) rank r holds experts [r * E / N, (r+1) * E / N)
    whole instead. Either way the ranks' outputs sum to the layer's (an all-reduce).

    Quantized (`fmt`), w13 and w2 hold the quantized values and the buffers w13_scale, w2_scale (and
    w13_zero, w2_zero) the rest; they load from StoredExpert tensors (layers/quantization/moe_experts.py).
    A dense tensor arriving first (a checkpoint that left these experts unquantized without listing
    them) turns the module dense."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, fmt: ExpertFormat | None = None
    ) -> None:
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
        self.intermediate_size, self.hidden_size = intermediate_size, hidden_size
        self.fmt: ExpertFormat | None = None
        self.dtype, self.loaded_quantized = torch.get_default_dtype(), False
        device = torch.get_default_device()
        if fmt is None:
            self._hold_dense(device)
        else:
            self._hold_quantized(fmt, device)

    def _shapes(self) -> dict[str, tuple[int, int, int]]:
        size, hidden = self.intermediate_size, self.hidden_size
        return {"w13": (self.num_local, 2 * size, hidden), "w2": (self.num_local, hidden, size)}

    def _hold_dense(self, device: torch.device) -> None:
        self.fmt = None
        for name, shape in self._shapes().items():
            for suffix in ("_scale", "_zero"):
                self._buffers.pop(name + suffix, None)
            self._set_param(name, torch.empty(shape, dtype=self.dtype, device=device))

    def _hold_quantized(self, fmt: ExpertFormat, device: torch.device) -> None:
        if self.sliced:
            units = [PACK if fmt.int4 else 1] + [fmt.group_size] * bool(fmt.group_size)
            for unit in units:
                if self.intermediate_size % unit:
                    raise ValueError(
                        f"moe_intermediate_size per rank ({self.intermediate_size}) is not a multiple of "
                        f"the quantized experts' {'group size' if unit == fmt.group_size else 'packing'} "
                        f"({unit}): pick a tensor_parallel_size that leaves each rank whole groups, or "
                        "enable_expert_parallel"
                    )
        self.fmt = fmt
        scale_dtype = self.dtype if fmt.int4 else torch.float32
        for name, (experts, rows, columns) in self._shapes().items():
            stored = -(-columns // PACK) if fmt.int4 else columns
            groups = -(-columns // fmt.group_size) if fmt.group_size else 1
            dtype = torch.int32 if fmt.int4 else torch.int8 if fmt.int8 else FP8_DTYPE
            shape = (experts, rows, groups)
            self._set_param(name, torch.zeros(experts, rows, stored, dtype=dtype, device=device))
            self.register_buffer(f"{name}_scale", torch.zeros(shape, dtype=scale_dtype, device=device))
            if fmt.zero_points:  # in the scales' dtype, exact for int8 values (quant_gemm says why)
                self.register_buffer(f"{name}_zero", torch.zeros(shape, dtype=scale_dtype, device=device))

    def _set_param(self, name: str, data: torch.Tensor) -> None:
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader, param.expert_name = self.weight_loader, name  # type: ignore[attr-defined]
        setattr(self, name, param)

    def weights(self) -> tuple[torch.Tensor | QuantExperts, torch.Tensor | QuantExperts]:
        """(w13, w2) as the kernels take them: dense tensors, or QuantExperts."""
        if self.fmt is None:
            return self.w13, self.w2
        columns = {"w13": self.hidden_size, "w2": self.intermediate_size}
        return tuple(  # type: ignore[return-value]
            QuantExperts(
                getattr(self, name).data,
                getattr(self, f"{name}_scale"),
                getattr(self, f"{name}_zero", None),
                self.fmt.group_size or columns[name],
                columns[name],
            )
            for name in ("w13", "w2")
        )

    def quantize(self, method: str) -> None:
        """Online quantization of the loaded dense experts: "fp8", e4m3 with one scale per row; "int4",
        symmetric 4-bit groups of 128 input columns (as the linears of each scheme)."""
        dense = {name: getattr(self, name).data for name in ("w13", "w2")}
        int4 = method == "int4"
        self._hold_quantized(ExpertFormat(int4=int4, group_size=128 if int4 else 0), self.w13.device)
        for name, weight in dense.items():
            quantized = quantize_experts_int4(weight) if int4 else quantize_experts_fp8(weight)
            getattr(self, name).data.copy_(quantized.data)
            getattr(self, f"{name}_scale").copy_(quantized.scale)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | StoredExpert, shard_id: ShardId = None
    ) -> None:
        """One expert's projection ("gate:E", "up:E", "down:E"), dense or a StoredExpert, or the whole
        dense stacked tensor (None); an expert another rank holds is passed over."""
        name = param.expert_name  # type: ignore[attr-defined]
        if self.fmt is not None and isinstance(loaded_weight, torch.Tensor):
            if self.loaded_quantized:
                raise ValueError("a dense expert weight among quantized ones of the same MoE layer")
            self._hold_dense(param.device)
        if isinstance(loaded_weight, StoredExpert):
            if self.fmt is None:
                raise ValueError("a quantized expert weight for experts held dense")
            self.loaded_quantized = True
            parts = [(name, loaded_weight.weight, PACK if self.fmt.int4 else 1)]
            group = self.fmt.group_size
            parts.append((f"{name}_scale", loaded_weight.scale, group))
            if self.fmt.zero_points:  # integers held in the scales' dtype (_hold_quantized)
                zero = loaded_weight.zero.to(getattr(self, f"{name}_zero").dtype)
                parts.append((f"{name}_zero", zero, group))
        else:
            parts = [(name, loaded_weight, 1)]
        for target_name, tensor, unit in parts:
            self._load_part(getattr(self, target_name).data, tensor, shard_id, unit)

    def _load_part(self, target: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId, unit: int) -> None:
        """Copy one tensor of an expert's projection; `unit`: input columns per stored column (0: one
        stored column holds every input column, not sliced)."""
        if shard_id is not None:
            part, expert = str(shard_id).split(":")
            local = int(expert) - self.first_expert
            if not 0 <= local < self.num_local:
                return
            target = target[local]
            size, start = self.intermediate_size, self.tp_rank * self.intermediate_size
            if part == "down":  # [hidden, intermediate]: this rank's columns
                if self.sliced and unit:
                    loaded = loaded.narrow(1, start // unit, size // unit)
            else:  # [intermediate, hidden]: this rank's rows, into the gate or the up half
                loaded = loaded.narrow(0, start, size) if self.sliced else loaded
                target = target[:size] if part == "gate" else target[size:]
        if target.shape != loaded.shape:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected {tuple(target.shape)}")
        check_dtype(target.dtype, loaded)
        target.copy_(loaded)


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
        self.experts = Experts(num_experts, hidden_size, intermediate_size, _expert_format.get())
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
        return distributed.all_reduce(self.kernels.fused_moe(x, *held.weights(), experts, weights))

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
            rows = self.kernels.fused_moe(rows, *held.weights(), pair_experts, pair_weights)
        back = distributed.all_to_all(rows, sent, received)
        out = torch.zeros(share, x.shape[1], dtype=x.dtype, device=x.device)
        out.index_add_(0, order // self.top_k, back)
        return distributed.all_gather(out, dim=0)[: x.shape[0]]
