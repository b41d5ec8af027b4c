"""The 4-bit GEMV on the tensor cores for decode's 1-8 rows (kernels/w4a16_gemv_mma.cu: CUDA C, compiled
at first use by NVRTC, kernels/cuda_rtc.py). Same layout and results as skinny_gemm.w4a16_skinny, whose
Triton kernels it stands in for at 2-8 rows where it takes the shapes, and at one row for the shorter
weights (`takes`; the Triton one-row kernel is faster on the long ones): 16-bit activations, K a
multiple of 128, groups of 128 times a power of two or one group a row (channelwise), a device of
compute capability 8.0 or later with NVRTC loadable. Why CUDA: its operands go from the loaded words to
the MMA's fragments with no shuffle (the sum over K may take the values in any order A and B share),
which Triton's layouts do not let a kernel say; the Triton one-row kernels spend 16-28 instructions a
word on the CUDA cores.

MMA_GEMV decides whether the INT4 linears (int4_gemm.w4a16_linear, layers/quantization/int4.py) route to
it; docs/performance.md has the A/B.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch

from tokenmill.kernels import GemvFusion, cuda_rtc, env_int, gemv, pdl, skinny_gemm

SOURCE = Path(__file__).with_name("w4a16_gemv_mma.cu")
MAX_ROWS = 8  # the MMA's eight columns
# Whether the INT4 linears route MIN_ROWS-8 rows here (TOKENMILL_INT4_MMA_GEMV=0 turns it off). H200,
# 2026-12-06: at 4 rows the 8B linears take 7.8 / 5.8 / 24.7 / 15.5 us (QKV, O, gate+up, down) where the
# Triton tensor-core kernel the engine ran there took 14.9 / 11.9 / 47.0 / 26.0; at one row the Triton
# one-row kernel stays faster (7.6 / 5.1 / 20.2 / 11.0 against 7.5 / 5.4 / 23.8 / 15.2): MIN_ROWS 2
# (TOKENMILL_INT4_MMA_MIN_ROWS=1 routes one row here too, for the benchmarks' A/B).
MMA_GEMV = os.environ.get("TOKENMILL_INT4_MMA_GEMV", "1") != "0"
MIN_ROWS = env_int("TOKENMILL_INT4_MMA_MIN_ROWS", 2, allowed=tuple(range(1, MAX_ROWS + 1)))
# One row comes here too where the weight has at most ONE_ROW_MAX_VALUES values: the short GEMVs, where
# the one-row kernels' ramp weighs most. H100, 2026-12-07, one row, with the running addresses: QKV 7.41
# and O 5.05 us here against 8.30 and 5.66 for the one-row kernels; gate+up (with its SiLU) 25.3 and down
# 14.4 against 23.8 and 12.8, which stay there. TOKENMILL_INT4_MMA_ONE_ROW_MAX=0 turns it off.
ONE_ROW_MAX_VALUES = env_int("TOKENMILL_INT4_MMA_ONE_ROW_MAX", 1 << 25)
# Whether the kernel takes the magic and zero point off a chunk's sums (LEAN in the .cu: one instruction a
# pair of values fewer) instead of off each pair, and how many chunks an iteration of its main loop takes
# (UNROLL: 2 reads the activations a chunk ahead without copying registers, for more registers a thread).
# H100, 2026-12-07: LEAN within 2% either way, UNROLL 2 +34% to -3% by shape; off until the H200 (where
# the kernel reads a smaller share of the bandwidth) says otherwise. TOKENMILL_INT4_MMA_LEAN=1 and
# TOKENMILL_INT4_MMA_UNROLL=2 turn them on; benchmarks/gpu/bench_quant_gemm.py --int4-mma times all four.
LEAN = os.environ.get("TOKENMILL_INT4_MMA_LEAN", "0") == "1"
UNROLL = env_int("TOKENMILL_INT4_MMA_UNROLL", 1, allowed=(1, 2))
CHUNK = 128  # values along K a lane pair's loads cover: a group's scale applies to a whole chunk
_SCALES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


class MmaConfig(NamedTuple):
    warps: int  # a block's warps, taking the chunks of its rows in turn
    tiles: int  # 16-row tiles a block (gated: 8 outputs a tile)
    stages: int  # slots of a warp's cp.async ring: stages - 1 chunks in flight

    def shared_bytes(self) -> int:
        return self.warps * self.stages * self.tiles * 1024


def default_config(n_tiles: int, k: int) -> MmaConfig:
    """Tiles for n_tiles 16-row tiles over K, from the H200 sweep of 2026-12-06 (bench_quant_gemm.py
    --int4-mma, Llama-3.1-8B's linears at 1 and 4 rows; docs/performance.md): gate+up (1,792 tiles) four
    warps over two tiles, down (K 14,336) and O eight warps over one, QKV eight over two; the ring's
    depth moved none of them by more than 5% (TOKENMILL_INT4_MMA_TILES="warps,tiles,stages" sets one for
    every shape, for the benchmarks)."""
    forced = os.environ.get("TOKENMILL_INT4_MMA_TILES")
    if forced:
        try:
            warps, tiles, stages = (int(v) for v in forced.split(","))
        except ValueError:
            raise ValueError(f"TOKENMILL_INT4_MMA_TILES={forced!r}: give warps,tiles,stages") from None
        return MmaConfig(warps, tiles, stages)
    if n_tiles >= 1024:
        return MmaConfig(warps=4, tiles=2, stages=3)
    if k >= 8192 or n_tiles <= 256:
        return MmaConfig(warps=8, tiles=1, stages=2)
    return MmaConfig(warps=8, tiles=2, stages=4)


def takes(
    x: torch.Tensor, w_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
) -> bool:
    """Whether the INT4 linears route this product here (MMA_GEMV; at least MIN_ROWS rows, or one row of
    a weight of at most ONE_ROW_MAX_VALUES values; `supports`), else to the Triton kernels."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    short = rows == 1 and w_packed.shape[0] * x.shape[-1] <= ONE_ROW_MAX_VALUES
    return MMA_GEMV and (rows >= MIN_ROWS or short) and supports(x, w_packed, scale, zero, group_size)


def supports(
    x: torch.Tensor, w_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
) -> bool:
    """Whether w4a16_gemv_mma can compute this product (the shapes, dtypes and device above)."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 1 <= rows <= MAX_ROWS or k % CHUNK or (group_size < k and not _power_of_two_chunks(group_size)):
        return False
    if scale.dtype not in _SCALES or w_packed.stride(-1) != 1 or scale.stride(-1) != 1:
        return False
    if w_packed.shape[-1] * 8 != k or w_packed.stride(0) % 4 or w_packed.data_ptr() % 16:
        return False  # (16-byte loads of whole rows' words)
    if zero is not None and (zero.dtype != torch.int8 or zero.stride(-1) != 1):
        return False
    return cuda_rtc.runs_on(x.device, (8, 0))


def _power_of_two_chunks(group_size: int) -> bool:
    """Whether a group is 2^s chunks: the kernel finds a chunk's group by a shift."""
    chunks = group_size // CHUNK
    return group_size % CHUNK == 0 and chunks & (chunks - 1) == 0


def _group_shift(group_size: int, k: int) -> int:
    """The shift that takes a chunk's index to its group's (31 where one group covers K)."""
    return 31 if group_size >= k else (group_size // CHUNK).bit_length() - 1


def w4a16_gemv_mma(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    fusion: GemvFusion | None = None,
    config: MmaConfig | None = None,
    lean: bool | None = None,
    unroll: int | None = None,
) -> torch.Tensor:
    """x [..., K] (1-8 rows) @ W^T (+ bias) -> [..., N] in x's dtype; with fusion.silu_mul the weight is
    gate || up and silu(gate) * up is returned ([..., N / 2]), rounded where the separate launches round.
    lean, unroll: the LEAN variant and the main loop's unrolling (by default the module's LEAN, UNROLL)."""
    if not supports(x, w_packed, scale, zero, group_size):
        raise ValueError("w4a16_gemv_mma does not take these shapes (see supports)")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or x2.data_ptr() % 16 or x2.stride(0) % 8:
        x2 = x2.contiguous()  # (16-byte loads of each row's activations)
    m, k = x2.shape
    n = w_packed.shape[0]
    fused = gemv.fused_args(fusion, n, 1, bias)
    config = config or default_config(-(-n // 16), k)
    defines = dict(
        BF16=int(x.dtype == torch.bfloat16), SCALE=_SCALES[scale.dtype], HAS_ZERO=int(zero is not None),
        GATED=int(fused.gated), WARPS=config.warps, TILES=config.tiles, STAGES=config.stages,
        LEAN=int(LEAN if lean is None else lean), UNROLL=UNROLL if unroll is None else unroll,
    )  # fmt: skip
    kernel = cuda_rtc.kernel(SOURCE, "w4a16_gemv_mma", x.device, defines)

    def launch(out: torch.Tensor, grid: tuple[int, int]) -> None:
        kernel(
            grid=grid[:1],
            block=(config.warps * 32,),
            shared=config.shared_bytes(),
            args=[
                x2, w_packed, scale, zero if zero is not None else scale, out, m, out.shape[1], k,
                x2.stride(0), w_packed.stride(0), scale.stride(0), zero.stride(0) if zero is not None else 0,
                out.stride(0), _group_shift(group_size, k),
            ],
            pdl=pdl.enabled(x2),
        )  # fmt: skip

    # The one-row kernels' launcher: the output, the grid (a block covers 16 rows a tile, gated 8 outputs),
    # then the bias and a SiLU the store could not take.
    tiles = skinny_gemm.SkinnyConfig(16 * config.tiles, CHUNK, 1, config.warps, config.stages)
    return skinny_gemm.launch_over_rows(x, m, n, tiles, launch, bias, fused)
