"""The fused MoE over quantized experts (kernels/fused_moe_quant.py) against the torch reference, which
dequantizes them first: FP8 per channel, per tensor and in blocks, INT4 groups with and without zero
points, on awkward expert counts, widths (not multiples of the tiles), top-k and token counts."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import fused_moe, fused_moe_quant, reference  # noqa: E402
from tokenmill.kernels.quant_reference import (  # noqa: E402
    QuantExperts,
    pack_int4,
    quantize_experts_fp8,
)

from .test_fused_moe import DEVICE, routing  # noqa: E402

SHAPES = [(1, 3, 1, 40, 24), (7, 6, 2, 72, 40), (37, 5, 3, 48, 100), (130, 12, 2, 64, 48)]


def fp8_blocks(weight: torch.Tensor, block_n: int, block_k: int) -> QuantExperts:
    """e4m3 with one scale per block_n x block_k block, held per row (QuantExperts' layout)."""
    experts, n, k = weight.shape
    rows, cols = math.ceil(n / block_n), math.ceil(k / block_k)
    padded = torch.nn.functional.pad(weight.float(), (0, cols * block_k - k, 0, rows * block_n - n))
    blocks = padded.reshape(experts, rows, block_n, cols, block_k)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(experts, rows * block_n, -1)
    per_row = scale.repeat_interleave(block_n, dim=1)[:, :n]
    return QuantExperts(q[:, :n, :k].contiguous(), per_row.contiguous(), None, block_k, k)


def fp8_per_tensor(weight: torch.Tensor) -> QuantExperts:
    """One scale per expert, broadcast to its rows (AutoFP8's per-tensor scales, as loaded)."""
    experts, n, k = weight.shape
    scale = weight.abs().amax(dim=(1, 2)).float().clamp(min=1e-12) / 448
    q = (weight.float() / scale[:, None, None]).to(torch.float8_e4m3fn)
    return QuantExperts(q, scale[:, None, None].expand(experts, n, 1).contiguous(), None, k, k)


def int4_groups(weight: torch.Tensor, group: int, zero_points: bool) -> QuantExperts:
    """Round-to-nearest 4-bit groups of `group` input columns (the last one shorter where it does not
    divide K); asymmetric with zero points, else symmetric."""
    experts, n, k = weight.shape
    num_groups = math.ceil(k / group)
    padded = torch.nn.functional.pad(weight.float(), (0, num_groups * group - k))
    groups = padded.reshape(experts, n, num_groups, group)
    if zero_points:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = (torch.round(-lo / scale) - 8).clamp(-8, 7)
    else:
        scale, zero = (groups.abs().amax(-1) / 7).clamp(min=1e-8), torch.zeros(experts, n, num_groups)
    q = (
        (torch.round(groups / scale[..., None]) + zero[..., None])
        .clamp(-8, 7)
        .reshape(experts, n, -1)[..., :k]
    )
    packed = torch.stack([pack_int4(q[e].to(torch.int8)) for e in range(experts)])
    zeros = zero.to(torch.int8) if zero_points else None
    return QuantExperts(packed, scale.to(torch.bfloat16), zeros, group, k)


def int8_groups(weight: torch.Tensor, group: int) -> QuantExperts:
    """Asymmetric int8 groups of `group` input columns with zero points (GPTQ 8-bit's experts, as
    loaded: q - 128 and zero - 128 in int8, fp32 scales)."""
    experts, n, k = weight.shape
    num_groups = math.ceil(k / group)
    padded = torch.nn.functional.pad(weight.float(), (0, num_groups * group - k))
    groups = padded.reshape(experts, n, num_groups, group)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 255).clamp(min=1e-8)
    zero = (torch.round(-lo / scale) - 128).clamp(-128, 127)
    q = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(-128, 127)
    q = q.reshape(experts, n, -1)[..., :k].to(torch.int8).contiguous()
    return QuantExperts(q, scale, zero.to(torch.int8), group, k)


def int8_channel(weight: torch.Tensor) -> QuantExperts:
    """Symmetric int8 with one scale per row (compressed-tensors' INT8 experts)."""
    experts, n, k = weight.shape
    scale = weight.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / 127
    q = torch.round(weight.float() / scale).clamp(-128, 127).to(torch.int8)
    return QuantExperts(q, scale, None, k, k)


FORMATS = {
    "fp8-channel": quantize_experts_fp8,
    "int8-channel": int8_channel,
    "int8-g32-zero": lambda w: int8_groups(w, 32),
    "fp8-tensor": fp8_per_tensor,
    "fp8-block-128": lambda w: fp8_blocks(w, 128, 128),
    "fp8-block-16x32": lambda w: fp8_blocks(w, 16, 32),
    "int4-g16-zero": lambda w: int4_groups(w, 16, True),
    "int4-g32-sym": lambda w: int4_groups(w, 32, False),
    "int4-g128-zero": lambda w: int4_groups(w, 128, True),
    "int4-channel-sym": lambda w: int4_groups(w, w.shape[2], False),
}


def experts_for(fmt: str, num_experts: int, hidden: int, inter: int, gen) -> tuple[QuantExperts, ...]:
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return tuple(
        QuantExperts(*(t.to(DEVICE) if t is not None else None for t in q[:3]), *q[3:])
        for q in (FORMATS[fmt](w13), FORMATS[fmt](w2))
    )


# fp32 (the "ieee" dot) on the two small shapes in the default suite, on all four under -m slow.
CASES = [(dtype, shape) for dtype in (torch.float32, torch.bfloat16) for shape in SHAPES]
CASES = [
    pytest.param(dtype, *shape, marks=pytest.mark.slow)
    if dtype == torch.float32 and shape in SHAPES[2:]
    else pytest.param(dtype, *shape)
    for dtype, shape in CASES
]


@pytest.mark.parametrize(("dtype", "tokens", "num_experts", "top_k", "hidden", "inter"), CASES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_experts_match_reference(tokens, num_experts, top_k, hidden, inter, fmt, dtype) -> None:
    gen = torch.Generator().manual_seed(tokens + num_experts)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13, w2 = experts_for(fmt, num_experts, hidden, inter, gen)
    experts, weights = routing(tokens, num_experts, top_k, dtype, gen, starve=1 if num_experts > top_k else 0)
    got = fused_moe.fused_moe(x, w13, w2, experts, weights)
    want = reference.fused_moe(x, w13, w2, experts, weights)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)
    dense = reference.fused_moe(x, w13.dequantize(dtype), w2.dequantize(dtype), experts, weights)
    torch.testing.assert_close(want, dense)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_pairs_of_no_expert_here_add_nothing() -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, num_experts, top_k, hidden, inter = 19, 5, 2, 48, 40
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    w13, w2 = experts_for("int4-g16-zero", num_experts, hidden, inter, gen)
    experts, weights = routing(tokens, num_experts, top_k, torch.bfloat16, gen)
    elsewhere = torch.rand(tokens, top_k, generator=gen).to(DEVICE) < 0.4
    zeroed = weights.masked_fill(elsewhere, 0)
    want = reference.fused_moe(x, w13, w2, experts, zeroed)
    got = fused_moe.fused_moe(x, w13, w2, experts.masked_fill(elsewhere, num_experts), zeroed)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(("group", "block_k", "tile"), [(128, 256, 128), (48, 128, 16), (64, 32, 32)])
def test_the_k_tile_divides_the_group(group, block_k, tile) -> None:
    weight = QuantExperts(torch.empty(1, 8, 64, dtype=torch.int32), torch.empty(1, 8, 4), None, group, 512)
    assert fused_moe_quant.tile_k(weight, block_k) == tile
    with pytest.raises(ValueError, match="group size 40 is not a multiple of 16"):
        fused_moe_quant.tile_k(weight._replace(group_size=40), block_k)


@pytest.mark.parametrize(
    ("arch", "scheme"), [("qwen3-moe", "gptq"), ("mixtral", "fp8-block-experts"), ("qwen3-moe", "gptq-8bit")]
)
def test_quantized_moe_models_on_the_triton_kernels(arch, scheme, tmp_path, monkeypatch) -> None:
    """A checkpoint's quantized experts, kept quantized, through the Triton kernels end to end: the
    dequantized model's log-probabilities (tests/layers/test_moe_quantized.py's checkpoints)."""
    pytest.importorskip("compressed_tensors")
    from tests.layers.quant_models import load, prompt_logprobs_match
    from tests.layers.test_moe_quantized import make_checkpoint
    from tokenmill.kernels import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, "triton")
    logits = make_checkpoint(arch, scheme, tmp_path)
    llm = load(tmp_path, device=DEVICE)  # (quant_models pins the CPU for its reference tests)
    assert llm.engine.runner.model.kernels.backend == "triton"
    moe = next(m for m in llm.engine.runner.model.modules() if hasattr(m, "experts"))
    assert moe.experts.fmt is not None
    prompt_logprobs_match(llm, logits)
