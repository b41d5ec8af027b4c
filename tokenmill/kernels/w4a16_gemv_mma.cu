// The 4-bit GEMV on the tensor cores for 1 to 8 rows of 16-bit activations (kernels/w4a16_gemv_cuda.py
// compiles and launches it; NVRTC, no headers). Layout as kernels/skinny_gemm.py's w4a16_skinny: int32
// [N, K/8] words, value 8w + i in bits 4i..4i+3 stored as q + 8 (or, with zero points, unsigned); group
// scales [N, K/group]; optional int8 zero points [N, K/group] stored minus 8.
//
// A warp multiplies 16 weight rows (A, m16n8k16's rows) by the activations (B, one column a row of x)
// over chunks of 128 values along K. Lane (g, t) = (lane / 4, lane % 4) loads 16 bytes of row g and 16
// of row g + 8: words 4t..4t+3 of the chunk, no shuffle. The MMA's sum over its 16 k-slots may take the
// values in any order that A and B share, so word j of every lane feeds two MMAs: nibbles (0, 4) and
// (1, 5) the first's slots (2t, 2t+1) and (2t+8, 2t+9), nibbles (2, 6) and (3, 7) the second's. One LOP3
// puts two nibbles into a 16-bit pair over a magic exponent, one packed FMA takes the magic and the zero
// away (exact: small integers), and B's pairs are the lane's 16 loaded activations regrouped by PRMT: 11
// instructions a word a row for the values where the CUDA-core kernels spend 16-28, and the products
// summed in fp32 by the tensor core. A chunk's eight MMAs start from zero and the sum is scaled once by
// its group's scale (groups a multiple of 128), so the weights are never rounded to 16 bits.
//
// Addresses are kept running (pointers advanced by a constant a chunk, the ring's shared address computed
// once, a chunk's group by a shift): recomputed for every copy and load they were ~96 of the loop's 390
// sm_90 instructions an iteration at gate+up's tile, 317 now, and the kernel 10-12% faster on each of
// the 8B shapes at one row (H100, 2026-12-07). LEAN and UNROLL 2 (below) took as many again away and
// gained nothing or lost there: fewer instructions alone do not make it faster.
//
// A block's warps take the chunks of the same rows in turn and add their sums in shared memory. Each
// warp streams its chunks through a ring of STAGES slots in shared memory with cp.async, STAGES - 1 in
// flight and no registers held by them; the first are requested before the PDL wait (no kernel writes
// the weights), x after it, a chunk ahead in registers. (On the H200 the ring's depth, 1 to 7 chunks in
// flight, and the first version's one chunk ahead in registers all read gate+up at ~2.5 TB/s: the bytes
// in flight are not what bounds it; docs/performance.md.)
//
// LEAN takes the magic and the zero point off the chunk's sums instead of off each pair: the MMAs multiply
// the LOP3's pairs (magic + stored nibble, exact) and the chunk's sum is d - (magic + offset) * sum(x),
// sum(x) by eight more MMAs a chunk against a tile of ones (shared by the block's tiles of a warp). One
// instruction a pair fewer (four a word a row; ~2/3 of the dequantizing left), at the cost of a
// cancellation in fp32: the sums are ~17x (bf16) or ~130x (fp16) the result's size, a relative error
// near 1e-6, far under the 16-bit output's rounding. On the H100 it is no faster (within 2%); off by
// default until an H200 says otherwise.
//
// Defines: BF16 (x, out: 1 bf16, 0 fp16), SCALE (0 bf16, 1 fp16, 2 fp32), HAS_ZERO, GATED (the weight is
// gate || up, N_OUT rows each; a tile's rows g are gate rows, g + 8 the same outputs' up rows, stored as
// silu(gate) * up with the separate launches' roundings), WARPS, TILES (16-row tiles a block), STAGES
// (ring slots a warp, >= 2), LEAN, UNROLL (chunks an iteration of the main loop: 1 or 2). Dynamic shared
// memory: WARPS * STAGES * TILES KB.

typedef unsigned int u32;
typedef unsigned short u16;

#if BF16
#define MAGIC_PAIR 0x43004300u   // 128.0 in both halves: 128 + nibble is exact
#define MAGIC_VALUE 128.f
#define NEG_MAGIC 0xC300u        // -(128 + z) = 0xC300 + z
#define ONE_PAIR 0x3F803F80u
#define MMA_TYPES "bf16.bf16"
#define FMA_PAIR "fma.rn.bf16x2"
#define CVT_OUT "cvt.rn.bf16.f32"
#else
#define MAGIC_PAIR 0x64006400u   // 1024.0
#define MAGIC_VALUE 1024.f
#define NEG_MAGIC 0xE400u
#define ONE_PAIR 0x3C003C00u
#define MMA_TYPES "f16.f16"
#define FMA_PAIR "fma.rn.f16x2"
#define CVT_OUT "cvt.rn.f16.f32"
#endif

#if SCALE == 2
typedef float scale_t;
#else
typedef u16 scale_t;
#endif

__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ float f16_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ float scale_value(scale_t s) {
#if SCALE == 2
  return s;
#elif SCALE == 0
  return bf16_to_float(s);
#else
  return f16_to_float(s);
#endif
}

__device__ __forceinline__ u16 to_out(float v) {
  u16 h;
  asm(CVT_OUT " %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

__device__ __forceinline__ float from_out(u16 h) { return BF16 ? bf16_to_float(h) : f16_to_float(h); }

// Nibbles 0 and 4 of w (bits 0-3, 16-19) as a 16-bit pair over the magic: magic + nibble, exact.
__device__ __forceinline__ u32 raw_pair(u32 w) {
  u32 v;
  asm("lop3.b32 %0, %1, 0x000f000f, %2, 0xea;" : "=r"(v) : "r"(w), "n"(MAGIC_PAIR));
  return v;
}

// The same pair minus the magic and the zero: neg = -(magic + zero) twice.
__device__ __forceinline__ u32 dequant_pair(u32 w, u32 neg) {
  u32 v = raw_pair(w);
  asm(FMA_PAIR " %0, %1, %2, %3;" : "=r"(v) : "r"(v), "r"(ONE_PAIR), "r"(neg));
  return v;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPES ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void copy16(u32 address, const u32* p) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(p) : "memory");
}

// The next chunk's words of rows g and g + 8 of each tile into the ring slot at shared address `slot`
// ([tile * 2 + row][lane], 16 bytes each); the row pointers then move on to this warp's next chunk.
__device__ __forceinline__ void copy_chunk(u32 slot, const u32* (&next_a)[TILES], const u32* (&next_b)[TILES]) {
#pragma unroll
  for (int i = 0; i < TILES; ++i) {
    copy16(slot + (2 * i) * 512, next_a[i]);
    copy16(slot + (2 * i + 1) * 512, next_b[i]);
    next_a[i] += 16 * WARPS;
    next_b[i] += 16 * WARPS;
  }
}

__device__ __forceinline__ uint4 load_x(const u16* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// A lane's 32 activations of a chunk from p (four words' eight), zeros for lanes past the batch's rows.
__device__ __forceinline__ void load_x_chunk(uint4 (&xv)[4], const u16* p, bool load) {
#pragma unroll
  for (int q = 0; q < 4; ++q) xv[q] = load ? load_x(p + 8 * q) : make_uint4(0, 0, 0, 0);
}

// A lane's B fragments of one word's eight activations xv: the pairs (0, 4), (1, 5), (2, 6), (3, 7).
__device__ __forceinline__ void x_fragments(u32 (&b)[4], uint4 xv) {
  b[0] = prmt(xv.x, xv.z, 0x5410);
  b[1] = prmt(xv.x, xv.z, 0x7632);
  b[2] = prmt(xv.y, xv.w, 0x5410);
  b[3] = prmt(xv.y, xv.w, 0x7632);
}

// One word of rows g (a) and g + 8 (b) against its eight activations xv: two MMAs into d.
__device__ __forceinline__ void word_mma(float (&d)[4], u32 a, u32 b, uint4 xv, u32 neg_a, u32 neg_b) {
  u32 xb[4];
  x_fragments(xb, xv);
  mma(d, dequant_pair(a, neg_a), dequant_pair(b, neg_b), dequant_pair(a >> 4, neg_a),
      dequant_pair(b >> 4, neg_b), xb[0], xb[1]);
  mma(d, dequant_pair(a >> 8, neg_a), dequant_pair(b >> 8, neg_b), dequant_pair(a >> 12, neg_a),
      dequant_pair(b >> 12, neg_b), xb[2], xb[3]);
}

// LEAN: one word of rows g (a) and g + 8 (b) as magic + stored nibble against its fragments xb.
__device__ __forceinline__ void raw_word_mma(float (&d)[4], u32 a, u32 b, const u32 (&xb)[4]) {
  mma(d, raw_pair(a), raw_pair(b), raw_pair(a >> 4), raw_pair(b >> 4), xb[0], xb[1]);
  mma(d, raw_pair(a >> 8), raw_pair(b >> 8), raw_pair(a >> 12), raw_pair(b >> 12), xb[2], xb[3]);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)
w4a16_gemv_mma(const u16* __restrict__ x, const u32* __restrict__ w, const scale_t* __restrict__ scale,
               const signed char* __restrict__ zero, u16* __restrict__ out, int m, int n_out, int k,
               int stride_x, int stride_w, int stride_s, int stride_z, int stride_o, int group_shift) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = k >> 7;
  const int rows = GATED ? 2 * n_out : n_out;
  const u32* next_a[TILES];  // the next chunk to copy of rows g and g + 8 of each tile
  const u32* next_b[TILES];
  const scale_t* scale_a[TILES];
  const scale_t* scale_b[TILES];
#if HAS_ZERO
  const signed char* zero_a[TILES];
  const signed char* zero_b[TILES];
#endif
#pragma unroll
  for (int i = 0; i < TILES; ++i) {
    const int tile = blockIdx.x * TILES + i;
    int ra, rb;
    if (GATED) {
      ra = min(tile * 8 + g, n_out - 1);  // outputs past n_out read a real row, never stored
      rb = n_out + ra;
    } else {
      ra = min(tile * 16 + g, rows - 1);
      rb = min(tile * 16 + g + 8, rows - 1);
    }
    next_a[i] = w + (long long)ra * stride_w + 4 * t + 16 * warp;
    next_b[i] = w + (long long)rb * stride_w + 4 * t + 16 * warp;
    scale_a[i] = scale + (long long)ra * stride_s;
    scale_b[i] = scale + (long long)rb * stride_s;
#if HAS_ZERO
    zero_a[i] = zero + (long long)ra * stride_z;
    zero_b[i] = zero + (long long)rb * stride_z;
#endif
  }
  const bool x_lane = g < m;
  const u16* x_next_p = x + (long long)(x_lane ? g : 0) * stride_x + 32 * t + 128 * warp;

  float acc[TILES][4];
#pragma unroll
  for (int i = 0; i < TILES; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[i][r] = 0.f;

  // This warp's ring: STAGES slots of TILES * 2 rows * 32 lanes * 16 bytes; a lane reads back only what
  // its own copies wrote, so no barrier orders the ring, only cp.async's groups.
  extern __shared__ uint4 shared[];
  uint4* ring = shared + warp * (STAGES * TILES * 2 * 32) + lane;
  u32 ring_address;  // the same as a shared-space address, computed once
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(ring_address) : "l"(ring));
  constexpr u32 SLOT_BYTES = TILES * 2 * 512;
  const int mine = chunks > warp ? (chunks - warp + WARPS - 1) / WARPS : 0;  // chunks warp + j * WARPS
  // The first STAGES - 1 chunks' weights before the PDL wait: no kernel writes them.
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) {
    if (j < mine) copy_chunk(ring_address + j * SLOT_BYTES, next_a, next_b);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  uint4 x_next[4];
  load_x_chunk(x_next, x_next_p, x_lane && mine > 0);
  x_next_p += 128 * WARPS;
  // A chunk's group scales (and zero points) are read a chunk ahead too.
  scale_t s_next[TILES][2];
#if HAS_ZERO
  signed char z_next[TILES][2];
#endif
  const int first_group = mine > 0 ? warp >> group_shift : 0;
#pragma unroll
  for (int i = 0; i < TILES; ++i) {
    s_next[i][0] = scale_a[i][first_group];
    s_next[i][1] = scale_b[i][first_group];
#if HAS_ZERO
    z_next[i][0] = zero_a[i][first_group];
    z_next[i][1] = zero_b[i][first_group];
#endif
  }

  // UNROLL 2: two chunks an iteration, so that the activations read a chunk ahead change registers by
  // renaming instead of 16 moves a chunk.
  constexpr int unroll = UNROLL;
#pragma unroll unroll
  for (int j = 0; j < mine; ++j) {
    const int c = warp + j * WARPS;
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");  // chunk j has landed
    const int ahead = j + STAGES - 1;  // into the slot chunk j - 1 left
    if (ahead < mine) copy_chunk(ring_address + (ahead % STAGES) * SLOT_BYTES, next_a, next_b);
    asm volatile("cp.async.commit_group;" ::: "memory");
    uint4 xv[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) xv[q] = x_next[q];
    load_x_chunk(x_next, x_next_p, x_lane && j + 1 < mine);
    x_next_p += 128 * WARPS;
    const uint4* slot = ring + (j % STAGES) * (TILES * 2 * 32);
    const int next_group = j + 1 < mine ? (c + WARPS) >> group_shift : 0;
#if LEAN
    // The chunk's B fragments once for every tile, and sum(x) of batch rows 2t and 2t + 1 (sx[0], sx[1];
    // [2] and [3] repeat them) by the MMA against ones, in two chains.
    u32 xb[4][4];
#pragma unroll
    for (int q = 0; q < 4; ++q) x_fragments(xb[q], xv[q]);
    float sx[4] = {0.f, 0.f, 0.f, 0.f}, sy[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      mma(q & 1 ? sy : sx, ONE_PAIR, ONE_PAIR, ONE_PAIR, ONE_PAIR, xb[q][0], xb[q][1]);
      mma(q & 1 ? sx : sy, ONE_PAIR, ONE_PAIR, ONE_PAIR, ONE_PAIR, xb[q][2], xb[q][3]);
    }
    const float sum0 = sx[0] + sy[0], sum1 = sx[1] + sy[1];
#endif
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
      const uint4 wa = slot[(2 * i) * 32], wb = slot[(2 * i + 1) * 32];
      const float sa = scale_value(s_next[i][0]), sb = scale_value(s_next[i][1]);
      // (The zero points' reads in each branch: shared, they cost the loop 2-3 instructions.)
#if LEAN
#if HAS_ZERO
      const float off_a = MAGIC_VALUE + 8.f + z_next[i][0], off_b = MAGIC_VALUE + 8.f + z_next[i][1];
      z_next[i][0] = zero_a[i][next_group];
      z_next[i][1] = zero_b[i][next_group];
#else
      const float off_a = MAGIC_VALUE + 8.f, off_b = off_a;
#endif
#else
#if HAS_ZERO
      const u32 neg_a = (NEG_MAGIC + 8 + z_next[i][0]) * 0x10001u;
      const u32 neg_b = (NEG_MAGIC + 8 + z_next[i][1]) * 0x10001u;
      z_next[i][0] = zero_a[i][next_group];
      z_next[i][1] = zero_b[i][next_group];
#else
      const u32 neg_a = (NEG_MAGIC + 8) * 0x10001u, neg_b = neg_a;
#endif
#endif
      s_next[i][0] = scale_a[i][next_group];
      s_next[i][1] = scale_b[i][next_group];
      // Two accumulators: the chunk's eight MMAs in two chains of four.
      float d[4] = {0.f, 0.f, 0.f, 0.f}, e[4] = {0.f, 0.f, 0.f, 0.f};
#if LEAN
      raw_word_mma(d, wa.x, wb.x, xb[0]);
      raw_word_mma(e, wa.y, wb.y, xb[1]);
      raw_word_mma(d, wa.z, wb.z, xb[2]);
      raw_word_mma(e, wa.w, wb.w, xb[3]);
      acc[i][0] += fmaf(-off_a, sum0, d[0] + e[0]) * sa;
      acc[i][1] += fmaf(-off_a, sum1, d[1] + e[1]) * sa;
      acc[i][2] += fmaf(-off_b, sum0, d[2] + e[2]) * sb;
      acc[i][3] += fmaf(-off_b, sum1, d[3] + e[3]) * sb;
#else
      word_mma(d, wa.x, wb.x, xv[0], neg_a, neg_b);
      word_mma(e, wa.y, wb.y, xv[1], neg_a, neg_b);
      word_mma(d, wa.z, wb.z, xv[2], neg_a, neg_b);
      word_mma(e, wa.w, wb.w, xv[3], neg_a, neg_b);
      acc[i][0] += (d[0] + e[0]) * sa;
      acc[i][1] += (d[1] + e[1]) * sa;
      acc[i][2] += (d[2] + e[2]) * sb;
      acc[i][3] += (d[3] + e[3]) * sb;
#endif
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  __syncwarp();  // every lane past its last read of the ring before any writes its sums there

  // The warps' sums, each in its own ring ([tile * 4 + r][lane] as floats), then one thread an output.
  float* partial = reinterpret_cast<float*>(shared);
  const int ring_floats = STAGES * TILES * 2 * 32 * 4;
#pragma unroll
  for (int i = 0; i < TILES; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) partial[warp * ring_floats + (i * 4 + r) * 32 + lane] = acc[i][r];
  __syncthreads();
  for (int e = threadIdx.x; e < TILES * 4 * 32; e += WARPS * 32) {
    const int i = e / 128, r = (e / 32) % 4, l = e % 32;
    const int b = 2 * (l & 3) + (r & 1);  // the C fragment's column: the batch row
    if (b >= m || (GATED && r >= 2)) continue;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) sum += partial[v * ring_floats + (i * 4 + r) * 32 + l];
    const int tile = blockIdx.x * TILES + i, gl = l >> 2;
    if (GATED) {
      const int col = tile * 8 + gl;
      if (col >= n_out) continue;
      float up = 0.f;
#pragma unroll
      for (int v = 0; v < WARPS; ++v) up += partial[v * ring_floats + (i * 4 + r + 2) * 32 + l];
      const float gate = from_out(to_out(sum));
      const float silu = from_out(to_out(gate / (1.f + __expf(-gate))));
      out[(long long)b * stride_o + col] = to_out(silu * from_out(to_out(up)));
    } else {
      const int row = tile * 16 + gl + (r >= 2 ? 8 : 0);
      if (row < rows) out[(long long)b * stride_o + row] = to_out(sum);
    }
  }
}
