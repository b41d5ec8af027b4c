"""The 4-bit one-row GEMV in packed fp16 halves, for one or a few rows of 16-bit activations
(skinny_gemm.w4a16_skinny launches it; fp32 activations take kernels/gemv.py's fp32 kernel). The layout
is kernels/skinny_gemm.py's: int32 [N, K/8] words, value 8w + i in bits 4i..4i+3 stored as q + 8,
group scales [N, K/group], optional int8 zero points stored minus 8.

Each word's eight values are unpacked into fp16 pairs with LOP3 over a magic exponent and multiplied by
the activations' f16x2 pairs in packed FMAs (inline PTX, _f16x2_word_asm); before that each row's
activations are scaled by a power of two per group's words, so that fp16 cannot overflow whatever bf16
carries. A word's products are summed in fp16, everything past the word in fp32. The interpreter (no
PTX) does the same arithmetic in fp16 tensors. Measured on an H200 in docs/performance.md: 1.45-2.52
TB/s of int4 bytes on Llama-3.1-8B's linears, 1.1-1.3x the fp32 kernel at their own tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels import gemv, pdl


# One word of eight 4-bit values against its eight activations in each of ROWS rows, in packed 16-bit
# halves (PTX, sm_80+): $ROWS the word; then for each row r the activations (8w + i, 8w + i + 4) as f16x2
# pairs, i = 0..3; $r the fp32 sum of row r's eight products. LOP3 puts nibbles i and i + 4 into two fp16
# mantissas over 1024 (for i = 1 and 3 four bits up: over 1024 in steps of 16); one packed subtract (or,
# four bits up, a packed FMA by 1/16) takes 1024 + 8 away; four packed FMAs a row sum the products, and
# three instructions take the two halves' sums to fp32: 16 instructions a word for one row, where fp32
# needs 24, and 7 for each further row (the word is unpacked once). Two words at once (PAIRED) share the
# conversion: 29 instructions for two words of one row; a half's eight-product sum stays under 16,384.
@triton.constexpr_function
def _f16x2_word_asm(rows, words=1):
    """The PTX above for `words` adjacent words (1, or 2: PAIRED): each word unpacked into its own
    registers, then for each row all their products in one f16x2 sum and one conversion to fp32.
    Operands: ROWS fp32 outputs, the words, then for each row each word's four pairs."""
    unpacked = ("q", "p")[:words]
    lines = [
        "{", ".reg .b32 w, q0, q1, q2, q3, p0, p1, p2, p3, acc, c, s, o;", ".reg .b16 l, h;",
        ".reg .f32 fl, fh;", "mov.b32 c, 0x64086408;", "mov.b32 s, 0x2c002c00;", "mov.b32 o, 0xd480d480;",
    ]  # fmt: skip
    for j, q in enumerate(unpacked):
        word = f"${rows + j}"
        lines += [
            f"lop3.b32 {q}0, {word}, 0x000f000f, 0x64006400, 0xea;",
            f"lop3.b32 {q}1, {word}, 0x00f000f0, 0x64006400, 0xea;",
            f"shr.b32 w, {word}, 8;",
            f"lop3.b32 {q}2, w, 0x000f000f, 0x64006400, 0xea;",
            f"lop3.b32 {q}3, w, 0x00f000f0, 0x64006400, 0xea;",
            f"sub.rn.f16x2 {q}0, {q}0, c;", f"fma.rn.f16x2 {q}1, {q}1, s, o;",
            f"sub.rn.f16x2 {q}2, {q}2, c;", f"fma.rn.f16x2 {q}3, {q}3, s, o;",
        ]  # fmt: skip
    for r in range(rows):
        x = [f"${rows + words + 4 * words * r + i}" for i in range(4 * words)]
        products = [f"{q}{i}" for q in unpacked for i in range(4)]
        lines.append(f"mul.rn.f16x2 acc, {products[0]}, {x[0]};")
        lines += [f"fma.rn.f16x2 acc, {q}, {xi}, acc;" for q, xi in zip(products[1:], x[1:])]
        lines += ["mov.b32 {l, h}, acc;", "cvt.f32.f16 fl, l;", "cvt.f32.f16 fh, h;"]
        lines.append(f"add.f32 ${r}, fl, fh;")
    return "\n".join(lines + ["}"])


@triton.constexpr_function
def _f16x2_word_constraints(rows, words=1):
    """_f16x2_word_asm's operands: ROWS fp32 outputs, the words and four pairs a word a row."""
    return ",".join(["=f"] * rows + ["r"] * (words + 4 * words * rows))


@triton.constexpr_function
def _fp32s(rows):
    return (tl.float32,) * rows


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
def _f16x2_words(
    packed, pairs, ROWS: tl.constexpr, BLOCK_W: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr
):  # fmt: skip
    """For each of ROWS rows, the fp32 sum of a word's eight products with that row's activation pairs
    (pairs[r], four f16x2 tensors; _f16x2_word_asm): a tuple of ROWS tensors [BLOCK_N, BLOCK_W]; WORDS 2
    (PAIRED): of adjacent words 2j and 2j + 1 together, [BLOCK_N, BLOCK_W // 2]. The interpreter (no PTX)
    does the same arithmetic in fp16 tensors (the products and the sums in fp16, as the packed halves)."""
    if WORDS == 2:
        words = _halves(packed, BLOCK_W)
    else:
        words = (packed,)
    if ASM:
        args = words
        for r in tl.static_range(ROWS):
            for w in tl.static_range(WORDS):
                for i in tl.static_range(4):
                    args = args + (_columns(pairs[r][i], w, BLOCK_W, WORDS),)
        sums = tl.inline_asm_elementwise(
            _f16x2_word_asm(ROWS, WORDS),
            _f16x2_word_constraints(ROWS, WORDS),
            args,
            dtype=_fp32s(ROWS),
            is_pure=True,
            pack=1,
        )
    else:
        sums = ()
        for r in tl.static_range(ROWS):
            low = tl.zeros(words[0].shape, dtype=tl.float16)
            high = tl.zeros(words[0].shape, dtype=tl.float16)
            for w in tl.static_range(WORDS):
                for i in tl.static_range(4):
                    x_low = _columns(pairs[r][i][0], w, BLOCK_W, WORDS)
                    x_high = _columns(pairs[r][i][1], w, BLOCK_W, WORDS)
                    q_low = (((words[w] >> (4 * i)) & 0xF) - 8).to(tl.float16)
                    q_high = (((words[w] >> (4 * i + 16)) & 0xF) - 8).to(tl.float16)
                    low = (low + q_low * x_low).to(tl.float16)
                    high = (high + q_high * x_high).to(tl.float16)
            sums = sums + (low.to(tl.float32) + high.to(tl.float32),)
    return sums


@triton.jit
def _halves(t, BLOCK_W: tl.constexpr):
    """[..., BLOCK_W] -> (its even columns, its odd columns), each [..., BLOCK_W // 2]."""
    return tl.split(tl.reshape(t, (t.shape[0], BLOCK_W // 2, 2)))


@triton.jit
def _columns(t, w: tl.constexpr, BLOCK_W: tl.constexpr, WORDS: tl.constexpr):
    """t itself (WORDS 1), else its even (w 0) or odd (w 1) columns: word w of each pair."""
    if WORDS == 1:
        columns = t
    else:
        even, odd = _halves(t, BLOCK_W)
        if w == 0:
            columns = even
        else:
            columns = odd
    return columns


@triton.jit
def _x_step(x, rw, K, hi, EVEN_K: tl.constexpr, WIDE_X: tl.constexpr):
    """The activations of words rw, as loaded: eight tensors, value 8w + i in the i-th. WIDE_X (EVEN_K): a
    word's eight loaded as one 16-byte vector and split apart in registers, instead of eight loads."""
    if WIDE_X:
        words: tl.constexpr = rw.shape[0]
        wide = tl.load(x + (rw * 8)[:, None] + tl.arange(0, 8)[None, :])
        even, odd = tl.split(tl.reshape(wide, (words, 4, 2)))  # values 0, 2, 4, 6 and 1, 3, 5, 7
        v04, v26 = tl.split(tl.reshape(even, (words, 2, 2)))
        v15, v37 = tl.split(tl.reshape(odd, (words, 2, 2)))
        v0, v4 = tl.split(v04)
        v1, v5 = tl.split(v15)
        v2, v6 = tl.split(v26)
        v3, v7 = tl.split(v37)
        xs = (v0, v1, v2, v3, v4, v5, v6, v7)
    else:
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
    GATED: tl.constexpr,
    PDL: tl.constexpr,
    PAIRED: tl.constexpr = False,
    WIDE_X: tl.constexpr = False,
):
    """w4a16_gemv_kernel's job for ROWS rows of 16-bit x (one, or a few) against BLOCK_N rows of the
    packed weight, BLOCK_W words a step, in packed fp16 arithmetic: 16 instructions a word of eight
    values for the first row (_f16x2_word_asm) where the fp32 kernel spends three a value, 7 for each
    further row. Each step scales each row's activations by a power of two a group's words (F16X2_TOP)
    and makes their f16x2 pairs once for all BLOCK_N weight rows; a word's eight products are summed in
    fp16, everything past the word in fp32, unscaled with the group's scale. GATED as in
    gemv.w8a16_gemv_kernel. PAIRED (SUB even): two adjacent words' products summed in fp16 together,
    one conversion to fp32 for the two (_f16x2_words of two). WIDE_X (EVEN_K only): each word's eight
    activations in one vector load (_x_step)."""
    rn_ld, rn, n_ok, base, lo, hi = gemv.program_rows(
        w_packed, N, tl.cdiv(K, 8), stride_wn, BLOCK_N, BLOCK_W, SPLIT_K, PDL, EARLY, GATED
    )
    cols = tl.arange(0, BLOCK_W)
    scale_rows = scale + rn_ld[:, None] * stride_sn  # each weight row's scales (and zero points)
    zero_rows = zero + rn_ld[:, None] * stride_zn
    accs = ()
    for _ in tl.static_range(ROWS):
        accs = accs + (tl.zeros([BLOCK_N, BLOCK_W // SUB], dtype=tl.float32),)
    if PREFETCH:  # (EVEN_K only) the next step's words and activations are loaded before this step's math
        ahead = tl.load(base + lo)
        if EARLY:  # (PREFETCH only) the first words before the PDL wait, x after it
            pdl.start(PDL)
        x_ahead = _x_rows(x, stride_xm, lo + cols, K, hi, ROWS, EVEN_K, WIDE_X)
    for w0 in tl.range(lo, hi, BLOCK_W, loop_unroll_factor=UNROLL):
        w0 = tl.multiple_of(w0, BLOCK_W)
        rw = w0 + cols
        if PREFETCH:
            packed = ahead
            x_raw = x_ahead
            following = w0 + BLOCK_W
            following = tl.where(following < hi, following, lo)  # past the end: a harmless reload
            ahead = tl.load(base + following)
            x_ahead = _x_rows(x, stride_xm, following + cols, K, hi, ROWS, EVEN_K, WIDE_X)
        elif EVEN_K:
            packed = tl.load(base + w0)
            x_raw = _x_rows(x, stride_xm, rw, K, hi, ROWS, EVEN_K, WIDE_X)
        else:
            packed = tl.load(base + w0, mask=(rw < hi)[None, :], other=0)
            x_raw = _x_rows(x, stride_xm, rw, K, hi, ROWS, EVEN_K, WIDE_X)
        pairs = ()
        downs = ()
        x_sums = ()
        for r in tl.static_range(ROWS):
            row_pairs, down, x_sum = _f16x2_activations(x_raw[r], BLOCK_N, BLOCK_W, SUB, HAS_ZERO, ASM)
            pairs = pairs + (row_pairs,)
            downs = downs + (down,)
            x_sums = x_sums + (x_sum,)
        # PAIRED: each pair of words summed together (SUB even: a pair never straddles two groups).
        parts = _f16x2_words(packed, pairs, ROWS, BLOCK_W, 2 if PAIRED else 1, ASM)
        rs = w0 + tl.arange(0, BLOCK_W // SUB) * SUB
        group = (rs * 8) // GROUP
        # With EVEN_K every step is whole: no mask (its compares and selects were ~6% of the loop).
        if EVEN_K:
            s = tl.load(scale_rows + group[None, :]).to(tl.float32)
            if HAS_ZERO:  # stored minus 8: q - zero = (q - 8) - stored
                z = tl.load(zero_rows + group[None, :]).to(tl.float32)
        else:
            s_ok = (rs < hi)[None, :]
            s = tl.load(scale_rows + group[None, :], mask=s_ok, other=0.0).to(tl.float32)
            if HAS_ZERO:
                z = tl.load(zero_rows + group[None, :], mask=s_ok, other=0).to(tl.float32)
        per_sub: tl.constexpr = SUB // 2 if PAIRED else SUB  # parts' columns a group's words fill
        new_accs = ()
        for r in tl.static_range(ROWS):
            part = parts[r]
            if per_sub > 1:
                part = tl.sum(tl.reshape(part, (BLOCK_N, BLOCK_W // SUB, per_sub)), axis=2)
            part = part * downs[r][None, :]
            if HAS_ZERO:
                part -= z * x_sums[r][None, :]
            new_accs = new_accs + (accs[r] + s * part,)
        accs = new_accs
    for r in tl.static_range(ROWS):
        result = tl.sum(accs[r], axis=1)
        gemv.store_row(out + r * stride_om, result, rn, n_ok, N // 2, SPLIT_K, GATED, BLOCK_N // 2)


@triton.jit
def _x_rows(x, stride_xm, rw, K, hi, ROWS: tl.constexpr, EVEN_K: tl.constexpr, WIDE_X: tl.constexpr):
    """_x_step for each of ROWS rows of x."""
    rows = ()
    for r in tl.static_range(ROWS):
        rows = rows + (_x_step(x + r * stride_xm, rw, K, hi, EVEN_K, WIDE_X),)
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
