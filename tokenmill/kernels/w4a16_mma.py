"""A 4-bit weight GEMM on tensor cores for decode's batches of activations (2 to MAX_ROWS rows),
dequantizing with two instructions per pair of values. The INT4 linears (layers/quantization/int4.py)
call it between one row (kernels/skinny_gemm.py's w4a16_skinny, faster there) and the batches where
dequantizing the whole weight for cuBLAS wins (kernels/int4_gemm.py); the measurements that set those
bounds are in docs/performance.md (`benchmarks/gpu/bench_quant_gemm.py --int4-rows`).

Layout as kernels/skinny_gemm.py's w4a16_skinny: int32 [N, K/8] words, value 8w + i in bits 4i..4i+3
stored as q + 8, group scales [N, K/group], optional int8 zero points [N, K/group].

One iteration covers one group's 128 values of BLOCK_N weight rows (16 words a row). On the GPU one
LOP3 puts two nibbles of a word (i and i + 4: bits 4i and 4i + 16) into the mantissas of a pair of
16-bit floats over the magic 128 (bf16) or 1024 (fp16), which is exact, and one packed subtraction
takes the magic and the stored offset 8 away: q in x's dtype, two values for two instructions (and a
shift for three pairs of four), no conversion. The pairs (i, i + 4) of every word form a
[BLOCK_N, 32] plane. The four planes are joined back into K's order (natural_order: register moves
only) for one tl.dot over the group with x read as it lies; with SWAP the weight is the MMA's A operand
(out^T = W x^T), which the H200 ran fastest up to 64 rows. (Measured and removed, 2026-12-03: one dot a
plane with x gathered, no faster at 2 rows and slower above; each group's words loaded a step ahead,
no faster.) BLOCK_M rows of activations a program (16, the smallest tensor-core tile, to 64; rows past
M are zero). The group's scale and zero point are applied to the fp32 sums
once per group: acc += s (sum_k x_k q_k - zero sum_k x_k). The interpreter (no PTX) takes the
nibbles with shifts and masks instead: the same values.
The reference is kernels/quant_reference.py's w4a16_gemm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import gemv, k_splits, pdl, sm_count
from tokenmill.kernels.interpreter import INTERPRETED
from tokenmill.kernels.skinny_gemm import SkinnyConfig, as_rows, launch_over_rows

TILE_K = 128  # values along K per iteration: one group (group sizes must be multiples of it)
MAX_ROWS = 128  # activation rows it takes; above them the whole weight is dequantized for cuBLAS

# (a & b) | c as LOP3's lookup table, and each dtype's magic pair and magic + 8 pair.
_LUT = 0xEA
_MAGIC = {"bf16": (0x43004300, 0x43084308, "bf16x2"), "fp16": (0x64006400, 0x64086408, "f16x2")}


def _dequant_asm(kind: str) -> str:
    """PTX: word $4 (again in $5, ignored) -> four registers of two 16-bit q each: $i holds nibbles i
    and i + 4."""
    magic, offset, suffix = _MAGIC[kind]
    lines = ["{", ".reg .b32 w, c;", f"mov.b32 c, {offset:#x};"]
    for i in range(4):
        source = "$4" if i == 0 else "w"
        if i:
            lines.append(f"shr.b32 w, $4, {4 * i};")
        lines.append(f"lop3.b32 ${i}, {source}, 0x000f000f, {magic:#x}, {_LUT:#x};")
        lines.append(f"sub.rn.{suffix} ${i}, ${i}, c;")
    lines.append("}")
    return "\n".join(lines)


_ASM_BF16 = tl.constexpr(_dequant_asm("bf16"))
_ASM_FP16 = tl.constexpr(_dequant_asm("fp16"))


@triton.jit
def _nibble(packed, i: tl.constexpr, DTYPE: tl.constexpr):
    return (((packed >> (4 * i)) & 0xF).to(tl.float32) - 8.0).to(DTYPE)


@triton.jit
def _pair(packed, i: tl.constexpr, DTYPE: tl.constexpr):
    return tl.join(_nibble(packed, i, DTYPE), _nibble(packed, i + 4, DTYPE))


@triton.jit
def nibble_planes(packed, DTYPE: tl.constexpr, ASM: tl.constexpr, BF16: tl.constexpr):
    """Four planes [R, C, 2] of packed [R, C] int32 words: plane i holds nibbles i and i + 4 of each
    word, as q = stored - 8 in DTYPE. The word goes in twice (pack=2), so that each call returns its
    pairs in whole 32-bit registers, ready for the tensor cores without a byte shuffle."""
    both = tl.join(packed, packed)
    if ASM and BF16:
        bf16 = tl.bfloat16
        planes = tl.inline_asm_elementwise(
            _ASM_BF16, "=r,=r,=r,=r,r,r", [both], dtype=(bf16, bf16, bf16, bf16), is_pure=True, pack=2
        )
    elif ASM:
        fp16 = tl.float16
        planes = tl.inline_asm_elementwise(
            _ASM_FP16, "=r,=r,=r,=r,r,r", [both], dtype=(fp16, fp16, fp16, fp16), is_pure=True, pack=2
        )
    else:
        planes = (
            _pair(packed, 0, DTYPE), _pair(packed, 1, DTYPE),
            _pair(packed, 2, DTYPE), _pair(packed, 3, DTYPE),
        )  # fmt: skip
    return planes


@triton.jit
def natural_order(planes, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """nibble_planes' four planes [R, W, 2] -> [R, 8W] in K's order: plane i's pair j is value 8w + 4j + i,
    so joining (0, 2) and (1, 3), then those two, lays the last three dims out as (j, i // 2, i % 2)."""
    low = tl.join(planes[0], planes[2])
    high = tl.join(planes[1], planes[3])
    return tl.reshape(tl.join(low, high), [ROWS, 8 * WORDS])


@triton.jit
def _w4a16_mma_kernel(
    x,
    w_packed,
    scale,
    zero,
    out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_om,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    ASM: tl.constexpr,
    BF16: tl.constexpr,
    SWAP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rn_ld = rn % N  # rows past N read row N-1's copy and are not stored: no masks on the weight loads
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    lo, hi = gemv.span(K // 8, pid_k, SPLIT_K, WORDS)
    rw = tl.arange(0, WORDS)
    w_rows = w_packed + rn_ld[:, None] * stride_wn + rw[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for w0 in range(lo, hi, WORDS):
        w0 = tl.multiple_of(w0, WORDS)
        packed = tl.load(w_rows + w0)
        tile = natural_order(nibble_planes(packed, x.dtype.element_ty, ASM, BF16), BLOCK_N, WORDS)
        k = w0 * 8 + tl.arange(0, 8 * WORDS)
        xi = tl.load(x + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
        if SWAP:  # the weight as the MMA's A operand, which may stay in registers: out^T = W x^T
            part = tl.trans(tl.dot(tile, tl.trans(xi)))
        else:
            part = tl.dot(xi, tl.trans(tile))
        group = (w0 * 8) // GROUP
        s = tl.load(scale + rn_ld * stride_sn + group).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(zero + rn_ld * stride_zn + group).to(tl.float32)
            part -= tl.sum(xi.to(tl.float32), axis=1)[:, None] * z[None, :]
        acc += part * s[None, :]
    gemv.store(out, acc, rm, rn, m_ok, n_ok, stride_om, SPLIT_K)


def block_rows(m: int) -> int:
    """Activation rows a program takes: the fewest tensor-core rows that cover m, up to 64 (larger
    batches take several blocks)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def default_config(
    n: int, k: int, device: torch.device, block_n: int | None = None, num_warps: int = 4, m: int = 1
) -> SkinnyConfig:
    """Four warps and, by the H200 timings of Llama-3.1-8B's linears (docs/performance.md), 64 weight
    rows a program up to 64 activation rows; past them 128, unless that leaves fewer programs than SMs
    (QKV and O at 128 rows, 1.1-1.6x faster at 64); K split as the other skinny GEMMs split it, over the
    programs of every block of activation rows."""
    if block_n is None:
        blocks = triton.cdiv(max(m, 1), block_rows(m))
        block_n = 64 if m <= 64 or triton.cdiv(n, 128) * blocks < sm_count(device) else 128
    programs = triton.cdiv(n, block_n) * triton.cdiv(max(m, 1), block_rows(m))
    split = k_splits(programs, k, TILE_K, device, limit=16)
    return SkinnyConfig(block_n=block_n, block_k=TILE_K, split_k=split, num_warps=num_warps, num_stages=3)


def supports(x: torch.Tensor, group_size: int, in_features: int) -> bool:
    """Whether w4a16_mma takes this call: 16-bit activations of at most MAX_ROWS rows, groups of a
    multiple of 128 values, and K a whole number of groups."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and rows <= MAX_ROWS
        and group_size % TILE_K == 0
        and in_features % group_size == 0
    )


def w4a16_mma(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    swap: bool | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 or fp16, at most MAX_ROWS rows) @ W^T -> [..., N] in x's dtype. swap: the
    weight as the MMA's first operand; by default where programs take 64 weight rows (faster there,
    slower at 128)."""
    k = x.shape[-1]
    if not supports(x, group_size, k):
        raise ValueError(
            f"w4a16_mma takes bf16/fp16 activations of at most {MAX_ROWS} rows and groups of a multiple of "
            f"{TILE_K} dividing K; got {x.dtype}, {x.numel() // max(k, 1)} rows, group {group_size}, K {k}"
        )
    x2 = as_rows(x)
    m, n = x2.shape[0], w_packed.shape[0]
    config = config or default_config(n, k, x.device, m=m)
    zero_arg = zero if zero is not None else scale
    block_m = block_rows(m)
    swap = config.block_n <= 64 if swap is None else swap

    def launch(out: torch.Tensor, grid: tuple[int, int]) -> None:
        _w4a16_mma_kernel[(*grid, triton.cdiv(m, block_m))](
            x2, w_packed, scale, zero_arg, out, m, n, k, x2.stride(0), w_packed.stride(0), scale.stride(0),
            zero.stride(0) if zero is not None else 0, out.stride(0),
            GROUP=group_size, HAS_ZERO=zero is not None, BLOCK_M=block_m, BLOCK_N=config.block_n,
            WORDS=TILE_K // 8,
            SPLIT_K=config.split_k, ASM=not INTERPRETED,
            BF16=x.dtype == torch.bfloat16, SWAP=swap, num_warps=config.num_warps,
            num_stages=config.num_stages, **pdl.launch_args(x2),
        )  # fmt: skip

    return launch_over_rows(x, m, n, config, launch, bias)
