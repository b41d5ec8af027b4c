"""The one-row kernels (batch-1 decode) behind kernels/skinny_gemm.py's wrappers: one row of activations
against a 4-bit, FP8 or dense 16-bit weight, the products summed elementwise in an fp32 tile and reduced
once at the end, with no tensor-core tile to pad. Also the helpers the several-row kernels share.

A 4-bit value becomes a float by the exponent trick (0x4B000000 | q is 2^23 + q as fp32), not an
int-to-float conversion, which runs at a quarter of the FMA rate; here the value is not even shifted
down (see the kernel). Measured on an H200 (benchmarks/gpu/bench_quant_gemm.py): the 4-bit kernel is
bound by these integer and float instructions, not by memory, so every one out of the inner loop
counts. SPLIT_K > 1 sums partial products in an fp32 buffer with atomic adds, for matrices with too few
rows to fill the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels import pdl

# The exponent trick's bit pattern: 0x4B000000 | m is the fp32 2^23 + m for m < 2^23. Passed as a kernel
# argument, not a literal, so that it sits in a register: then (word & mask) | magic is one LOP3 (three
# operands, one immediate) instead of two.
MAGIC = 0x4B000000


@triton.jit
def store(out, result, rm, rn, m_ok, n_ok, stride_om, SPLIT_K: tl.constexpr):
    """result [BLOCK_M, BLOCK_N] into out's rows rm and columns rn: stored, or with split K added to the
    fp32 partial sums of the other programs."""
    o_mask = m_ok[:, None] & n_ok[None, :]
    o_offsets = rm[:, None] * stride_om + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out + o_offsets, result.to(out.dtype.element_ty), mask=o_mask)
    else:
        tl.atomic_add(out + o_offsets, result, mask=o_mask)


@triton.jit
def span(units, pid_k, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """[lo, hi) of the `units` (words or values along K) that split pid_k sums, in whole blocks."""
    span = tl.cdiv(tl.cdiv(units, SPLIT_K), BLOCK) * BLOCK
    lo = pid_k * span
    return lo, tl.minimum(lo + span, units)


@triton.jit
def _program_rows(w, N, units, stride_wn, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr, SPLIT_K: tl.constexpr,
                  PDL: tl.constexpr, EARLY: tl.constexpr):  # fmt: skip
    """A one-row program's output rows, whether each is real, the pointers to the first BLOCK units of its
    weight rows (rows past N read row N-1's copy, never stored) and its [lo, hi) along K; then the PDL
    wait, after which the program may read x (with EARLY the caller waits, after loading its first
    weight tile: the weights are no earlier kernel's output)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    base = w + (rn % N)[:, None] * stride_wn + tl.arange(0, BLOCK)[None, :]
    lo, hi = span(units, tl.program_id(1), SPLIT_K, BLOCK)
    if not EARLY:
        pdl.start(PDL)
    return rn, rn < N, base, lo, hi


@triton.jit
def w4a16_gemv_kernel(
    x,
    w_packed,
    scale,
    zero,
    out,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_zn,
    magic,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SUB: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UNROLL: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row of x against BLOCK_N rows of the packed weight; BLOCK_W words (8 values each) per step.

    Per weight value the loop spends three instructions: LOP3 (the nibble where it lies, OR the magic),
    FFMA ((2^23 + q 2^sh) 2^-sh - (2^23 + 8) = q - 8, exact), FFMA (times x_i into the tile's sum). The
    scale is applied once per SUB words (one group), the zero point once per SUB words through the sum
    of x. With EVEN_K no load is masked along K (the loads stay 16-byte vectors); rows past N read row
    N-1's copy and are not stored."""
    rn, n_ok, base, lo, hi = _program_rows(
        w_packed, N, tl.cdiv(K, 8), stride_wn, BLOCK_N, BLOCK_W, SPLIT_K, PDL, False
    )
    rn_ld = rn % N
    cols = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N, BLOCK_W // SUB], dtype=tl.float32)
    for w0 in tl.range(lo, hi, BLOCK_W, loop_unroll_factor=UNROLL):
        w0 = tl.multiple_of(w0, BLOCK_W)
        rw = w0 + cols
        if EVEN_K:
            packed = tl.load(base + w0)
        else:
            packed = tl.load(base + w0, mask=(rw < hi)[None, :], other=0)
        # Nibble i is read where it lies, not shifted down: sh = 4i stays below 20 (the mantissa), so
        # nibbles 5-7 come from the word shifted right by 12.
        high = packed >> 12
        part = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_W], dtype=tl.float32)
        for i in tl.static_range(8):
            k = rw * 8 + i
            if EVEN_K:
                xi = tl.load(x + k).to(tl.float32)
            else:
                xi = tl.load(x + k, mask=k < K, other=0.0).to(tl.float32)
            if i < 5:
                bits = (packed & (0xF << (4 * i))) | magic
                down = 1.0 / (1 << (4 * i))
            else:
                bits = (high & (0xF << (4 * i - 12))) | magic
                down = 1.0 / (1 << (4 * i - 12))
            if HAS_ZERO:  # q; the zero (stored minus 8) leaves through x's sum below
                q = bits.to(tl.float32, bitcast=True) * down - 8388608.0 * down
                x_sum += xi
            else:  # q - 8
                q = bits.to(tl.float32, bitcast=True) * down - (8388608.0 * down + 8.0)
            part += q * xi[None, :]
        if SUB > 1:
            part = tl.sum(tl.reshape(part, (BLOCK_N, BLOCK_W // SUB, SUB)), axis=2)
            x_sum = tl.sum(tl.reshape(x_sum, (BLOCK_W // SUB, SUB)), axis=1)
        rs = w0 + tl.arange(0, BLOCK_W // SUB) * SUB
        group = (rs * 8) // GROUP
        s_ok = (rs < hi)[None, :]
        s = tl.load(scale + rn_ld[:, None] * stride_sn + group[None, :], mask=s_ok, other=0.0)
        if HAS_ZERO:
            z = tl.load(zero + rn_ld[:, None] * stride_zn + group[None, :], mask=s_ok, other=0)
            part -= (z.to(tl.float32) + 8.0) * x_sum[None, :]
        acc += s.to(tl.float32) * part
    rm = tl.arange(0, 1)
    store(out, tl.sum(acc, axis=1)[None, :], rm, rn, rm < 1, n_ok, 0, SPLIT_K)


@triton.jit
def w8a16_gemv_kernel(
    x,
    w,
    w_scale,
    out,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UNROLL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    VEC: tl.constexpr,
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    """ROWS rows of x (one, or a few: each weight tile converted once for all of them) against BLOCK_N
    rows of e4m3 weights (HAS_SCALE: the row scale applied to the sum) or of 16-bit ones (no scale; VEC
    values to a 16-byte load: 16 or 8): products summed in fp32 registers and reduced across threads once
    at the end. (A tile of 8-bit values carried across iterations, as a register prefetch would, is held
    a byte per register: the repacking costs more than the overlap gains, seen in the SASS. Unrolling
    puts the loads in flight together instead.) EARLY (EVEN_K, under PDL): the first tile of weights is
    loaded before the PDL wait, while the kernel before still runs, and multiplied once x may be read;
    the loop takes the rest."""
    rn, n_ok, base, lo, hi = _program_rows(w, N, K, stride_wn, BLOCK_N, BLOCK_K, SPLIT_K, PDL, EARLY)
    rn_ld = rn % N
    cols = tl.arange(0, BLOCK_K)
    accs = ()
    for _ in tl.static_range(ROWS):
        accs = accs + (tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32),)
    start = lo
    if EARLY:
        first = tl.load(base + lo)
        pdl.start(PDL)
        accs = _w8_step(first, x, stride_xm, lo + cols, hi, accs, ROWS, BLOCK_N, BLOCK_K, VEC, True)
        start = lo + BLOCK_K
    for k0 in tl.range(start, hi, BLOCK_K, loop_unroll_factor=UNROLL):
        k0 = tl.multiple_of(k0, BLOCK_K)
        rk = k0 + cols
        if EVEN_K:
            wt = tl.load(base + k0)
        else:
            wt = tl.load(base + k0, mask=(rk < hi)[None, :], other=0.0)
        accs = _w8_step(wt, x, stride_xm, rk, hi, accs, ROWS, BLOCK_N, BLOCK_K, VEC, EVEN_K)
    rm = tl.arange(0, 1)
    for r in tl.static_range(ROWS):
        result = tl.sum(accs[r], axis=1)
        if HAS_SCALE:
            result *= tl.load(w_scale + rn_ld)
        store(out + r * stride_om, result[None, :], rm, rn, rm < 1, n_ok, 0, SPLIT_K)


@triton.jit
def _w8_step(wt, x, stride_xm, rk, hi, accs, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             VEC: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """One step of w8a16_gemv_kernel: the weight tile wt [BLOCK_N, BLOCK_K] (columns rk) in fp32, times
    each row's activations, summed into that row's accumulator; returns the accumulators."""
    w32 = wt.to(tl.float32)
    new_accs = ()
    for r in tl.static_range(ROWS):
        # x is loaded as a [BLOCK_N, BLOCK_K] tile (each thread reads the x values of its own weight
        # values; copies for other rows hit L1): in the weight's layout, with no exchange through
        # shared memory and no barrier, which would keep the unrolled iterations' loads apart.
        x_ptr = x + r * stride_xm + tl.broadcast_to(rk[None, :], (BLOCK_N, BLOCK_K))
        if EVEN_K:
            xk = tl.load(x_ptr)
        else:
            xk = tl.load(x_ptr, mask=(rk < hi)[None, :], other=0.0)
        # Each thread holds VEC consecutive values (one 16-byte load): summed there, the tile that is
        # carried across iterations is a VEC-th of the loaded one.
        product = w32 * xk.to(tl.float32)
        new_accs = new_accs + (accs[r] + tl.sum(tl.reshape(product, (BLOCK_N, BLOCK_K // VEC, VEC)), axis=2),)
    return new_accs


# One word of eight 4-bit values against its eight activations in each of ROWS rows, in packed 16-bit
# halves (PTX, sm_80+): $ROWS the word; then for each row r the activations (8w + i, 8w + i + 4) as f16x2
# pairs, i = 0..3; $r the fp32 sum of row r's eight products. LOP3 puts nibbles i and i + 4 into two fp16
# mantissas over 1024 (for i = 1 and 3 four bits up: over 1024 in steps of 16); one packed subtract (or,
# four bits up, a packed FMA by 1/16) takes 1024 + 8 away; four packed FMAs a row sum the products, and
# three instructions take the two halves' sums to fp32: 16 instructions a word for one row, where fp32
# needs 24, and 7 for each further row (the word is unpacked once).
def _f16x2_word_asm(rows: int) -> str:
    word = f"${rows}"
    lines = [
        "{", ".reg .b32 w, q0, q1, q2, q3, acc, c, s, o;", ".reg .b16 l, h;", ".reg .f32 fl, fh;",
        "mov.b32 c, 0x64086408;", "mov.b32 s, 0x2c002c00;", "mov.b32 o, 0xd480d480;",
        f"lop3.b32 q0, {word}, 0x000f000f, 0x64006400, 0xea;",
        f"lop3.b32 q1, {word}, 0x00f000f0, 0x64006400, 0xea;",
        f"shr.b32 w, {word}, 8;",
        "lop3.b32 q2, w, 0x000f000f, 0x64006400, 0xea;", "lop3.b32 q3, w, 0x00f000f0, 0x64006400, 0xea;",
        "sub.rn.f16x2 q0, q0, c;", "fma.rn.f16x2 q1, q1, s, o;",
        "sub.rn.f16x2 q2, q2, c;", "fma.rn.f16x2 q3, q3, s, o;",
    ]  # fmt: skip
    for r in range(rows):
        x = [f"${rows + 1 + 4 * r + i}" for i in range(4)]
        lines += [
            f"mul.rn.f16x2 acc, q0, {x[0]};", f"fma.rn.f16x2 acc, q1, {x[1]}, acc;",
            f"fma.rn.f16x2 acc, q2, {x[2]}, acc;", f"fma.rn.f16x2 acc, q3, {x[3]}, acc;",
            "mov.b32 {l, h}, acc;", "cvt.f32.f16 fl, l;", "cvt.f32.f16 fh, h;", f"add.f32 ${r}, fl, fh;",
        ]  # fmt: skip
    return "\n".join(lines + ["}"])


# Rows of activations the packed kernel takes in one program (each word unpacked once for all of them).
F16X2_MAX_ROWS = 4
_F16X2_WORD_ASM = tl.constexpr(_f16x2_word_asm(1))
_F16X2_WORD_ASM_2 = tl.constexpr(_f16x2_word_asm(2))
_F16X2_WORD_ASM_3 = tl.constexpr(_f16x2_word_asm(3))
_F16X2_WORD_ASM_4 = tl.constexpr(_f16x2_word_asm(4))
# Two fp32 -> one f16x2 register: $1 in the low half, $2 in the high.
_F16X2_PAIR_ASM = tl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")
# The activations a step are scaled by a power of two that puts their largest magnitude in [128, 256):
# a product with q - 8 (|q - 8| <= 8) then stays under 2048 and a half's four-product sum under 8192,
# far from fp16's 65504, and values down to about 2^-21 of the largest stay normal.
F16X2_TOP = tl.constexpr(7)


@triton.jit
def _f16x2_pair(a, b, ASM: tl.constexpr):
    """fp32 a, b -> (fp16 a, fp16 b) as one int32 (a low) on the GPU; in the interpreter, the two fp16."""
    if ASM:
        return tl.inline_asm_elementwise(
            _F16X2_PAIR_ASM, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        return a.to(tl.float16), b.to(tl.float16)


@triton.jit
def _f16x2_words(packed, pairs, ROWS: tl.constexpr, ASM: tl.constexpr):
    """For each of ROWS rows, the fp32 sum of a word's eight products with that row's activation pairs
    (pairs[r], four f16x2 tensors; _f16x2_word_asm): a tuple of ROWS tensors. The interpreter does the
    same arithmetic in fp16 tensors (the products and the four-term sums in fp16, as the packed halves)."""
    if ASM:
        a = pairs[0]
        if ROWS == 1:
            sums = (tl.inline_asm_elementwise(
                _F16X2_WORD_ASM, "=f,r,r,r,r,r", [packed, a[0], a[1], a[2], a[3]],
                dtype=tl.float32, is_pure=True, pack=1,
            ),)  # fmt: skip
        elif ROWS == 2:
            b = pairs[1]
            sums = tl.inline_asm_elementwise(
                _F16X2_WORD_ASM_2, "=f,=f" + ",r" * 9,
                [packed, a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
            )  # fmt: skip
        elif ROWS == 3:
            b, c = pairs[1], pairs[2]
            sums = tl.inline_asm_elementwise(
                _F16X2_WORD_ASM_3, "=f,=f,=f" + ",r" * 13,
                [packed, a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3]],
                dtype=(tl.float32, tl.float32, tl.float32), is_pure=True, pack=1,
            )  # fmt: skip
        else:
            tl.static_assert(ROWS == 4, "the packed 4-bit kernel takes 1 to 4 rows")
            b, c, d = pairs[1], pairs[2], pairs[3]
            sums = tl.inline_asm_elementwise(
                _F16X2_WORD_ASM_4, "=f,=f,=f,=f" + ",r" * 17,
                [packed, a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3],
                 d[0], d[1], d[2], d[3]],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1,
            )  # fmt: skip
    else:
        sums = ()
        for r in tl.static_range(ROWS):
            low = tl.zeros(packed.shape, dtype=tl.float16)
            high = tl.zeros(packed.shape, dtype=tl.float16)
            for i in tl.static_range(4):
                pair = pairs[r][i]
                q_low = (((packed >> (4 * i)) & 0xF) - 8).to(tl.float16)
                q_high = (((packed >> (4 * i + 16)) & 0xF) - 8).to(tl.float16)
                low = (low + q_low * pair[0]).to(tl.float16)
                high = (high + q_high * pair[1]).to(tl.float16)
            sums = sums + (low.to(tl.float32) + high.to(tl.float32),)
    return sums


@triton.jit
def _x_step(x, rw, K, hi, EVEN_K: tl.constexpr):
    """The activations of words rw, as loaded: eight tensors, value 8w + i in the i-th."""
    xs = ()
    for i in tl.static_range(8):
        k = rw * 8 + i
        if EVEN_K:
            xs = xs + (tl.load(x + k),)
        else:
            xs = xs + (tl.load(x + k, mask=(rw < hi) & (k < K), other=0.0),)
    return xs


@triton.jit
def w4a16_gemv_f16x2_kernel(
    x,
    w_packed,
    scale,
    zero,
    out,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_om,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SUB: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UNROLL: tl.constexpr,
    ASM: tl.constexpr,
    PREFETCH: tl.constexpr,
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    """w4a16_gemv_kernel's job for ROWS (1 to F16X2_MAX_ROWS) rows of 16-bit x against BLOCK_N rows of the
    packed weight, BLOCK_W words a step, in packed fp16 arithmetic: 16 instructions a word of eight
    values for the first row (_f16x2_word_asm) where the fp32 kernel spends three a value, 7 for each
    further row. Each step scales each row's activations by a power of two a group's words (F16X2_TOP)
    and makes their f16x2 pairs once for all BLOCK_N weight rows; a word's eight products are summed in
    fp16, everything past the word in fp32, unscaled with the group's scale."""
    rn, n_ok, base, lo, hi = _program_rows(
        w_packed, N, tl.cdiv(K, 8), stride_wn, BLOCK_N, BLOCK_W, SPLIT_K, PDL, EARLY
    )
    rn_ld = rn % N
    cols = tl.arange(0, BLOCK_W)
    accs = ()
    for _ in tl.static_range(ROWS):
        accs = accs + (tl.zeros([BLOCK_N, BLOCK_W // SUB], dtype=tl.float32),)
    if PREFETCH:  # (EVEN_K only) the next step's words and activations are loaded before this step's math
        ahead = tl.load(base + lo)
        if EARLY:  # (PREFETCH only) the first words before the PDL wait, x after it
            pdl.start(PDL)
        x_ahead = _x_rows(x, stride_xm, lo + cols, K, hi, ROWS, EVEN_K)
    for w0 in tl.range(lo, hi, BLOCK_W, loop_unroll_factor=UNROLL):
        w0 = tl.multiple_of(w0, BLOCK_W)
        rw = w0 + cols
        if PREFETCH:
            packed = ahead
            x_raw = x_ahead
            following = w0 + BLOCK_W
            following = tl.where(following < hi, following, lo)  # past the end: a harmless reload
            ahead = tl.load(base + following)
            x_ahead = _x_rows(x, stride_xm, following + cols, K, hi, ROWS, EVEN_K)
        elif EVEN_K:
            packed = tl.load(base + w0)
            x_raw = _x_rows(x, stride_xm, rw, K, hi, ROWS, EVEN_K)
        else:
            packed = tl.load(base + w0, mask=(rw < hi)[None, :], other=0)
            x_raw = _x_rows(x, stride_xm, rw, K, hi, ROWS, EVEN_K)
        pairs = ()
        downs = ()
        x_sums = ()
        for r in tl.static_range(ROWS):
            row_pairs, down, x_sum = _f16x2_activations(x_raw[r], BLOCK_N, BLOCK_W, SUB, HAS_ZERO, ASM)
            pairs = pairs + (row_pairs,)
            downs = downs + (down,)
            x_sums = x_sums + (x_sum,)
        parts = _f16x2_words(packed, pairs, ROWS, ASM)
        rs = w0 + tl.arange(0, BLOCK_W // SUB) * SUB
        group = (rs * 8) // GROUP
        s_ok = (rs < hi)[None, :]
        s = tl.load(scale + rn_ld[:, None] * stride_sn + group[None, :], mask=s_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:  # stored minus 8: q - zero = (q - 8) - stored
            z = tl.load(zero + rn_ld[:, None] * stride_zn + group[None, :], mask=s_ok, other=0).to(tl.float32)
        new_accs = ()
        for r in tl.static_range(ROWS):
            part = parts[r]
            if SUB > 1:
                part = tl.sum(tl.reshape(part, (BLOCK_N, BLOCK_W // SUB, SUB)), axis=2)
            part = part * downs[r][None, :]
            if HAS_ZERO:
                part -= z * x_sums[r][None, :]
            new_accs = new_accs + (accs[r] + s * part,)
        accs = new_accs
    rm = tl.arange(0, 1)
    for r in tl.static_range(ROWS):
        store(out + r * stride_om, tl.sum(accs[r], axis=1)[None, :], rm, rn, rm < 1, n_ok, 0, SPLIT_K)


@triton.jit
def _x_rows(x, stride_xm, rw, K, hi, ROWS: tl.constexpr, EVEN_K: tl.constexpr):
    """_x_step for each of ROWS rows of x."""
    rows = ()
    for r in tl.static_range(ROWS):
        rows = rows + (_x_step(x + r * stride_xm, rw, K, hi, EVEN_K),)
    return rows


@triton.jit
def _f16x2_activations(x_raw, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, SUB: tl.constexpr,
                       HAS_ZERO: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """One row's activations of a step (eight tensors, _x_step) -> its four f16x2 pair tensors broadcast
    over the BLOCK_N weight rows (values 8w + i and 8w + i + 4), the powers of two that undo each SUB
    words' scaling, and each SUB words' sum of x (zero points)."""
    xs = ()
    top = tl.zeros([BLOCK_W], dtype=tl.float32)
    for i in tl.static_range(8):
        xi = x_raw[i].to(tl.float32)
        xs = xs + (xi,)
        top = tl.maximum(top, tl.abs(xi))
    # 2^(F16X2_TOP - e) for the largest |x| in [2^e, 2^(e+1)) of each SUB words (the words one scale
    # covers, summed together), exponents kept in range.
    chunk_top = tl.max(tl.reshape(top, (BLOCK_W // SUB, SUB)), axis=1)
    exponent = ((chunk_top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    shift = tl.minimum(tl.maximum(F16X2_TOP - exponent, -100), 100)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    up = tl.reshape(tl.broadcast_to(((shift + 127) << 23)[:, None], (BLOCK_W // SUB, SUB)), (BLOCK_W,))
    up = up.to(tl.float32, bitcast=True)
    pairs = ()
    x_sum = tl.zeros([BLOCK_W], dtype=tl.float32)
    for i in tl.static_range(4):
        pair = _f16x2_pair(xs[i] * up, xs[i + 4] * up, ASM)
        if HAS_ZERO:
            x_sum += xs[i] + xs[i + 4]
        if ASM:
            pairs = pairs + (tl.broadcast_to(pair[None, :], (BLOCK_N, BLOCK_W)),)
        else:
            pairs = pairs + ((pair[0][None, :], pair[1][None, :]),)
    if SUB > 1:
        x_sum = tl.sum(tl.reshape(x_sum, (BLOCK_W // SUB, SUB)), axis=1)
    return pairs, down, x_sum
